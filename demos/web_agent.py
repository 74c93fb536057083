"""``kamera web-agent``: act on web pages from screenshots, one action a step.

Each step takes one screenshot of a headless Chromium page (``tools/browser.py``) into the
window, asks the model for one action in the grammar of ``agent/policies.py`` (policy
``action``), parses it, and executes it. The window keeps the last ``--keep`` screenshots; older
ones slide out to the store. A screenshot seen before is never encoded again: if it is still the
latest screenshot in the window nothing is added, if it slid out it is recalled (canonical KV +
patch, rotated), and if it sits earlier in the window it is moved to the end the same way. The vision encoder
therefore runs once per distinct screenshot over the whole run.

The model's answers are decoded under the action grammar (``agent/policies.py``,
``ActionPolicy.grammar``), so they always parse: a model that cannot spell the actions in its
vocabulary is a clear error, not a run of retries. Under a script the model still answers each
screenshot under the grammar (not acted on; each step and the summary count
``model_parse_errors``). ``--no-grammar`` lets the model write freely. An answer that does not
parse (free, or scripted) is reported and asked again (``--retries`` times in a row) before the
run ends; a refused navigation (outside the allowlist) is reported and the run goes on. A
scripted policy (``--policy script.json``, a JSON list of action strings) replays given answers
in place of the model's, through the same parser; the model still runs on every screenshot so
the cache figures are real, unless ``--no-model``.

The run folder holds every screenshot, ``steps.json`` (actions, model outputs, cache figures
per step), ``actions.txt`` and ``report.html`` (``demos/report.py``).

Not here: several tabs, downloads, credentials, or any fencing beyond the browser's allowlist.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.adapters.base import ModelAdapter
from agent.adapters.loading import ModelNotFoundError, UnsupportedModelError
from agent.adapters.vision import encoder_calls
from agent.context import ContextManager, WindowConfig
from agent.grammar import GrammarError
from agent.loop import Agent
from agent.policies import MIN_ACTION_TOKENS, Action, ActionPolicy, Unparsed
from cache.keys import digest_key
from demos.report import render_run
from demos.vl_model import TINY, UsageError, load_vl_adapter

SYSTEM_PROMPT = (
    "You operate a web browser to complete a task. Each turn shows a screenshot of the page. "
    'Reply with exactly one action, one of: click(x, y), type("text"), press("Enter"), '
    'scroll(dx, dy), goto("https://..."), back(), done("answer"). Coordinates are integers '
    "in screenshot pixels."
)
SCREENSHOT = "screenshot"


@dataclass
class RunState:
    finished: bool = False
    answer: str | None = None
    reason: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)
    distinct: set[str] = field(default_factory=set)


class Script:
    """Given answers, one per ask, in order."""

    def __init__(self, path: Path) -> None:
        try:
            items = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--policy {path}: not a readable JSON file ({e})") from None
        if not isinstance(items, list) or not all(isinstance(a, str) for a in items):
            raise UsageError(f"--policy {path}: must be a JSON list of action strings")
        self._items: Iterator[str] = iter(items)

    def next(self) -> str | None:
        return next(self._items, None)


class WebSession:
    """The window of one run: screenshots in, one model answer per ask."""

    def __init__(self, adapter: ModelAdapter, args: argparse.Namespace) -> None:
        self.adapter = adapter
        self.args = args
        self.agent = Agent(
            adapter,
            SYSTEM_PROMPT,
            WindowConfig(budget_tokens=args.budget),
            policy="action",
            max_new_tokens=args.max_new_tokens,
            constrain=not args.no_grammar,
        )

    @property
    def cm(self) -> ContextManager:
        return self.agent.context

    def observe(self, image: Any, url: str, step: int) -> tuple[str, str]:
        """Put the screenshot at the end of the window. Returns (content id, how it got there)."""
        chunk = self.adapter.image(image)  # type: ignore[attr-defined]
        if chunk.n_tokens + self.cm.view()[0].n_tokens > self.args.budget:
            raise UsageError(
                f"a screenshot is {chunk.n_tokens} tokens: --budget {self.args.budget} is too small"
            )
        cid, source = self.cm.ensure(chunk, {"kind": SCREENSHOT, "url": url, "step": step})
        shots = [i for i, v in enumerate(self.cm.view()) if v.kind == SCREENSHOT]
        for index in reversed(shots[: max(0, len(shots) - self.args.keep)]):
            self.cm.slide_at(index)
        return cid, source

    def ask(self, instruction: str) -> tuple[str, float]:
        """The model's answer to ``instruction`` on the window, and its time to first token (ms)."""
        result = self.agent.step([], instruction)
        return result.output, result.report.ttft_ms

    def figures(self) -> dict[str, Any]:
        c = self.cm.counters
        view = self.cm.view()
        return {
            "tokens_prefilled": c.tokens_prefilled,
            "tokens_reused": c.tokens_reused,
            "tokens_rotated": c.tokens_rotated,
            "patches_applied": c.patches_applied,
            "vision_encoder_calls": encoder_calls(self.adapter),
            "window_tokens": self.cm.tokens,
            "window_chunks": len(view),
            "screenshots_in_window": sum(v.kind == SCREENSHOT for v in view),
            "evicted": len(self.cm.evicted),
        }


