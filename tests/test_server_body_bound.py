"""A chat body too large to hold any prompt the server serves is refused before it is read.

For a model that takes no images the bound is ``max_prompt_tokens * json_bytes_per_token +
prompt_body_allowance``; a prompt of exactly ``max_prompt_tokens`` tokens written as wastefully
as JSON allows must still pass it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agent.engine.chat import ByteTokenizer
from agent.engine.limits import ServerLimits
from agent.engine.runtime import Runtime
from agent.engine.token_bound import JSON_ESCAPE_BYTES, TokenBound
from agent.server.app import body_bounds, create_app
from agent.server.background import BackgroundServer
from tests.test_server import tiny_config

PROMPT_TOKENS = 512
ALLOWANCE = 1024  # small, so a bound that forgot bytes per token would refuse the maximal prompts
LIMITS = ServerLimits(
    max_body_bytes=8 << 20,
    max_tokens=8,
    default_max_tokens=1,
    max_prompt_tokens=PROMPT_TOKENS,
    prompt_body_allowance=ALLOWANCE,
    drain_s=5,
)
TEMPLATE_TOKENS = 19  # ChatML around one user message, in the byte tokenizer's tokens
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.load(tiny_config("tiny:llama-gqa", limits=LIMITS))


@pytest.fixture(scope="module")
def client(runtime: Runtime) -> Iterator[httpx.Client]:
    with BackgroundServer(create_app(runtime)) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def bound_of(runtime: Runtime) -> int:
    most = runtime.chat_body_bytes()
    assert most is not None
    return most


def test_the_bound_is_the_documented_formula() -> None:
    text = Runtime.load(tiny_config("tiny:llama-gqa", limits=LIMITS))
    assert TokenBound.of(ByteTokenizer()) == TokenBound(12, 12)
    assert text.chat_body_bytes() == PROMPT_TOKENS * JSON_ESCAPE_BYTES * 12 + ALLOWANCE
    fixed = ServerLimits(max_prompt_tokens=100, prompt_json_bytes_per_token=7, prompt_body_allowance=5)
    assert Runtime.load(tiny_config("tiny:llama-gqa", limits=fixed)).chat_body_bytes() == 705
    images = Runtime.load(tiny_config(limits=LIMITS))  # Qwen2.5-VL: a data URL may be any size
    assert images.chat_body_bytes() is None
    assert body_bounds(images) == {}
    roomy = ServerLimits(max_body_bytes=1 << 10, prompt_body_allowance=1 << 20)
    assert body_bounds(Runtime.load(tiny_config("tiny:llama-gqa", limits=roomy))) == {}  # the cap is tighter


@pytest.mark.parametrize(
    "text",
    [
        "plain words",
        "\x01\x02\x1f" * 9,
        '"\\"\\',
        "é" * 11,
        "日本語",
        "🙂" * 5,
        "<|im_start|>" * 6,
        "a\nb\tc",
    ],
)
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_json_bytes_per_token_bounds_any_text(text: str, ensure_ascii: bool) -> None:
    tok = ByteTokenizer()
    bound = TokenBound.of(tok)
    assert bound is not None
    written = len(json.dumps(text, ensure_ascii=ensure_ascii)) - 2  # the quotes are structure
    assert written <= bound.json_bytes_per_token * len(tok.encode(text))


SAMPLES = [
    " " * 4000,
    "-" * 3000,
    "\x00\x1b" * 300,
    'print("a\\tb")\n' * 50,
    "Größe 日本語 🙂 " * 40,
    "<|im_start|><|im_end|>" * 20,
]


def test_json_bytes_per_token_bounds_real_texts_of_smollm2(smollm2: Any) -> None:
    tok = smollm2.tokenizer
    bound = TokenBound.of(tok)
    assert bound is not None
    for text in SAMPLES:
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        for ensure_ascii in (True, False):
            assert len(json.dumps(text, ensure_ascii=ensure_ascii)) - 2 <= bound.json_bytes_per_token * n


def maximal(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}


@pytest.mark.parametrize(
    "fill",
    ["<|im_start|>", "\x01", "🙂"],
    ids=["most bytes a token", "most escape bytes a token", "surrogate-pair escapes"],
)
def test_a_maximal_prompt_is_never_refused_by_the_bound(client: httpx.Client, fill: str) -> None:
    tok = ByteTokenizer()
    n = (PROMPT_TOKENS - TEMPLATE_TOKENS) // len(tok.encode(fill))
    body = json.dumps(maximal(fill * n, stop=["\x00" * 64]), indent=8).encode()
    r = client.post("/v1/chat/completions", content=body, headers=JSON)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > PROMPT_TOKENS - len(tok.encode(fill))
    over = json.dumps(maximal(fill * (n + 1))).encode()  # one more: the exact count refuses it
    r = client.post("/v1/chat/completions", content=over, headers=JSON)
    assert r.status_code == 400
    assert "text tokens" in r.json()["error"]["message"]


def test_a_body_at_the_bound_is_read_and_one_past_it_is_not(client: httpx.Client, runtime: Runtime) -> None:
    most = bound_of(runtime)
    prompt = json.dumps(maximal("hello")).encode()
    padded = prompt[:-1] + b" " * (most - len(prompt)) + b"}"  # JSON whitespace up to the bound
    assert len(padded) == most
    r = client.post("/v1/chat/completions", content=padded, headers=JSON)
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", content=b"{" + b" " * most, headers=JSON)  # not even JSON
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert f"max_prompt_tokens={PROMPT_TOKENS}" in error["message"]


def test_a_chunked_body_is_cut_at_the_bound(client: httpx.Client, runtime: Runtime) -> None:
    most = bound_of(runtime)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the bytes read so far decide
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(most // 4096 + 2):
            yield b"x" * 4096

    r = client.post("/v1/chat/completions", content=chunks(), headers=JSON)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json=maximal("still here"))
    assert r.status_code == 200


def test_over_the_server_cap_is_still_413(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", content=b"x" * (LIMITS.max_body_bytes + 1), headers=JSON)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"


def test_sessions_are_not_bound_by_the_chat_prompt(client: httpx.Client, runtime: Runtime) -> None:
    sid = client.post("/v1/sessions", json={"budget_tokens": 64, "max_tokens": 2}).json()["id"]
    text = "z" * (bound_of(runtime) + 1)  # refused from its length against the budget, once parsed
    r = client.post(
        f"/v1/sessions/{sid}/steps",
        json={"observations": [{"type": "text", "text": text}], "instruction": "go"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "observations[0].text"
