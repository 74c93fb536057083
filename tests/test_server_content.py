"""Session observations take chat's content parts: the same schema classes, the same decoder.

An image sent to a session as an ``image_url`` part, the same image in the session form, and the
same image sent through chat are one content: one content key, one run of the vision encoder.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.engine.media import load_image_url
from agent.engine.runtime import Runtime
from agent.server.app import create_app
from agent.server.background import BackgroundServer
from tests.test_server import png_data_url, tiny_config


@pytest.fixture(scope="module")
def vl() -> Iterator[tuple[httpx.Client, Runtime]]:
    runtime = Runtime.load(tiny_config())
    with BackgroundServer(create_app(runtime)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, runtime


@pytest.fixture(scope="module")
def text_only() -> Iterator[httpx.Client]:
    runtime = Runtime.load(tiny_config("tiny:llama-gqa"))
    with BackgroundServer(create_app(runtime)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def session(client: httpx.Client) -> str:
    r = client.post("/v1/sessions", json={"budget_tokens": 2000, "max_tokens": 2})
    assert r.status_code == 201, r.text
    sid: str = r.json()["id"]
    return sid


def step(client: httpx.Client, sid: str, *observations: Any) -> httpx.Response:
    return client.post(
        f"/v1/sessions/{sid}/steps", json={"observations": list(observations), "instruction": "Seen?"}
    )


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_an_image_part_is_the_same_content_as_in_chat_and_the_session_form(
    vl: tuple[httpx.Client, Runtime],
) -> None:
    client, runtime = vl
    url = png_data_url(41)
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [image_part(url)]}], "max_tokens": 1},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["kamera"]["vision_encoder_calls"] == 1
    part = step(client, session(client), image_part(url))
    assert part.status_code == 200, part.text
    assert part.json()["report"]["vision_encoder_calls"] == 0  # chat's features, found by content key
    form = step(client, session(client), {"type": "image", "image_url": url})
    assert form.status_code == 200, form.text
    assert form.json()["report"]["vision_encoder_calls"] == 0
    [part_id], [form_id] = part.json()["chunk_ids"], form.json()["chunk_ids"]
    assert part_id == form_id
    adapter = runtime.adapter
    image = adapter.image(load_image_url(url, runtime.config.media, runtime.limits))  # type: ignore[attr-defined]
    assert part_id == adapter.chunk_key(image, runtime.tenant_salt("", None))


def test_a_text_part_and_a_video_part_are_observations(
    vl: tuple[httpx.Client, Runtime], tmp_path: Path
) -> None:
    from tools.video import counter_frames, write_video

    client, _ = vl
    path = tmp_path / "clip.mp4"
    write_video(path, counter_frames(8, 64, 64), fps=4)
    video = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()},
    }
    sid = session(client)
    r = step(client, sid, {"type": "text", "text": "A clip follows."}, video)
    assert r.status_code == 200, r.text
    assert r.json()["report"]["vision_encoder_calls"] >= 2  # at 1 fps a 2 s clip gives 2 frames
    chunks = client.get(f"/v1/sessions/{sid}").json()["chunks"]
    assert [c["kind"] for c in chunks[:2]] == ["prefix", "text"]
    stamps = [c["meta"]["t"] for c in chunks if c["kind"] == "frame"]
    assert len(stamps) >= 2
    assert stamps == sorted(stamps)
    assert stamps[0] == pytest.approx(0.0, abs=0.5)  # the video's own timestamps, in seconds


@pytest.mark.parametrize(
    ("observation", "param"),
    [
        ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, "observations[0].image_url"),
        ({"type": "image_url", "image_url": {"url": ""}}, "observations[0].image_url"),
        ({"type": "image_url", "image_url": {"url": "data:,x", "size": 3}}, "observations[0].image_url"),
        ({"type": "video_url", "video_url": {}}, "observations[0].video_url"),
        ({"type": "audio", "audio": "x"}, "observations[0]"),
    ],
    ids=["url as a string", "empty url", "unknown field", "no url", "unknown type"],
)
def test_a_bad_part_is_a_400_naming_the_field(
    vl: tuple[httpx.Client, Runtime], observation: dict[str, Any], param: str
) -> None:
    client, _ = vl
    r = step(client, session(client), observation)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["param"].startswith(param), error


def test_undecodable_media_in_a_part_is_the_400_chat_gives(vl: tuple[httpx.Client, Runtime]) -> None:
    client, _ = vl
    bad = image_part("data:image/png;base64," + base64.b64encode(b"hello").decode())
    r = step(client, session(client), bad)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [bad]}]})
    assert r.status_code == chat.status_code == 400
    mine, chats = r.json()["error"], chat.json()["error"]
    assert mine["code"] == chats["code"] == "bad_media"
    assert mine["type"] == chats["type"]
    assert mine["param"] == chats["param"]
    assert mine["message"].split(" at 0x")[0] == chats["message"].split(" at 0x")[0]  # PIL names an object


def test_image_parts_count_against_the_limits(vl: tuple[httpx.Client, Runtime]) -> None:
    client, runtime = vl
    many = [image_part(png_data_url(i)) for i in range(runtime.limits.max_images + 1)]
    r = step(client, session(client), *many)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "too_many_images"
    assert r.json()["error"]["param"] == "observations"


def test_a_text_only_model_refuses_an_image_part_naming_the_model_that_takes_images(
    text_only: httpx.Client,
) -> None:
    r = step(text_only, session(text_only), image_part(png_data_url(0)))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "images_unsupported"
    assert r.json()["error"]["param"] == "observations"
    assert "--model world-vl" in r.json()["error"]["message"]
