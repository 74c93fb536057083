"""``kamera bench store-share``: real ``kamera serve`` processes on one store directory, against
one process and against two on separate directories.

Traffic: the first ``--requests`` requests of the first ``--conversations`` agent conversations
(tau-bench airline by default, dev half, through ``bench.traces_data``), turn by turn across
conversations as concurrent agents would send them, rendered as chat messages the way
``bench consistency`` does (tool results as user turns, tool calls as JSON). Setups:

- ``one``: one server, one directory, every request;
- ``shared``: two servers on one ``--disk-path``, requests split between them (``--route
  conversation``: conversation c always to server c % 2, as a sticky load balancer does;
  ``request``: each turn of a conversation to the other server than its turn before, server
  (c + turn) % 2, the worst case of a stateless one);
- ``separate``: the same split over two servers on directories of their own.

Every request waits for the previous one's answer, and (unless ``--no-settle``) for the server
that answered to finish its background disk writes: an agent's think time between turns is
longer than a write. Per setup: the reused share of prompt tokens (``cached_tokens`` of the
OpenAI usage over ``prompt_tokens``), host and disk evictions, disk hits (entries another
process wrote, or this one's after host memory let them go), entries lost (reuse the planner
counted on whose store entry was gone), refused entries (misfiled, corrupt), dropped background
writes, and an offline check of the directory after a clean stop (``cache.store.scan``).

Answers: each request is also sent once with a fresh ``cache_salt`` (a namespace nothing was
stored in: a full prefill). In ``--mode exact`` every answer's greedy tokens must equal the full
prefill's, or the command exits 1; the largest gap between their logprobs is reported beside it
(0.0 is bit for bit). In ``repair``/``fast``, reuse by content is approximate by design and the
agreement is reported only.

Not here: concurrent requests (one at a time, so the figures repeat), the shared Redis tier
(``bench replicas``), timings beyond wall time per setup.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from rich.console import Console
from rich.table import Table

from agent.modes import REUSE_MODES
from agent.tables import make_console
from agent.tables import print_table as draw
from bench.traces import SETS
from bench.traces_data import load_sessions
from bench.traces_tokens import message_body
from cache.store import scan
from tools.serve import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
ROLES = ("system", "user", "assistant")
Messages = list[dict[str, Any]]


class Conversation(NamedTuple):
    id: str
    requests: tuple[Messages, ...]  # each the full message list of one model call


class Answer(NamedTuple):
    tokens: tuple[str, ...]  # the greedy tokens
    logprobs: tuple[float, ...]  # of each
    text: str
    prompt_tokens: int
    cached_tokens: int
    lost_entries: int


def chat_messages(request: Sequence[dict[str, Any]]) -> Messages:
    """Trace messages as chat messages: tool results as user turns, tool calls as JSON."""
    return [
        {"role": m.get("role") if m.get("role") in ROLES else "user", "content": message_body(m)}
        for m in request
    ]


def load_conversations(sets: str, split: str, conversations: int, requests: int) -> list[Conversation]:
    """The first ``requests`` requests of the first ``conversations`` sessions, spread over ``sets``."""
    per_set: list[list[Conversation]] = []
    for name in sets.split(","):
        if name not in SETS:
            raise KeyError(f"unknown trace set {name!r}; known: {sorted(SETS)}")
        sessions = load_sessions(SETS[name], split)  # type: ignore[arg-type]
        per_set.append(
            [Conversation(s.id, tuple(chat_messages(r) for r in s.requests[:requests])) for s in sessions]
        )
    out: list[Conversation] = []
    for i in range(max(map(len, per_set), default=0)):  # one of each set in turn
        out += [convs[i] for convs in per_set if i < len(convs)]
    return out[:conversations]


class Server:
    """One ``kamera serve`` process of this checkout on store directory ``disk``."""

    def __init__(
        self,
        disk: Path,
        *,
        model: str | None,
        host_bytes: int,
        disk_bytes: int,
        mode: str,
        threads: int = 1,
        timeout_s: float = 300,
    ) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-c", "from agent.cli import main; raise SystemExit(main())", "serve"]
        cmd += ["--port", str(self.port), "--threads", str(threads), "--log-level", "warning"]
        cmd += ["--disk-path", str(disk), "--disk-bytes", str(disk_bytes), "--host-bytes", str(host_bytes)]
        cmd += ["--reuse-mode", mode, *(["--model", model] if model else [])]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        env.pop("KAMERA_API_KEYS", None)
        # the process's output, read back if it dies; closed in stop() (it outlives this call)
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=timeout_s)
        self._timeout_s = timeout_s

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + self._timeout_s
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"kamera serve exited with {self.proc.returncode}: {self._log.read()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kamera serve did not become healthy")
            time.sleep(0.2)

    def ask(self, messages: Messages, max_tokens: int, salt: str | None = None) -> Answer:
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
        }
        if salt is not None:
            body["cache_salt"] = salt
        r = self.client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"chat completion failed with {r.status_code}: {r.text[:500]}")
        out = r.json()
        choice, usage = out["choices"][0], out["usage"]
        lps = (choice.get("logprobs") or {}).get("content") or []
        return Answer(
            tuple(t["token"] for t in lps),
            tuple(float(t["logprob"]) for t in lps),
            choice["message"]["content"] or "",
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            out["kamera"]["lost_entries"],
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics`` by name and labels: ``kamera_store_hits_total{tier="disk"}``."""
        out = {}
        for line in self.client.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def settle(self, timeout_s: float = 120) -> None:
        """Until the background disk writer's queue is empty."""
        deadline = time.monotonic() + timeout_s
        while self.metrics().get("kamera_store_write_queue", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        """A clean stop (SIGTERM: drain, flush the store); killed if it takes too long."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.client.close()
        self._log.close()


class Turn(NamedTuple):
    server: int
    conversation: int
    step: int
    messages: Messages


def schedule(conversations: Sequence[Conversation], n_servers: int, route: str) -> list[Turn]:
    """Turn by turn across conversations; each request's server by ``route``."""
    turns: list[Turn] = []
    for step in range(max((len(c.requests) for c in conversations), default=0)):
        for c, conv in enumerate(conversations):
            if step < len(conv.requests):
                server = (c if route == "conversation" else c + step) % n_servers
                turns.append(Turn(server, c, step, conv.requests[step]))
    return turns


REFUSALS = ("misfiled", "corrupt_dropped")
STORE_COUNTERS = ("evictions", "hits", *REFUSALS)


def run_setup(
    dirs: Sequence[Path], turns: Sequence[Turn], args: argparse.Namespace, console: Console
) -> tuple[dict[str, Any], list[Answer], Server]:
    """Replay ``turns`` over one server per entry of ``dirs``; the figures, the answers in turn
    order, and the first server, still running (the caller stops it)."""
    servers = [
        Server(d, model=args.model, host_bytes=args.host_bytes, disk_bytes=args.disk_bytes, mode=args.mode)
        for d in dirs
    ]
    try:
        for s in servers:
            s.wait_ready()
        t0 = time.perf_counter()
        answers = []
        for turn in turns:
            server = servers[turn.server]
            answers.append(server.ask(turn.messages, args.max_tokens))
            if args.settle:
                server.settle()
        wall = time.perf_counter() - t0
        samples = [s.metrics() for s in servers]
    except BaseException:
        for s in servers:
            s.stop()
        raise
    for s in servers[1:]:
        s.stop()

    def total(name: str) -> int:
        return int(sum(m.get(name, 0) for m in samples))

    row: dict[str, Any] = {
        "servers": len(servers),
        "directories": len(set(dirs)),
        "requests": len(answers),
        "prompt_tokens": sum(a.prompt_tokens for a in answers),
        "cached_tokens": sum(a.cached_tokens for a in answers),
        "lost_entries": sum(a.lost_entries for a in answers),
        "writes_dropped": total('kamera_store_background_writes_total{outcome="dropped"}'),
        "replay_s": wall,
    }
    row["reused_share"] = row["cached_tokens"] / max(row["prompt_tokens"], 1)
    for tier in ("host", "disk"):
        for name in STORE_COUNTERS:
            row[f"{tier}_{name}"] = total(f'kamera_store_{name}_total{{tier="{tier}"}}')
    console.log(f"{len(servers)} server(s) on {len(set(dirs))} dir(s): reused {row['reused_share']:.3f}")
    return row, answers, servers[0]


def check_dirs(dirs: Sequence[Path], budget: int) -> dict[str, Any]:
    """An offline check of each directory after a clean stop (nothing repaired)."""
    reports = [scan(d, budget=budget, repair=False, verify_indexed=True) for d in sorted(set(dirs))]
    return {
        "directories_clean": all(r.clean for r in reports),
        "disk_entries": sum(r.entries for r in reports),
        "disk_bytes": sum(r.bytes for r in reports),
        "problems": [p for r in reports for p in r.problems][:20],
    }


def agreement(answers: Sequence[Answer], reference: Sequence[Answer]) -> int:
    """How many answers have the reference's greedy tokens."""
    return sum(a.tokens == r.tokens for a, r in zip(answers, reference, strict=True))


def logprob_gap(answers: Sequence[Answer], reference: Sequence[Answer]) -> float:
    """The largest difference of a generated token's logprob from the reference's, over the
    answers with the reference's tokens (0.0: bit for bit)."""
    gaps = [
        abs(x - y)
        for a, r in zip(answers, reference, strict=True)
        if a.tokens == r.tokens
        for x, y in zip(a.logprobs, r.logprobs, strict=True)
    ]
    return max(gaps, default=0.0)


def measure(conversations: Sequence[Conversation], args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The three setups and the full-prefill reference; see the module docstring."""
    console = make_console(stderr=True)
    turns = schedule(conversations, 2, args.route)
    single = [t._replace(server=0) for t in turns]
    rows: dict[str, Any] = {}
    answers: dict[str, list[Answer]] = {}
    setups = {
        "one": (single, [root / "one"]),
        "shared": (turns, [root / "shared", root / "shared"]),
        "separate": (turns, [root / "a", root / "b"]),
    }
    reference: list[Answer] = []
    for name, (order, dirs) in setups.items():
        rows[name], answers[name], first = run_setup(dirs, order, args, console)
        try:
            if not reference:  # on the first server, after its figures were read
                stamp = time.time_ns()
                reference = [
                    first.ask(t.messages, args.max_tokens, salt=f"full-prefill-{i}-{stamp}")
                    for i, t in enumerate(turns)
                ]
        finally:
            first.stop()
        rows[name].update(check_dirs(dirs, args.disk_bytes))
    for name, row in rows.items():
        row["per_request"] = [
            {
                "conversation": conversations[t.conversation].id,
                "step": t.step,
                "server": t.server if name != "one" else 0,
                "prompt_tokens": a.prompt_tokens,
                "cached_tokens": a.cached_tokens,
                "equal_to_full_prefill": a.tokens == r.tokens,
                "text": a.text,
                "full_prefill_text": r.text,
            }
            for t, a, r in zip(turns, answers[name], reference, strict=True)
        ]
        row["equal_to_full_prefill"] = agreement(answers[name], reference)
        row["max_logprob_gap"] = logprob_gap(answers[name], reference)
        row["equal_to_one_server"] = agreement(answers[name], answers["one"])
        one = rows["one"]["reused_share"]
        row["of_one_server"] = row["reused_share"] / one if one else None
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kamera bench store-share", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    ap.add_argument("--sets", default="tau", help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="first N requests of each conversation")
    ap.add_argument("--route", default="conversation", choices=["conversation", "request"])
    ap.add_argument("--mode", default="exact", choices=REUSE_MODES, help="server reuse mode")
    ap.add_argument("--model", default=None, help="kamera serve --model (default: the embedded SmolLM2)")
    ap.add_argument("--host-bytes", type=int, default=1 << 30, help="per server")
    ap.add_argument("--disk-bytes", type=int, default=1 << 30, help="per directory")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-settle", dest="settle", action="store_false", help="never wait for disk writes")
    ap.add_argument("--dir", default=None, help="keep the store directories here (default: a temporary one)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    conversations = load_conversations(args.sets, args.split, args.conversations, args.requests)
    if not conversations:
        print("kamera bench store-share: no conversations loaded")
        return 2
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kamera-store-share-"))
    try:
        rows = measure(conversations, args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "config": {
            k: getattr(args, k)
            for k in ("split", "sets", "route", "mode", "model", "host_bytes", "disk_bytes", "max_tokens")
        }
        | {"settle": args.settle, "conversations": [c.id for c in conversations], "requests": args.requests},
        "rows": rows,
    }
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    print_table(make_console(), result)
    wrong = [name for name, row in rows.items() if row["equal_to_full_prefill"] != row["requests"]]
    sound = all(row["directories_clean"] for row in rows.values())
    return 1 if (args.mode == "exact" and wrong) or not sound else 0


def print_table(console: Console, result: dict[str, Any]) -> None:
    cfg = result["config"]
    table = Table(
        title=f"Store directories shared by kamera serve processes ({cfg['sets']}, {cfg['split']} half, "
        f"route by {cfg['route']}, {cfg['mode']} mode)"
    )
    cols = (
        ("setup", None),
        ("reused", "reused_share"),
        ("of one", "of_one_server"),
        ("= full prefill", "equal_to_full_prefill"),
        ("logprob gap", "max_logprob_gap"),
        ("host evict", "host_evictions"),
        ("disk evict", "disk_evictions"),
        ("disk hits", "disk_hits"),
        ("lost", "lost_entries"),
        ("refused", None),
        ("writes dropped", "writes_dropped"),
        ("dir clean", "directories_clean"),
        ("replay s", "replay_s"),
    )
    for name, _ in cols:
        table.add_column(name, justify="right")
    for name, row in result["rows"].items():
        cells = [name]
        for label, key in cols[1:]:
            if label == "refused":
                value: Any = sum(row[f"{t}_{c}"] for t in ("host", "disk") for c in REFUSALS)
            else:
                value = row[key]
            if key == "max_logprob_gap":
                cells.append(f"{value:.1e}")
            elif isinstance(value, float):
                cells.append(f"{value:.3f}" if key != "replay_s" else f"{value:.0f}")
            elif key == "equal_to_full_prefill":
                cells.append(f"{value}/{row['requests']}")
            else:
                cells.append("-" if value is None else str(value))
        table.add_row(*cells)
    draw(console, table)
