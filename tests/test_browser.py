from __future__ import annotations

import io
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tools.browser import Browser, BrowserConfig, LocalServer, origin_of, serve_directory
from tools.data import find_data_folder

REPO = Path(__file__).resolve().parents[1]
DATA = find_data_folder().path or REPO.parent / "shared" / "data"
CHROMIUM = os.environ.get("KAMERA_CHROMIUM", "/usr/bin/chromium")
VIEW_W, VIEW_H = 640, 480


def _abs(top: int, html: str) -> str:
    return f'<div style="position:absolute;left:20px;top:{top}px;font-size:28px">{html}</div>'


PAGES = {
    "index.html": (
        '<html><head><title>Home</title></head><body style="margin:0;background:#f4f0e0">'
        + _abs(20, "<h1 style='margin:0'>Home</h1>")
        + _abs(100, '<a href="/form.html">Go to the form</a>')
        + _abs(160, '<a href="http://example.com/">Leave the site</a>')
        + _abs(220, '<button onclick="document.title=\'clicked\'" style="font-size:28px">Press me</button>')
        + _abs(
            280,
            "<button onclick=\"location.href='http://example.org/x'\" style='font-size:28px'>"
            "Script exit</button>",
        )
        + _abs(340, '<a href="/long.html">Long page</a>')
        + '<img src="http://example.net/tracker.png">'
        + "</body></html>"
    ),
    "form.html": (
        '<html><head><title>Form</title></head><body style="background:#e0f0ff">'
        + _abs(20, "<h1 style='margin:0'>Search</h1>")
        + _abs(
            100,
            '<form action="/result.html" method="get"><input name="q" '
            'style="width:300px;height:40px;font-size:24px"></form>',
        )
        + "</body></html>"
    ),
    "result.html": "<html><head><title>Result</title></head><body><h1>Results</h1></body></html>",
    "long.html": (
        "<html><head><title>Long</title></head><body>"
        + "".join(
            f'<p style="font-size:28px;color:hsl({i * 7 % 360},70%,40%)">Line {i}</p>' for i in range(200)
        )
        + "</body></html>"
    ),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    root = tmp_path_factory.mktemp("site")
    for name, html in PAGES.items():
        (root / name).write_text(html)
    with serve_directory(root) as server:
        yield server


@pytest.fixture
def chromium() -> str:
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium, or set KAMERA_CHROMIUM)")
    return CHROMIUM


def _config(chromium: str) -> BrowserConfig:
    return BrowserConfig(
        executable_path=chromium,
        viewport_width=VIEW_W,
        viewport_height=VIEW_H,
        action_timeout_s=10,
        navigation_timeout_s=15,
        settle_s=1.0,
    )


def _pixels(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    assert image.size == (VIEW_W, VIEW_H)
    return np.asarray(image.convert("RGB"), dtype=np.float32)


def test_origin_of() -> None:
    assert origin_of("http://Example.com/a?b") == "http://example.com:80"
    assert origin_of("https://example.com:8443/") == "https://example.com:8443"
    assert origin_of("http://[::1]:9/") == "http://[::1]:9"
    assert origin_of("file:///etc/passwd") is None
    assert origin_of("javascript:alert(1)") is None
    with pytest.raises(ValueError, match="origin"):
        BrowserConfig(allowed_origins=("ftp://x",))
    with pytest.raises(ValueError, match="viewport"):
        BrowserConfig(viewport_width=0)


def test_serve_directory(site: LocalServer) -> None:
    assert site.url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(site.url + "result.html", timeout=5) as response:
        assert b"Results" in response.read()


def test_click_type_enter_back(site: LocalServer, chromium: str) -> None:
    with Browser(site.url + "index.html", _config(chromium)) as browser:
        assert browser.start_result is not None
        assert browser.start_result.ok
        home = _pixels(browser.screenshot())
        assert home.std() > 5.0  # not blank

        assert browser.click(40, 235).ok  # the button sets the title by script
        assert browser.page.title() == "clicked"

        result = browser.click(40, 115)  # link to the form
        assert result.ok, result
        assert result.url == site.url + "form.html"
        assert browser.click(100, 120).ok  # focus the input
        assert browser.type("kv cache").ok
        result = browser.press("Enter")
        assert result.ok, result
        assert result.url == site.url + "result.html?q=kv+cache"

        assert browser.back().url == site.url + "form.html"
        assert browser.back().url == site.url + "index.html"
        no_more = browser.back()
        assert not no_more.ok
        assert no_more.url == site.url + "index.html"
        assert "history" in (no_more.error or "")
        assert np.abs(_pixels(browser.screenshot()) - home).mean() < 1.0  # same page drawn again


def test_navigation_outside_allowlist_refused(site: LocalServer, chromium: str) -> None:
    with Browser(site.url + "index.html", _config(chromium)) as browser:
        # The page's external image was aborted, not loaded.
        assert "http://example.net/tracker.png" in browser.blocked
        for x, y, target in ((40, 175, "http://example.com/"), (40, 295, "http://example.org/x")):
            result = browser.click(x, y)
            assert not result.ok
            assert result.error is not None
            assert result.error.startswith("refused")
            assert target in result.error
            assert result.url == site.url + "index.html"
        assert browser.refused == ["http://example.com/", "http://example.org/x"]
        refused = browser.goto("https://example.com/")
        assert not refused.ok
        assert refused.url == site.url + "index.html"
        assert browser.goto(site.url + "form.html").ok
        assert all(not url.startswith(site.url) for url in browser.blocked)
        # The error pages of refused navigations do not linger in history.
        assert browser.back().url == site.url + "index.html"
        assert not browser.back().ok


def test_scroll_changes_view(site: LocalServer, chromium: str) -> None:
    with Browser(site.url + "long.html", _config(chromium)) as browser:
        top = _pixels(browser.screenshot())
        assert browser.scroll(0, 1200).ok
        assert browser.page.evaluate("window.scrollY") == pytest.approx(1200, abs=50)
        scrolled = _pixels(browser.screenshot())
        assert scrolled.std() > 5.0
        assert np.abs(scrolled - top).mean() > 1.0
        assert browser.scroll(0, -5000).ok
        assert browser.page.evaluate("window.scrollY") == 0


def test_unreachable_start_and_action_timeouts(chromium: str) -> None:
    config = BrowserConfig(executable_path=chromium, navigation_timeout_s=5, action_timeout_s=2)
    with Browser("http://127.0.0.1:9/", config) as browser:  # the discard port: nothing listens
        assert browser.start_result is not None
        assert not browser.start_result.ok
        assert browser.start_result.error


def test_missing_executable() -> None:
    from tools.browser import BrowserError

    with (
        pytest.raises(BrowserError, match="not found"),
        Browser("http://127.0.0.1:9/", BrowserConfig(executable_path="/nonexistent/chromium")),
    ):
        pass


WEB_PAGES = sorted(DATA.glob("web_pages/*.html"))


@pytest.mark.skipif(
    not WEB_PAGES, reason=f"saved web pages not found under {DATA}/web_pages (set KAMERA_DATA)"
)
def test_saved_pages_render_offline(chromium: str) -> None:
    with serve_directory(DATA / "web_pages") as server:
        start = server.url + WEB_PAGES[0].name
        with Browser(start, _config(chromium)) as browser:
            for page in WEB_PAGES[:3]:
                result = browser.goto(server.url + page.name)
                assert result.ok, result
                assert _pixels(browser.screenshot()).std() > 5.0
                assert browser.scroll(0, 600).ok
            assert all(not url.startswith(server.url) for url in browser.blocked)
