"""Bad inputs, limits, auth, tenants, queueing, disconnects and a bounded load on the server.

Each bad input must get a 4xx with a message, and the server must serve the next request.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import io
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from agent.engine.limits import ServerLimits
from agent.engine.runtime import Runtime
from agent.engine.scheduler import ModelWorker, QueueFullError
from agent.engine.sessions import SessionLimitError, SessionManager
from agent.server.app import create_app
from agent.server.background import BackgroundServer
from tests.test_server import png_data_url, tiny_config

ROOT = Path(__file__).resolve().parents[1]
LIMITS = ServerLimits(
    max_body_bytes=200_000,
    max_images=2,
    max_image_pixels=120 * 120,
    max_tokens=2048,
    default_max_tokens=4,
    queue_size=3,
    max_sessions=2,
    drain_s=5,
)


@pytest.fixture(scope="module")
def vl() -> Iterator[tuple[str, Runtime]]:
    runtime = Runtime.load(tiny_config(limits=LIMITS, api_keys=(("key-a", "alice"), ("key-b", "bob"))))
    with BackgroundServer(create_app(runtime)) as url:
        yield url, runtime


@pytest.fixture(scope="module")
def text_only() -> Iterator[httpx.Client]:
    runtime = Runtime.load(tiny_config("tiny:llama-gqa", limits=LIMITS))
    with BackgroundServer(create_app(runtime)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.fixture
def alice(vl: tuple[str, Runtime]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vl[0], headers={"Authorization": "Bearer key-a"}, timeout=60) as client:
        yield client


def user(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 2}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def still_serves(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ok?"}]})
    assert r.status_code == 200, r.text


BIG = Image.new("RGB", (200, 200), "white")
_buf = io.BytesIO()
BIG.save(_buf, format="PNG")
BIG_URL = "data:image/png;base64," + base64.b64encode(_buf.getvalue()).decode()

BAD_BODIES: list[tuple[str, Any, int]] = [
    ("no messages", {"messages": []}, 400),
    ("messages not a list", {"messages": "hi"}, 400),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("unknown part type", user({"type": "audio", "audio": "x"}), 400),
    ("image part without url", user({"type": "image_url", "image_url": {}}), 400),
    ("bad base64", user(image_part("data:image/png;base64,@@@")), 400),
    ("not an image", user(image_part("data:image/png;base64," + base64.b64encode(b"hello").decode())), 400),
    ("not a data url", user(image_part("data:text/plain,hello")), 400),
    ("local file without a directory", user(image_part("/etc/passwd")), 400),
    ("http fetch is off", user(image_part("https://example.com/a.png")), 400),
    ("too many pixels", user(image_part(BIG_URL)), 413),
    ("too many images", user(*[image_part(png_data_url(i)) for i in range(3)]), 413),
    ("bad video", user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}), 400),
    ("max_tokens over the cap", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400),
    ("n > 1", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
    ("temperature out of range", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400),
    ("empty stop", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400),
]


@pytest.mark.parametrize(("name", "body", "status"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_4xx_and_server_survives(alice: httpx.Client, name: str, body: Any, status: int) -> None:
    r = alice.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    still_serves(alice)


def test_malformed_json_and_body_caps(alice: httpx.Client) -> None:
    r = alice.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = alice.post(
        "/v1/chat/completions", content=b"x" * 300_000, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: the streamed cap must cut it
        for _ in range(40):
            yield b" " * 10_000

    r = alice.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    still_serves(alice)


def test_images_on_a_text_model_are_refused(text_only: httpx.Client) -> None:
    r = text_only.post("/v1/chat/completions", json=user(image_part(png_data_url(0))))
    assert r.status_code == 400
    assert "image" in r.json()["error"]["message"]
    r = text_only.post(
        "/v1/chat/completions",
        json=user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA"}}),
    )
    assert r.status_code == 400
    still_serves(text_only)


def test_auth_and_tenant_isolation(vl: tuple[str, Runtime], alice: httpx.Client) -> None:
    url, _ = vl
    assert (
        httpx.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ).status_code
        == 401
    )
    wrong = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": "Bearer nope"},
    )
    assert wrong.status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # only health needs no key
    body = {
        "messages": [
            {"role": "system", "content": "Shared secret context " * 20},
            {"role": "user", "content": "q"},
        ]
    }
    alice.post("/v1/chat/completions", json=body)
    again = alice.post("/v1/chat/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    bob = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-b"}, timeout=60
    )
    assert bob.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    sid = alice.post("/v1/sessions", json={"system_prompt": "private"}).json()["id"]
    assert httpx.get(f"{url}/v1/sessions/{sid}", headers={"Authorization": "Bearer key-b"}).status_code == 404
    assert alice.delete(f"/v1/sessions/{sid}").status_code == 204


def test_session_quota_per_tenant(vl: tuple[str, Runtime], alice: httpx.Client) -> None:
    """Two tenants share max_sessions=2: alice filling her share leaves bob his."""
    with httpx.Client(base_url=vl[0], headers={"Authorization": "Bearer key-b"}, timeout=60) as bob:
        mine = alice.post("/v1/sessions", json={})
        assert mine.status_code == 201
        over = alice.post("/v1/sessions", json={})
        assert over.status_code == 429
        assert "share of 1 sessions" in over.json()["error"]["message"]
        theirs = bob.post("/v1/sessions", json={})
        assert theirs.status_code == 201, theirs.text
        assert bob.post("/v1/sessions", json={}).status_code == 429
        assert alice.delete(f"/v1/sessions/{mine.json()['id']}").status_code == 204
        again = alice.post("/v1/sessions", json={})
        assert again.status_code == 201
        for client, sid in ((alice, again.json()["id"]), (bob, theirs.json()["id"])):
            assert client.delete(f"/v1/sessions/{sid}").status_code == 204


def test_session_limit_is_429() -> None:
    manager = SessionManager(max_sessions=2, idle_s=10)
    manager.reserve("a")
    manager.reserve("b")
    with pytest.raises(SessionLimitError, match="maximum of 2 sessions"):
        manager.reserve("c")
    manager.release("a")
    manager.reserve("c")


def test_session_expiry() -> None:
    now = [0.0]
    manager = SessionManager(max_sessions=1, idle_s=10, clock=lambda: now[0])
    manager.reserve("t")
    session = manager.add("t", object(), 100)  # type: ignore[arg-type]
    now[0] = 5
    assert manager.sweep() == 0
    manager.acquire(session.id, "t")
    now[0] = 100
    assert manager.sweep() == 0  # busy sessions never expire
    manager.done(session)
    now[0] = 111
    assert manager.sweep() == 1
    manager.reserve("t")  # the slot is free again


def test_queue_full_is_429(alice: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: alice.post("/v1/chat/completions", json=body).status_code, range(8)))
    assert 429 in codes
    assert 200 in codes
    assert all(c in (200, 429) for c in codes)
    still_serves(alice)


def test_disconnect_cancels_streaming(vl: tuple[str, Runtime], alice: httpx.Client) -> None:
    url, _ = vl
    body = {
        "messages": [{"role": "user", "content": "forever"}],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    before = _metric(alice, "kamera_cancelled_requests_total")
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=60
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    t0 = time.perf_counter()
    still_serves(alice)  # the model thread is free again long before 2000 tokens
    assert time.perf_counter() - t0 < 10
    deadline = time.monotonic() + 10
    while _metric(alice, "kamera_cancelled_requests_total") <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(alice, "kamera_cancelled_requests_total") > before


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stream_error_before_first_token_is_plain_4xx(alice: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 20000}], "stream": True}
    r = alice.post("/v1/chat/completions", json=body)
    assert r.status_code in (400, 413)


def test_health_503_while_draining() -> None:
    runtime = Runtime.load(tiny_config("tiny:llama-gqa", limits=LIMITS))
    with BackgroundServer(create_app(runtime)) as url:
        assert httpx.get(url + "/health").status_code == 200
        runtime.draining = True
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_bounded_load(text_only_load: tuple[str, Runtime]) -> None:
    """8 clients, 48 requests (sessions, steps, chat): no 5xx, every session intact, RSS back."""
    url, runtime = text_only_load
    doc = "Reference: " + " ".join(f"item {i} costs {i * 3} coins." for i in range(12))

    def client_run(c: int) -> list[int]:
        codes = []
        with httpx.Client(base_url=url, timeout=120) as h:
            r = h.post(
                "/v1/sessions", json={"system_prompt": f"client {c}", "budget_tokens": 4000, "max_tokens": 2}
            )
            codes.append(r.status_code)
            sid = r.json()["id"]
            for i in range(2):
                r = h.post(
                    f"/v1/sessions/{sid}/steps",
                    json={
                        "observations": [{"type": "text", "text": f"client {c} note {i}"}],
                        "instruction": "ok",
                    },
                )
                codes.append(r.status_code)
            for i in range(2):
                body = {
                    "messages": [
                        {"role": "system", "content": f"Run {c}.{i}\n{doc}"},
                        {"role": "user", "content": "?"},
                    ],
                    "max_tokens": 2,
                }
                codes.append(h.post("/v1/chat/completions", json=body).status_code)
            window = h.get(f"/v1/sessions/{sid}").json()
            notes = [ch for ch in window["chunks"] if ch["kind"] == "text"]
            assert window["steps"] == 2
            assert len(notes) == 2, window
            codes.append(h.delete(f"/v1/sessions/{sid}").status_code)
        return codes

    with ThreadPoolExecutor(8) as pool:  # warm-up round: allocator and store reach their working size
        list(pool.map(client_run, range(8)))
    gc.collect()
    baseline = _rss_mb()
    with ThreadPoolExecutor(8) as pool:
        codes = [c for run in pool.map(client_run, range(8, 16)) for c in run]
    assert len(codes) == 8 * 6
    assert all(c < 500 for c in codes), codes
    assert set(codes) <= {200, 201, 204}, codes
    assert len(runtime.sessions) == 0
    gc.collect()
    assert _rss_mb() - baseline < 150, (baseline, _rss_mb())
    stats = runtime.store.stats()
    assert all(t.bytes_in_use <= t.budget_bytes for t in stats.tiers)


@pytest.fixture(scope="module")
def text_only_load() -> Iterator[tuple[str, Runtime]]:
    limits = ServerLimits(max_tokens=64, default_max_tokens=2, queue_size=16, max_sessions=16, drain_s=5)
    runtime = Runtime.load(tiny_config("tiny:llama-gqa", limits=limits))
    with BackgroundServer(create_app(runtime)) as url:
        yield url, runtime


def test_openapi_schema_fuzz() -> None:
    """schemathesis against the app's own OpenAPI schema, in-process, a bounded number of examples."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    runtime = Runtime.load(
        tiny_config("tiny:llama-gqa", limits=ServerLimits(max_tokens=8, default_max_tokens=2))
    )
    app = create_app(runtime)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures = []
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @schemathesis_given(operation)
        def check(case: Any) -> None:
            response = case.call()
            assert response.status_code < 500, (case.method, case.path, response.status_code, response.text)

        try:
            check()
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, failures