def instruction(task: str, url: str, last: str | None, parse_error: str | None) -> str:
    text = f"Task: {task}\nCurrent URL: {url}\n"
    if last:
        text += f"Previous action: {last}\n"
    if parse_error:
        text += f"Your last reply could not be parsed ({parse_error}). "
    return text + "Reply with exactly one action."


def execute(browser: Any, action: Action) -> Any:
    """Run one grammar action on the browser; returns its ``ActionResult``."""
    calls = {
        "click": browser.click,
        "type": browser.type,
        "press": browser.press,
        "scroll": browser.scroll,
        "goto": browser.goto,
        "back": browser.back,
    }
    return calls[action.kind](*action.args)


def step_once(
    browser: Any,
    session: WebSession | None,
    script: Script | None,
    args: argparse.Namespace,
    state: RunState,
    shots: Path,
    last: str | None,
) -> str | None:
    """One screenshot, one action. Returns the action's outcome line, or None when the run ends."""
    from PIL import Image

    i = len(state.steps)
    png = browser.screenshot()
    name = f"step_{i:03d}.png"
    (shots / name).write_bytes(png)
    url = browser.url
    record: dict[str, Any] = {"step": i, "url": url, "screenshot": f"screenshots/{name}", "outputs": []}
    record["parse_errors"] = []
    state.steps.append(record)
    t0 = time.perf_counter()
    observe_ms = 0.0
    if session is not None:
        cid, record["source"] = session.observe(Image.open(io.BytesIO(png)).convert("RGB"), url, i)
        state.distinct.add(cid)
        observe_ms = 1000 * (time.perf_counter() - t0)
    else:
        state.distinct.add(digest_key("screenshot", [png]).hex)
    policy = ActionPolicy()
    parse_error: str | None = None
    action: Action | None = None
    for attempt in range(args.retries + 1):
        text = instruction(args.task, url, last, parse_error)
        output: str | None = None
        if session is not None and (script is None or attempt == 0):
            output, ttft = session.ask(text)
            record["outputs"].append(output)
            record.setdefault("ttft_ms", observe_ms + ttft)
            record.setdefault("model_parse_errors", 0)
            record["model_parse_errors"] += isinstance(policy.parse(output), Unparsed)
        if script is not None:
            output = script.next()
            if output is None:
                state.reason = "the script ran out of actions"
                break
            record["outputs"].append(f"[script] {output}")
        if output is None:  # unreachable: a run has a model, a script or both
            break
        parsed = policy.parse(output)
        if isinstance(parsed, Unparsed):
            parse_error = parsed.reason
            record["parse_errors"].append(parsed.reason)
            continue
        action = parsed
        break
    record.setdefault("ttft_ms", None)
    if session is not None:
        record["cache"] = session.figures()
    if action is None:
        state.reason = state.reason or f"no parseable action after {args.retries + 1} answers: {parse_error}"
        return None
    record["action"] = str(action)
    if action.kind == "done":
        state.finished, state.answer, state.reason = True, str(action.args[0]), "done"
        record["result_ok"], record["url_after"] = True, url
        return None
    result = execute(browser, action)
    record.update(result_ok=result.ok, url_after=result.url, error=result.error)
    record["refused"] = bool(result.error and result.error.startswith("refused"))
    return f"{action} -> {'ok' if result.ok else result.error}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tools.browser import Browser, BrowserConfig

    if args.max_steps <= 0 or args.keep <= 0 or args.retries < 0 or args.budget <= 0:
        raise UsageError("--max-steps, --keep and --budget must be positive, --retries non-negative")
    try:
        width, height = (int(x) for x in args.viewport.lower().split("x"))
        config = BrowserConfig(
            viewport_width=width, viewport_height=height, allowed_origins=tuple(args.allow)
        )
    except ValueError as e:
        raise UsageError(f"--viewport/--allow: {e}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    script = Script(args.policy) if args.policy else None
    if not args.no_model and not args.no_grammar and args.max_new_tokens < MIN_ACTION_TOKENS:
        raise UsageError(f"--max-new-tokens must be at least {MIN_ACTION_TOKENS} under the action grammar")
    if script is None and args.no_model:
        raise UsageError("--no-model needs a scripted --policy")
    try:
        browser_cm = Browser(args.start_url, config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    session = None if args.no_model else WebSession(load_vl_adapter(args.model), args)
    run_dir = args.out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    shots = run_dir / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    state = RunState()
    t0 = time.perf_counter()
    from playwright.sync_api import Error as PlaywrightError

    with browser_cm as browser:
        start = browser.start_result
        last: str | None = None
        if start is not None and not start.ok:
            state.reason = f"error: the start page did not load: {start.error}"
        else:
            try:
                while len(state.steps) < args.max_steps:
                    last = step_once(browser, session, script, args, state, shots, last)
                    if last is None:
                        break
                else:
                    state.reason = f"reached --max-steps {args.max_steps}"
            except PlaywrightError as e:
                state.reason = f"error: {type(e).__name__}: {e.message}"
        refused, blocked = list(browser.refused), len(browser.blocked)
    summary: dict[str, Any] = {
        "start_url": args.start_url,
        "task": args.task,
        "model": "none" if session is None else session.adapter.info.name,
        "finished": state.finished,
        "answer": state.answer,
        "reason": state.reason,
        "steps": [
            {"action": s.get("action"), "url": s["url"], "ttft_ms": s.get("ttft_ms")} for s in state.steps
        ],
        "vision_encoder_calls": 0 if session is None else encoder_calls(session.adapter),
        "distinct_screenshots": len(state.distinct),
        "refused": refused,
        "model_parse_errors": sum(s.get("model_parse_errors", 0) for s in state.steps),
        "blocked_requests": blocked,
        "total_s": time.perf_counter() - t0,
        "run_dir": str(run_dir),
    }
    if session is not None:
        summary["window"] = session.agent.snapshot()["window"]
    (run_dir / "steps.json").write_text(json.dumps(state.steps, indent=2))
    (run_dir / "actions.txt").write_text("".join(f"{s.get('action') or '(none)'}\n" for s in state.steps))
    table = {k: v for k, v in summary.items() if k not in ("steps", "window")}
    (run_dir / "report.html").write_text(render_run(f"Web agent run: {args.task}", table, state.steps))
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kamera web-agent", description="Act on web pages from screenshots.")
    p.add_argument("--start-url", required=True, help="http(s) URL to open first")
    p.add_argument("--task", required=True, help="what the agent should do")
    p.add_argument(
        "--model", help=f"Qwen2.5-VL checkpoint folder, or '{TINY}' (default: tools/world/world_vl)"
    )
    p.add_argument("--policy", type=Path, help="script.json: a JSON list of actions replayed in order")
    p.add_argument("--no-model", action="store_true", help="with --policy: do not run the model")
    p.add_argument("--keep", type=int, default=3, help="screenshots kept in the window (3)")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--retries", type=int, default=2, help="new answers asked after an unparseable one (2)")
    p.add_argument("--budget", type=int, default=8192, help="window token budget (8192)")
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="per answer (32; at least 20 under the grammar)"
    )
    p.add_argument(
        "--no-grammar", action="store_true", help="let the model write freely (answers may not parse)"
    )
    p.add_argument("--allow", action="append", default=[], help="allowed origin (default: the start URL's)")
    p.add_argument("--viewport", default="1280x800", help="WIDTHxHEIGHT (1280x800)")
    p.add_argument("--out", type=Path, help="run folder (default runs/<timestamp>)")
    p.add_argument("--json", type=Path, help="write a machine-readable summary here")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    return p


def print_summary(summary: dict[str, Any]) -> None:
    for i, s in enumerate(summary["steps"]):
        ttft = "" if s["ttft_ms"] is None else f"  ttft {s['ttft_ms']:.0f} ms"
        print(f"{i:3d}  {s['url']}  {s['action'] or '(no action)'}{ttft}")
    print(
        f"finished: {summary['finished']} ({summary['reason']}); {len(summary['steps'])} steps, "
        f"{summary['distinct_screenshots']} distinct screenshots, "
        f"{summary['vision_encoder_calls']} vision encoder calls; run folder {summary['run_dir']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    from tools.browser import BrowserError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        summary = run(args)
    except (UsageError, BrowserError, ModelNotFoundError, UnsupportedModelError) as e:
        print(f"kamera web-agent: error: {e}", file=sys.stderr)
        return 2
    except GrammarError as e:
        print(f"kamera web-agent: error: {e} (--no-grammar decodes freely)", file=sys.stderr)
        return 2
    print_summary(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["finished"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
