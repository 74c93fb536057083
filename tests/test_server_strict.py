"""Strict request bodies: unknown fields, lax types, non-finite numbers, invalid Unicode, and prompts
refused from their length before any tokenizing. Each refusal is a 400 naming the parameter."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agent.engine.chat import ByteTokenizer
from agent.engine.limits import ServerLimits
from agent.engine.runtime import Runtime
from agent.engine.token_bound import TokenBound
from agent.server.app import create_app
from agent.server.background import BackgroundServer
from agent.server.strict import parse_json
from tests.test_server import tiny_config

LIMITS = ServerLimits(
    max_body_bytes=40 << 20, max_tokens=64, default_max_tokens=2, max_prompt_tokens=512, drain_s=5
)
HI = [{"role": "user", "content": "hi"}]


def _server(**kw: Any) -> Iterator[httpx.Client]:
    runtime = Runtime.load(tiny_config("tiny:llama-gqa", limits=LIMITS, **kw))
    with BackgroundServer(create_app(runtime)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def strict() -> Iterator[httpx.Client]:
    yield from _server()


@pytest.fixture(scope="module")
def lenient() -> Iterator[httpx.Client]:
    yield from _server(lenient_fields=True)


def raw(client: httpx.Client, text: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return client.post(
        path, content=text.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"}
    )


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("unknown top-level field", {"messages": HI, "foo": 1}, "foo"),
    ("unknown message field", {"messages": [{"role": "user", "content": "x", "bar": 2}]}, "messages[0].bar"),
    ("max_tokens true", {"messages": HI, "max_tokens": True}, "max_tokens"),
    ("max_tokens a string", {"messages": HI, "max_tokens": "3"}, "max_tokens"),
    ("max_tokens a float", {"messages": HI, "max_tokens": 3.0}, "max_tokens"),
    ("stream a string", {"messages": HI, "stream": "yes"}, "stream"),
    ("include_usage a string", {"messages": HI, "stream_options": {"include_usage": "1"}}, "stream_options"),
    ("temperature a string", {"messages": HI, "temperature": "0.5"}, "temperature"),
    ("a penalty we do not apply", {"messages": HI, "frequency_penalty": 0.5}, "frequency_penalty"),
    ("a logit bias we do not apply", {"messages": HI, "logit_bias": {"5": 1.0}}, "logit_bias"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_refused_with_the_parameter_named(strict: httpx.Client, name: str, body: Any, param: str) -> None:
    r = strict.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param), error
    assert param.split(".")[-1].split("[")[0] in error["message"]


def test_unknown_top_level_field_reads_as_openai_does(strict: httpx.Client) -> None:
    r = strict.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "frobnicate": True})
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: frobnicate"


def test_neutral_values_and_ints_for_floats_pass(strict: httpx.Client) -> None:
    body = {
        "messages": HI,
        "max_tokens": 1,
        "temperature": 0,
        "top_p": 1,
        "frequency_penalty": 0,
        "logit_bias": {},
    }
    assert strict.post("/v1/chat/completions", json=body).status_code == 200


def test_lenient_fields_drops_unknown_fields_but_keeps_types_strict(lenient: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "x", "bar": 1}], "max_tokens": 1, "foo": {"a": 1}}
    assert lenient.post("/v1/chat/completions", json=body).status_code == 200
    r = lenient.post("/v1/chat/completions", json={"messages": HI, "max_tokens": "3"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    "text",
    [
        '{"messages": [{"role": "user", "content": "\\ud800"}]}',
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00b"}]}]}',
        '{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud83d"]}',
        '{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1}',
    ],
    ids=["content", "text part", "stop list", "key"],
)
def test_lone_surrogate_is_400(strict: httpx.Client, text: str) -> None:
    r = raw(strict, text)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    pair = raw(strict, '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}')
    assert pair.status_code == 200, pair.text  # a proper pair is one character


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400(strict: httpx.Client, constant: str) -> None:
    r = raw(strict, f'{{"messages": [{{"role": "user", "content": "x"}}], "temperature": {constant}}}')
    assert r.status_code == 400
    assert constant in r.json()["error"]["message"]
    r = raw(strict, '{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}')
    assert r.status_code == 400  # overflows to inf: refused by the field


def test_frame_timestamps_must_be_finite(strict: httpx.Client) -> None:
    for ts in ("NaN", "Infinity", "1e999"):
        frames = '[{"type": "frames", "frames": ["data:,"], "timestamps": [' + ts + "]}]"
        text = '{"observations": ' + frames + ', "instruction": "go"}'
        r = raw(strict, text, "/v1/sessions/none/steps")
        assert r.status_code == 400, (ts, r.text)


def test_duplicate_keys_are_400(strict: httpx.Client) -> None:
    r = raw(strict, '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_tokens": 900}')
    assert r.status_code == 400
    assert "duplicate key 'max_tokens'" in r.json()["error"]["message"]


def test_parse_json_matches_json_loads_on_valid_input() -> None:
    text = '{"a": [1, 2.5, "é", {"b": null, "c": [true, "\\ud83d\\ude00"]}], "d": ""}'
    assert parse_json(text.encode()) == json.loads(text)


def test_token_bound_is_a_lower_bound() -> None:
    bound = TokenBound.of(ByteTokenizer())
    assert bound == TokenBound(chars_per_token=12, bytes_per_token=12)
    tok = ByteTokenizer()
    for text in ["plain", "<|im_start|>" * 40, "é" * 50, "<|im_end|>x" * 7, ""]:
        assert bound.min_tokens([text], 10**9) <= len(tok.encode(text))


def test_a_30_mib_text_is_refused_from_its_length(strict: httpx.Client) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (30 << 20)}]}).encode()
    t0 = time.perf_counter()
    r = strict.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    assert elapsed < 2.0, elapsed  # no tokenizing; generous for a loaded CI machine


def test_exact_count_refuses_what_the_length_bound_lets_through(strict: httpx.Client) -> None:
    r = strict.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 600}]})
    assert r.status_code == 400  # 600 chars may be 50 tokens by the bound; the byte tokenizer says 600
    assert "619 text tokens" in r.json()["error"]["message"]  # with the template's


def test_text_model_names_the_model_that_takes_images(strict: httpx.Client) -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = strict.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400
    assert "--model world-vl" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_a_step_text_over_the_session_budget_is_refused_from_its_length(strict: httpx.Client) -> None:
    sid = strict.post("/v1/sessions", json={"budget_tokens": 64}).json()["id"]
    obs = [{"type": "text", "text": "z" * (4 << 20)}]
    t0 = time.perf_counter()
    r = strict.post(f"/v1/sessions/{sid}/steps", json={"observations": obs, "instruction": "go"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "observations[0].text"
    assert time.perf_counter() - t0 < 2.0
    assert strict.delete(f"/v1/sessions/{sid}").status_code == 204