def schemathesis_given(operation: Any) -> Any:
    from hypothesis import given

    return given(case=operation.as_strategy())


def test_dockerfile_lints() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_shape() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "USER " in text
    assert "HEALTHCHECK" in text
    assert "VOLUME" in text
    assert "kamera" in text
    assert "--host" in text
    assert "0.0.0.0" in text


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"])
def test_every_route_but_health_needs_a_key(vl: tuple[str, Runtime], alice: httpx.Client, path: str) -> None:
    r = httpx.get(vl[0] + path)
    assert r.status_code == 401, (path, r.status_code)
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert alice.get(path).status_code in (200, 404)


def test_public_metrics_flag_and_health_shows_no_paths() -> None:
    config = tiny_config("tiny:llama-gqa", limits=LIMITS, api_keys=(("k", "t"),), public_metrics=True)
    runtime = Runtime.load(dataclasses.replace(config, model="tiny:llama-gqa", served_name=None))
    with BackgroundServer(create_app(runtime)) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert httpx.get(url + "/docs").status_code == 401
    assert dataclasses.replace(config, model="/srv/models/Qwen2.5-VL-3B").name == "Qwen2.5-VL-3B"
    runtime.error = "the model failed its warm-up: OSError: /srv/models/x/model.safetensors"
    ok, reason = runtime.health()
    assert not ok
    assert "/" not in reason


