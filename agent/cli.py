"""The ``kamera`` command: one subcommand per product, each a module with ``main(argv) -> int``.

Subcommands are looked up by name and imported only when run, so ``kamera --help`` stays fast
and a missing optional extra (server, video, browser) only affects the command that needs it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demos.reorder", "reordered documents answered in each reuse mode beside a full prefill"),
    "bench": ("bench.cli", "benchmarks: relocation, fidelity, ttft, traces, consistency, replicas, ..."),
    "serve": ("agent.server.cli", "OpenAI-compatible HTTP endpoint with agent sessions"),
    "store": ("agent.store_cli", "check or repair (gc) a store directory offline"),
    "video-qa": (
        "demos.video_qa",
        "answer questions over a long video whose frames slide through the window",
    ),
    "web-agent": ("demos.web_agent", "act on a web page from screenshots, step after step"),
    "train-demo-model": ("bench.train_world_model", "train the embedded vision-language model"),
    "world-video": ("demos.world", "write a video of the synthetic world and its questions with answers"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: kamera COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "Run 'kamera COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kamera: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    code: int = module.main(rest)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
