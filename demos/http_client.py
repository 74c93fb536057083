"""A client of ``kamera serve``: one chat through the openai client, or a load run that measures
time to first token for prompts whose content the server has cached at another position.

    python -m demos.http_client chat --url http://127.0.0.1:8000
    python -m demos.http_client load --serve smollm2 --requests 200 --concurrency 8 --json out.json

``load`` sends ``--docs`` distinct documents once each (uncached), then the remaining requests
reuse those documents behind a first system line that changes every time (so every cached
token sits at another position). It reports status codes, the server's time to first token
(``kamera.ttft_ms``: from the job starting on the model thread to the first token) and the
client's (first streamed token, queueing included), split into uncached and cached requests.
``--serve MODEL`` starts a ``kamera serve`` process on a free loopback port.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

TOPICS = [
    "harbour",
    "orchard",
    "observatory",
    "railway",
    "library",
    "glacier",
    "market",
    "foundry",
    "mill",
    "canal",
]


def document(d: int, sentences: int) -> str:
    topic = TOPICS[d % len(TOPICS)]
    return " ".join(
        f"Note {i} on the {topic} {d}: the {['north', 'east', 'south', 'west'][i % 4]} gate opened at "
        f"{(7 * i + d) % 24}:{(13 * i) % 60:02d} and {3 * i + d} visitors came through."
        for i in range(sentences)
    )


@contextmanager
def server(model: str | None, threads: int | None = None) -> Iterator[str | None]:
    """A ``kamera serve`` process for ``model`` (``smollm2``: the embedded default) while the block
    runs; None when no model is asked for (``--url`` names a running server instead)."""
    if model is None:
        yield None
        return
    from tools.serve import ServeProcess

    args = ["--queue-size", "64", "--max-tokens", "256", "--default-max-tokens", "16"]
    args += [] if model == "smollm2" else ["--model", model]
    args += ["--threads", str(threads)] if threads else []
    with ServeProcess(args, timeout_s=600) as proc:
        yield proc.url


def chat(url: str, api_key: str) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=api_key)
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is a KV cache?"},
        ],
        max_tokens=32,
        temperature=0,
    )
    print(resp.choices[0].message.content)
    print("usage:", resp.usage)
    return 0


def one_request(url: str, api_key: str, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=600,
    ) as r:
        status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and data.get("choices") and "role" not in data["choices"][0]["delta"]:
                first = time.perf_counter() - t0
            usage = data.get("usage") or usage
    return {"status": status, "client_ttft_s": first, "usage": usage}


def plain_request(url: str, api_key: str, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=600
    )
    out: dict[str, Any] = {"status": r.status_code, "latency_s": time.perf_counter() - t0}
    if r.status_code == 200:
        data = r.json()
        out["server_ttft_ms"] = data["kamera"]["ttft_ms"]
        out["queue_ms"] = data["kamera"]["queue_ms"]
        out["cached_tokens"] = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        out["prompt_tokens"] = data["usage"]["prompt_tokens"]
    return out


def load(args: argparse.Namespace, url: str) -> int:
    docs = [document(d, args.sentences) for d in range(args.docs)]

    def job(i: int) -> dict[str, Any]:
        d = i % args.docs
        stamp = f"Request {i} of run {args.seed}" + (", priority" * (i % 3)) if i >= args.docs else "Request"
        system = f"{stamp}\n{docs[d]}"
        question = f"When did the gate open in note {i % 7}?"
        send = one_request if args.stream else plain_request
        res = send(url, args.api_key, system, question, args.max_tokens)
        res["cached"] = i >= args.docs
        return res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        cold = list(pool.map(job, range(args.docs)))
        warm = list(pool.map(job, range(args.docs, args.requests)))
    wall = time.perf_counter() - t0
    results = cold + warm
    codes: dict[int, int] = {}
    for r in results:
        codes[r["status"]] = codes.get(r["status"], 0) + 1

    def p50(rows: Sequence[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    key = "client_ttft_s" if args.stream else "server_ttft_ms"
    summary = {
        "requests": len(results),
        "concurrency": args.concurrency,
        "wall_s": round(wall, 1),
        "status_codes": codes,
        "server_errors": sum(n for c, n in codes.items() if c >= 500),
        f"p50_{key}_uncached": p50(cold, key),
        f"p50_{key}_cached": p50(warm, key),
        "p50_latency_s_uncached": p50(cold, "latency_s"),
        "p50_latency_s_cached": p50(warm, "latency_s"),
        "p50_queue_ms_cached": p50(warm, "queue_ms"),
        "mean_cached_share": statistics.mean(
            r["cached_tokens"] / r["prompt_tokens"] for r in warm if r.get("prompt_tokens")
        )
        if warm
        else None,
        "prompt_tokens_p50": p50(results, "prompt_tokens"),
    }
    un, ca = summary[f"p50_{key}_uncached"], summary[f"p50_{key}_cached"]
    summary["ttft_ratio_cached_over_uncached"] = round(ca / un, 4) if un and ca else None
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)
    return 0 if summary["server_errors"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="demos.http_client")
    p.add_argument("mode", choices=["chat", "load"])
    p.add_argument("--url", default=None, help="a running server (default: --serve one here)")
    p.add_argument("--serve", default=None, help="start a kamera serve process for MODEL (e.g. smollm2)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--docs", type=int, default=10)
    p.add_argument("--sentences", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", action="store_true", help="measure the client's time to first token instead")
    p.add_argument("--json", default=None)
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads of a --serve server")
    args = p.parse_args(argv)
    if args.url is None and args.serve is None:
        p.error("give --url or --serve")
    with server(args.serve, args.torch_threads) as local:
        url = args.url or local
        assert url is not None
        return chat(url, args.api_key) if args.mode == "chat" else load(args, url)


if __name__ == "__main__":
    sys.exit(main())