def test_tenant_queue_share_leaves_others_a_place() -> None:
    worker = ModelWorker(queue_size=3, tenant_capacity=2)
    worker.admit("a")
    worker.admit("a")
    with pytest.raises(QueueFullError, match="share of 2"):
        worker.admit("a")
    worker.admit("b")  # b still gets a place
    worker.leave("a")
    worker.admit("a")
    worker.shutdown()


def test_model_thread_serves_tenants_in_turn() -> None:
    """Tenant a queues five jobs before b queues two: b's run second and fourth, not last."""
    import asyncio
    import functools
    import threading

    worker = ModelWorker(queue_size=16)
    order: list[str] = []
    gate = threading.Event()

    async def main() -> None:
        first = asyncio.ensure_future(worker.run(gate.wait, threading.Event(), "a"))
        await asyncio.sleep(0.05)  # the model thread is now busy with a's first job
        jobs = [worker.run(functools.partial(order.append, t), threading.Event(), t) for t in "aaaaabb"]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, *tasks)

    asyncio.run(main())
    worker.shutdown()
    assert order == ["a", "b", "a", "b", "a", "a", "a"], order


def test_a_tenant_at_its_queue_share_leaves_another_answered(vl: tuple[str, Runtime]) -> None:
    """alice floods the queue (share 2 of 4 places): some of hers get 429, bob's request is served."""
    url, _ = vl
    body = {"messages": [{"role": "user", "content": "forever"}], "max_tokens": 8, "temperature": 0}

    def post(key: str) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120).status_code

    with ThreadPoolExecutor(7) as pool:
        floods = [pool.submit(post, "key-a") for _ in range(6)]
        time.sleep(0.3)
        bob = pool.submit(post, "key-b")
        codes = [f.result() for f in floods]
        assert bob.result() == 200
    assert 429 in codes
    assert codes.count(200) >= 1
