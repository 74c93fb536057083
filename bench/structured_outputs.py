"""Tool calls and JSON-schema answers through the official ``openai`` client, prompt by prompt.

For each prompt, three requests to a ``kamera serve`` endpoint: a ``json_schema`` (strict)
response whose text must validate against :data:`SCHEMA`, a tool call with ``tool_choice:
required`` (non-stream) and a named tool call streamed; each call's arguments must validate
against its function's parameters. The model's words may be poor; the structure must not be.

    python -m bench.structured_outputs [--url http://127.0.0.1:8000] [--prompts 20] [--max-tokens 160]

Without ``--url`` the embedded model is served by a ``kamera serve`` process on loopback
(``--threads``, default 1).
Prints a JSON summary: passes per kind, failures with their text, seconds per request.

Not here: the quality of the answers, or anything about free-text ``auto`` tool choice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jsonschema

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 48},
    },
    "required": ["title", "rating", "tags", "summary"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 32},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 48},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query", "max_results"],
                "additionalProperties": False,
            },
        },
    },
]
PROMPTS = [
    "What is the weather like in Paris today?",
    "Find me recent news about electric cars.",
    "Review the movie Casablanca.",
    "Is it going to rain in Tokyo?",
    "Search for a good pasta recipe.",
    "Tell me about the book Moby Dick.",
    "How cold is it in Oslo right now?",
    "Look up the population of Brazil.",
    "Rate the restaurant on the corner of my street.",
    "What's the temperature in Cairo in fahrenheit?",
    "Who won the last football world cup?",
    "Describe a sunny afternoon at the beach.",
    "Check the weather in New York for me.",
    "Search for cheap flights to Lisbon.",
    "Summarise the plot of Hamlet.",
    "Is it windy in Chicago?",
    "Find tutorials about learning Python.",
    "Give your opinion of a new smartphone.",
    "What's the weather in Sydney in celsius?",
    "Look for hiking trails near Zurich.",
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(name: str, arguments: str) -> None:
    if name not in PARAMS:
        raise ValueError(f"unknown tool {name!r}")
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def json_schema_answer(client: Any, prompt: str, seed: int, max_tokens: int) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt + " Answer as JSON."}],
        response_format=fmt,
        max_tokens=max_tokens,
        seed=seed,
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    return str(text)


def tool_call(client: Any, prompt: str, seed: int, max_tokens: int) -> str:
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=max_tokens,
        seed=seed,
    )
    choice = r.choices[0]
    if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
        raise ValueError(f"no tool call (finish {choice.finish_reason}): {choice.message.content!r}")
    call = choice.message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    return f"{call.function.name}({call.function.arguments})"


def streamed_tool_call(client: Any, prompt: str, seed: int, max_tokens: int) -> str:
    name = TOOLS[seed % len(TOOLS)]["function"]["name"]
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=max_tokens,
        seed=seed,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish != "tool_calls" or len(calls) != 1 or not calls[0]["id"].startswith("call_"):
        raise ValueError(f"streamed {calls} (finish {finish})")
    if calls[0]["name"] != name:
        raise ValueError(f"asked for {name}, got {calls[0]['name']}")
    check_call(calls[0]["name"], calls[0]["arguments"])
    return f"{calls[0]['name']}({calls[0]['arguments']})"


KINDS: dict[str, Callable[[Any, str, int, int], str]] = {
    "json_schema": json_schema_answer,
    "tool_call": tool_call,
    "tool_call_stream": streamed_tool_call,
}


def run_kind(client: Any, kind: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """One kind of request on each prompt (seeded by its index): passes, failures, timings."""
    fn = KINDS[kind]
    passed, failures, times, samples = 0, [], [], []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        try:
            samples.append(fn(client, prompt, i, max_tokens))
            passed += 1
        except Exception as e:  # a failure is reported, not raised: the count is the result
            failures.append({"prompt": prompt, "error": f"{type(e).__name__}: {e}"[:300]})
        times.append(time.perf_counter() - t0)
    return {
        "passed": passed,
        "total": len(prompts),
        "failures": failures,
        "mean_s": round(statistics.fmean(times), 2),
        "samples": samples[:3],
    }


def run(client: Any, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Every kind on the first ``n_prompts`` prompts."""
    return {kind: run_kind(client, kind, PROMPTS[:n_prompts], max_tokens) for kind in KINDS}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: the embedded model in a kamera serve process)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import openai

    if args.url:
        client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        print(json.dumps(run(client, args.prompts, args.max_tokens), indent=2))
        return
    from tools.serve import ServeProcess

    with ServeProcess(["--threads", str(args.threads)]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        print(json.dumps(run(client, args.prompts, args.max_tokens), indent=2))


if __name__ == "__main__":
    main()
