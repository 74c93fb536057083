"""Time to first token of ``kamera serve`` on a cached prompt, measured as a client meets it.

Real ``kamera serve`` processes on loopback, one at a time, each fed the same agent-shaped
conversations: a system turn and ten ~280-token user turns with short assistant replies, then a
question (sent once: its prompt is stored), then the same conversation one turn longer (its
leading ~3,000 tokens are an exact cached prefix), and that longer request again with a fresh
``cache_salt`` (nothing reused: the full prefill). Time to first token is taken at the first
streamed content delta.

``--tree NAME=PATH`` (repeatable) runs the server from another checkout of this project (its
``PYTHONPATH``), so that two versions are measured side by side in one run; rounds alternate
the order of the trees so that a slow spell on a shared machine falls on both. Default: this
checkout alone.

    kamera bench serve-ttft --reuse-mode exact --rounds 3 --trials 4 --json serve_ttft.json
    kamera bench serve-ttft --tree before=../old --tree after=. --json ab.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.modes import REUSE_MODES
from tools.serve import free_port, wait_healthy

HERE = Path(__file__).resolve().parents[1]


def _paragraph(i: int) -> str:
    return f"the harbour ledger of year {i} records ships, sails, captains and barrels carried at dawn; " * 14


def conversation(tag: str, trial: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The stored request and the request one turn longer whose prefix it is."""
    hist = [{"role": "system", "content": f"You answer questions about harbour ledgers. Run {tag}."}]
    for i in range(10):
        hist.append({"role": "user", "content": _paragraph(100 * trial + i)})
        hist.append({"role": "assistant", "content": f"Noted ledger {i}."})
    first = [*hist, {"role": "user", "content": "Which ledger mentions captains?"}]
    longer = [*first, {"role": "assistant", "content": "Ledger 3."},
              {"role": "user", "content": "And which mentions barrels?"}]  # fmt: skip
    return first, longer


class Server:
    """One ``kamera serve`` process from the checkout at ``tree``, on a free loopback port."""

    def __init__(self, tree: Path, reuse_mode: str, threads: int, log: Path) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "agent.cli", "serve", "--port", str(self.port),
               "--reuse-mode", reuse_mode, "--max-prompt-tokens", "8192", "--log-level", "warning",
               "--threads", str(threads)]  # fmt: skip
        with log.open("ab") as err:
            self.proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_healthy(self.proc, self.port, f"kamera serve from {tree}", log)
        except RuntimeError:
            self.close()
            raise
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models") as r:
            self.model = json.load(r)["data"][0]["id"]

    def ttft(self, messages: list[dict[str, str]], salt: str | None = None) -> float:
        """Seconds from sending the request to its first streamed content delta."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": 1,
                                "temperature": 0, "stream": True}  # fmt: skip
        if salt:
            body["cache_salt"] = salt
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        first = None
        for line in resp:
            if first is None and line.startswith(b"data:") and b'"content"' in line:
                first = time.perf_counter() - t0
        conn.close()
        return first if first is not None else time.perf_counter() - t0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run(
    trees: dict[str, Path], reuse_mode: str, rounds: int, trials: int, threads: int, log: Path
) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {n: {"cached": [], "full": []} for n in trees}
    names = list(trees)
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            server = Server(trees[name], reuse_mode, threads, log)
            try:
                for t in range(trials):
                    first, longer = conversation(f"{rnd}-{t}", t)
                    server.ttft(first)  # stored
                    samples[name]["cached"].append(server.ttft(longer))
                    samples[name]["full"].append(server.ttft(longer, salt=f"fresh-{rnd}-{t}-{name}"))
            finally:
                server.close()
            got = samples[name]
            cached = [round(x, 3) for x in got["cached"][-trials:]]
            full = [round(x, 3) for x in got["full"][-trials:]]
            print(f"{name} round {rnd}: cached {cached} full {full}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"reuse_mode": reuse_mode, "rounds": rounds, "trials": trials, "threads": threads}
    for name, got in samples.items():
        cached, full = statistics.median(got["cached"]), statistics.median(got["full"])
        out[name] = {"tree": str(trees[name]), "cached_ttft_s": cached, "full_ttft_s": full,
                     "full_over_cached": full / cached, "samples": got}  # fmt: skip
    return out


def _tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not (Path(path) / "agent" / "cli.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree takes NAME=PATH of a checkout of kamera, not {text!r}")
    return name, Path(path).resolve()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kamera bench serve-ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=_tree, action="append", help="NAME=PATH of a checkout (repeatable)")
    p.add_argument("--reuse-mode", choices=REUSE_MODES, default="repair")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trials", type=int, default=4, help="conversations per server per round")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.trials < 1 or args.threads < 1:
        p.error("--rounds, --trials and --threads must be >= 1")
    trees = dict(args.tree or [("this", HERE)])
    log = Path(args.json or "serve_ttft").with_suffix(".log")
    report = run(trees, args.reuse_mode, args.rounds, args.trials, args.threads, log)
    for name in trees:
        r = report[name]
        print(f"{name:>10}: cached {r['cached_ttft_s']:.3f} s, full prefill {r['full_ttft_s']:.3f} s, "
              f"{r['full_over_cached']:.1f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
