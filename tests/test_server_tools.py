"""Tool calls, structured outputs and logprobs over HTTP with the embedded SmolLM2 and the
official ``openai`` client: the structure must hold whatever the 135M model says.

A few prompts of ``bench/structured_outputs.py`` run in the default suite; all 20 are the slow
test. One torch thread: the machine is shared, and two threads contend worse than one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import torch

from agent.engine.limits import ServerLimits
from agent.engine.runtime import Runtime, RuntimeConfig
from agent.server.app import create_app
from agent.server.background import BackgroundServer
from bench import structured_outputs as bench

TOOLS = bench.TOOLS
USER = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def base_url(smollm2: Any) -> Iterator[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runtime = Runtime(smollm2, RuntimeConfig(limits=ServerLimits(max_tokens=256, default_max_tokens=16)))
    try:
        with BackgroundServer(create_app(runtime)) as url:
            yield url
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("kind", sorted(bench.KINDS))
def test_structure_holds_on_a_few_prompts(client: Any, kind: str) -> None:
    result = bench.run_kind(client, kind, bench.PROMPTS[:2], max_tokens=160)
    assert result["passed"] == result["total"], result["failures"]


@pytest.mark.slow
def test_structure_holds_on_all_twenty_prompts(client: Any) -> None:
    results = bench.run(client, len(bench.PROMPTS), max_tokens=160)
    for kind, result in results.items():
        assert result["passed"] == result["total"] == 20, (kind, result["failures"])


def test_tool_result_in_the_history_and_auto_choice(client: Any) -> None:
    args = json.dumps({"city": "Rome", "unit": "celsius"})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=12, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # the same tools again, reordered: the prompt cache finds the definitions by content; repair
    # measures them, and gives them up for exact KV where what it would leave is too far off or
    # not worth its risk (or, on what recent repairs measured, does not try)
    again = client.chat.completions.create(model="m", messages=messages, tools=TOOLS[::-1], max_tokens=1)
    report = again.model_dump()["kamera"]
    assert report["diverged_tokens"] == 0  # nothing streamed: a close call rewinds
    assert report["escalated_at"] in (None, 0)  # one token: a close call can only be the first
    if report["relocated_tokens"]:  # repaired: its recompute ran
        assert report["repaired_tokens"] > 0
    else:  # given up: an exact prefill, counted as a fallback, the moved tokens abandoned
        assert report["served"] == "given_up"
        assert report["abandoned_tokens"] > 0
        assert report["fallback_tokens"] == report["prefilled_tokens"] > 0
    blind = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS[::-1], max_tokens=1, extra_body={"kamera_reuse": "fast"}
    )
    report = blind.model_dump()["kamera"]
    assert report["prefix_tokens"] + report["relocated_tokens"] > report["prefilled_tokens"]


def test_json_object_and_logprobs(client: Any) -> None:
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        logprobs=True,
        top_logprobs=3,
        seed=3,
    )
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == choice.message.content
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.logprob <= c.top_logprobs[0].logprob + 1e-6
        assert bytes(c.bytes).decode() == c.token


def test_streamed_logprobs_cover_every_token(client: Any) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=USER,
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        seed=4,
        stream_options={"include_usage": True},
    )
    text, tokens, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.content
    assert usage is not None
    assert len(tokens) == usage.completion_tokens
    assert "".join(t.token for t in tokens) == text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
        ({"messages": [*USER, {"role": "tool", "tool_call_id": "c9", "content": "1"}], "tools": TOOLS}, None),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{no"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_what_does_not_hold_together_is_a_400_naming_it(
    base_url: str, extra: dict[str, Any], param: str | None
) -> None:
    body = {"messages": USER, "max_tokens": 2, **extra}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == (param or "messages[1].tool_call_id"), error


def test_top_logprobs_over_twenty_is_refused(base_url: str) -> None:
    body = {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "top_logprobs" in r.text


def test_a_schema_answer_validates_with_jsonschema(client: Any) -> None:
    text = bench.json_schema_answer(client, "Review a bicycle.", seed=7, max_tokens=160)
    jsonschema.validate(json.loads(text), bench.SCHEMA)


def test_an_action_session_answers_under_the_action_grammar(base_url: str) -> None:
    short = httpx.post(base_url + "/v1/sessions", json={"policy": "action", "max_tokens": 8}, timeout=60)
    assert short.status_code == 400
    made = httpx.post(base_url + "/v1/sessions", json={"policy": "action", "max_tokens": 24}, timeout=120)
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    obs = [{"type": "text", "text": "The page shows a search box at (120, 40) and a Go button."}]
    r = httpx.post(
        base_url + f"/v1/sessions/{sid}/steps",
        json={"observations": obs, "instruction": "Reply with one action."},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["parsed"]["type"] == "action", r.json()
