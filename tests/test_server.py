"""The HTTP server on a real uvicorn socket (loopback), driven by the openai client and httpx.

The model is the tiny random Qwen2.5-VL (images and video frames), so outputs mean nothing;
what is checked is the protocol, the cache accounting and the session window.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from agent.engine.limits import ServerLimits
from agent.engine.prompt_cache import PromptCacheConfig
from agent.engine.runtime import Runtime, RuntimeConfig
from agent.server.app import create_app
from agent.server.background import BackgroundServer
from cache.cdc import CDCConfig
from cache.planner import PlannerConfig
from cache.store import StoreConfig

DOC = " ".join(
    f"Fact {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} marbles." for i in range(24)
)


def tiny_config(model: str = "tiny:qwen2.5-vl", **kw: Any) -> RuntimeConfig:
    limits = kw.pop("limits", ServerLimits(max_tokens=256, default_max_tokens=8, drain_s=5))
    return RuntimeConfig(
        model=model,
        limits=limits,
        store=StoreConfig(host_bytes=128 << 20),
        prompt_cache=PromptCacheConfig(
            planner=PlannerConfig(cdc=CDCConfig(min_size=8, avg_size=32, max_size=128)), block_tokens=8
        ),
        **kw,
    )


def png_data_url(seed: int, size: int = 64) -> str:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.load(tiny_config())


@pytest.fixture(scope="module")
def base_url(runtime: Runtime) -> Iterator[str]:
    with BackgroundServer(create_app(runtime)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def kamera(resp: Any) -> dict[str, Any]:
    report: dict[str, Any] = resp.model_dump()["kamera"]
    return report


def test_health_and_models(base_url: str, client: Any) -> None:
    r = httpx.get(base_url + "/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"
    assert r.json()["numerics"].startswith("torch=")  # what an exact hit must have been computed under
    assert [m.id for m in client.models.list().data] == ["tiny:qwen2.5-vl"]


def test_text_completion_with_openai_client(client: Any) -> None:
    resp = client.chat.completions.create(
        model="tiny:qwen2.5-vl",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        temperature=0,
    )
    assert resp.object == "chat.completion"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert 0 < resp.usage.completion_tokens <= 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    again = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Say something."}], max_tokens=5, temperature=0
    )
    assert again.choices[0].message.content == resp.choices[0].message.content  # greedy is deterministic
    # the exact prefix is reused up to the last prefill segment edge (8 tokens here) before the end
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 8 * 8


def test_seeded_sampling_repeats(client: Any) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Pick."}],
            max_tokens=8,
            temperature=1.0,
            seed=seed,
        )
        return str(r.choices[0].message.content)

    assert sample(3) == sample(3)


def test_image_data_url_runs_encoder_once(client: Any) -> None:
    url = png_data_url(1)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is here?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    first = client.chat.completions.create(model="x", messages=messages, max_tokens=3, temperature=0)
    assert kamera(first)["vision_encoder_calls"] == 1
    # the same image after a different first message: found by content, moved, not re-encoded
    moved = [{"role": "system", "content": "A new system line that shifts everything."}, *messages]
    second = client.chat.completions.create(
        model="x", messages=moved, max_tokens=3, temperature=0, extra_body={"kamera_reuse": "fast"}
    )
    assert kamera(second)["vision_encoder_calls"] == 0
    assert kamera(second)["relocated_tokens"] > 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    # repair recomputes a piece this small, from the cached features: the encoder stays idle
    third = client.chat.completions.create(model="x", messages=moved, max_tokens=3, temperature=0)
    assert kamera(third)["vision_encoder_calls"] == 0
    assert kamera(third)["reuse_mode"] == "repair"
    assert kamera(third)["repair_residual"] == 0.0  # nothing was left to repair


def test_streaming_with_openai_client_and_httpx(base_url: str, client: Any) -> None:
    stream = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Stream please."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens <= 6
    body = {
        "messages": [{"role": "user", "content": "Stream please."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in lines[:-1]
        if line.startswith("data: ")
    )
    plain = httpx.post(base_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_stop_string_cuts_output(client: Any) -> None:
    base = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Go on."}], max_tokens=12, temperature=0
    )
    text = str(base.choices[0].message.content)
    if len(text) < 3:
        pytest.skip("the random model ended too early to pick a stop string")
    stop = text[1:3]
    cut = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Go on."}], max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_cached_tokens_grow_when_content_moves(client: Any) -> None:
    def ask(first_line: str, salt: str) -> Any:
        return client.chat.completions.create(
            model="x",
            messages=[
                {"role": "system", "content": f"{first_line}\n{DOC}"},
                {"role": "user", "content": "How many?"},
            ],
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt, "kamera_reuse": "fast"},
        )

    cold = ask("Now: 1", "moves")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = ask("Now: 2026-12-02 13:45:07 UTC, request 118", "moves")  # longer: every later token moves
    report = kamera(warm)
    assert warm.usage.prompt_tokens > cold.usage.prompt_tokens
    assert report["relocated_tokens"] > 0.8 * len(DOC.encode())
    assert report["rotated_tokens"] >= report["relocated_tokens"]
    assert (
        warm.usage.prompt_tokens_details.cached_tokens == report["prefix_tokens"] + report["relocated_tokens"]
    )
    assert report["prefilled_tokens"] < 0.2 * warm.usage.prompt_tokens
    other_tenant = ask("Now: 2026-12-02 13:45:07 UTC, request 118", "someone-else")
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0


def test_video_url_frames_are_image_chunks(client: Any, tmp_path: Path) -> None:
    from tools.video import counter_frames, write_video

    path = tmp_path / "clip.mp4"
    write_video(path, counter_frames(8, 64, 64), fps=4)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    resp = client.chat.completions.create(
        model="x",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
        max_tokens=2,
        temperature=0,
    )
    assert kamera(resp)["vision_encoder_calls"] >= 2  # at 1 fps a 2 s clip gives 2 frames


def test_sessions_slide_recall_and_window(base_url: str) -> None:
    """Window operations over HTTP. The session answers on its window's KV as placed (``fast``),
    so that what a recall rotates is used and reported whatever the server's record of close
    calls says; whether a repair uses it is ``tests/test_loop.py``'s."""
    with httpx.Client(base_url=base_url, timeout=60) as h:
        r = h.post(
            "/v1/sessions",
            json={
                "system_prompt": "You watch and answer.",
                "budget_tokens": 2000,
                "max_tokens": 3,
                "kamera_reuse": "fast",
            },
        )
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert [c["kind"] for c in r.json()["chunks"]] == ["prefix"]
        first = h.post(
            f"/v1/sessions/{sid}/steps",
            json={
                "observations": [{"type": "text", "text": "The key is under the mat."}],
                "instruction": "Where?",
            },
        )
        assert first.status_code == 200, first.text
        text_id = first.json()["chunk_ids"][0]
        second = h.post(
            f"/v1/sessions/{sid}/steps",
            json={
                "observations": [{"type": "image", "image_url": png_data_url(7), "label": "a photo"}],
                "instruction": "Seen?",
            },
        )
        assert second.status_code == 200, second.text
        assert second.json()["report"]["vision_encoder_calls"] == 1
        assert second.json()["report"]["tokens_reused"] > 0
        slid = h.post(
            f"/v1/sessions/{sid}/steps",
            json={"operations": [{"op": "slide", "n": 1}], "instruction": "And now?"},
        )
        assert slid.status_code == 200, slid.text
        window = h.get(f"/v1/sessions/{sid}").json()
        assert text_id in window["evicted"]
        assert text_id not in [c["chunk_id"] for c in window["chunks"]]
        recalled = h.post(
            f"/v1/sessions/{sid}/steps",
            json={
                "operations": [{"op": "recall", "chunk_id": text_id, "at": 1}],
                "instruction": "Where was the key?",
            },
        )
        assert recalled.status_code == 200, recalled.text
        assert recalled.json()["report"]["tokens_rotated"] > 0
        window = h.get(f"/v1/sessions/{sid}").json()
        chunks = window["chunks"]
        assert chunks[1]["chunk_id"] == text_id
        assert chunks[1]["source"] in ("canonical+patch", "canonical")
        starts = [c["start"] for c in chunks]
        assert starts == sorted(starts)
        assert all(b["start"] == a["start"] + a["extent"] for a, b in itertools.pairwise(chunks))
        assert window["steps"] == 4
        bad = h.post(
            f"/v1/sessions/{sid}/steps",
            json={"operations": [{"op": "recall", "chunk_id": "nope"}], "instruction": "x"},
        )
        assert bad.status_code == 400
        assert h.delete(f"/v1/sessions/{sid}").status_code == 204
        assert h.get(f"/v1/sessions/{sid}").status_code == 404
        assert h.delete(f"/v1/sessions/{sid}").status_code == 404


def test_metrics_are_counters(base_url: str) -> None:
    httpx.post(
        base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "count me"}], "max_tokens": 2},
        timeout=60,
    )
    text = httpx.get(base_url + "/metrics").text
    for name in (
        "kamera_requests_total",
        "kamera_prompt_tokens_total",
        'kamera_prompt_tokens_reused_total{how="prefix"}',
        'kamera_prompt_tokens_reused_total{how="content"}',
        "kamera_vision_encoder_calls_total",
        'kamera_store_hits_total{tier="host"}',
        'kamera_store_misses_total{tier="host"}',
        'kamera_store_bytes_written_total{tier="host"}',
        "kamera_time_to_first_token_seconds_bucket",
        "kamera_repair_residual_bucket",
    ):
        assert name in text, name
    assert "ratio" not in text


def test_a_session_takes_a_reuse_mode(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as h:
        fresh = {}
        for mode in ("exact", "fast"):
            made = h.post("/v1/sessions", json={"budget_tokens": 400, "max_tokens": 2, "kamera_reuse": mode})
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            for i in range(3):  # ~280 byte tokens each: the second step slides the first note out
                step = h.post(
                    f"/v1/sessions/{sid}/steps",
                    json={"observations": [{"type": "text", "text": f"note {i} " * 40}], "instruction": "Ok"},
                )
                assert step.status_code == 200, step.text
            counters = h.get(f"/v1/sessions/{sid}").json()["counters"]
            assert counters["slides"] > 0
            fresh[mode] = counters["fresh_prefills"]
        # exact: the first step's window is as prefilled and needs no fresh prefill; the steps after a
        # slide (KV computed after a note that left) are answered on one; fast never
        assert fresh == {"exact": 2, "fast": 0}
        bad = h.post("/v1/sessions", json={"kamera_reuse": "sometimes"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "kamera_reuse"
