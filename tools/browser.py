"""A headless Chromium for web agents: screenshots and a few input actions, fenced to an allowlist.

`Browser` drives the system Chromium (Debian's /usr/bin/chromium; no downloaded browser) through
Playwright's sync API with a fresh profile directory per instance. Every request the page makes,
navigations and subresources alike, is intercepted: one whose origin is not on the allowlist
(by default the start URL's origin) is aborted, and a navigation aborted that way turns the
action that caused it into a refused `ActionResult`, after which the page is put back where it
was. Every action has a timeout and reports failure in its result instead of raising.

`serve_directory` is a loopback static file server for tests, demos and saved pages.

It does not: run several tabs, download files, handle dialogs beyond dismissing them, fence
WebSocket or WebRTC traffic, or sandbox Chromium (`--no-sandbox`: run it in a container).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page, Playwright, Request, Route

CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class BrowserError(Exception):
    """Chromium could not be launched, or the browser was used outside its `with` block."""


@dataclass(frozen=True)
class BrowserConfig:
    """How Chromium is launched and fenced. `allowed_origins` empty means the start URL's origin."""

    executable_path: str = "/usr/bin/chromium"
    viewport_width: int = 1280
    viewport_height: int = 800
    allowed_origins: tuple[str, ...] = ()
    action_timeout_s: float = 10.0
    navigation_timeout_s: float = 15.0
    # Time given to a click or key press to start a navigation before the action is judged.
    settle_s: float = 0.5
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.viewport_width <= 0 or self.viewport_height <= 0:
            raise ValueError(f"viewport must be positive, got {self.viewport_width}x{self.viewport_height}")
        if min(self.action_timeout_s, self.navigation_timeout_s) <= 0 or self.settle_s < 0:
            raise ValueError("timeouts must be positive and settle_s non-negative")
        for origin in self.allowed_origins:
            if origin_of(origin) is None:
                raise ValueError(f"not an http(s) origin: {origin!r}")


class ActionResult(NamedTuple):
    """Outcome of one action: `url` is the page's URL afterwards; `error` is None when ok."""

    ok: bool
    url: str
    error: str | None = None


def origin_of(url: str) -> str | None:
    """`scheme://host:port` of an http(s) URL with the default port made explicit; else None."""
    parts = urlsplit(url)
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    try:
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


class Browser:
    """One headless Chromium page. Use as a context manager; actions return ActionResult.

    Entering launches Chromium and opens `start_url` (raises BrowserError if Chromium cannot
    start; a failed first load is kept in `start_result`). Leaving closes it and deletes the
    profile directory. `blocked` lists every aborted request URL, `refused` the aborted
    navigations.
    """

    def __init__(self, start_url: str, config: BrowserConfig = BrowserConfig()) -> None:
        start_origin = origin_of(start_url)
        if start_origin is None:
            raise ValueError(f"start_url must be http(s): {start_url!r}")
        self.start_url = start_url
        self.config = config
        self.allowed = frozenset(origin_of(o) for o in config.allowed_origins) or frozenset({start_origin})
        self.blocked: list[str] = []
        self.refused: list[str] = []
        self.start_result: ActionResult | None = None
        self._playwright: Playwright | None = None
        self._context: BrowserContext | None = None
        self._page: Page | None = None
        self._profile: str | None = None
        self._before = ""
        self._navigating = 0  # main-frame navigation requests started and not yet done

    def __enter__(self) -> Browser:
        from playwright.sync_api import Error, sync_playwright

        if not Path(self.config.executable_path).is_file():
            raise BrowserError(f"Chromium not found at {self.config.executable_path}")
        self._profile = tempfile.mkdtemp(prefix="kamera-chromium-")
        self._playwright = sync_playwright().start()
        try:
            self._context = self._playwright.chromium.launch_persistent_context(
                self._profile,
                executable_path=self.config.executable_path,
                headless=True,
                args=[*CHROMIUM_ARGS, *self.config.extra_args],
                viewport={"width": self.config.viewport_width, "height": self.config.viewport_height},
                service_workers="block",  # so every request goes through the route below
                accept_downloads=False,
                timeout=self.config.navigation_timeout_s * 1000,
            )
        except Error as exc:
            self.__exit__(None, None, None)
            raise BrowserError(f"cannot launch {self.config.executable_path}: {exc}") from exc
        self._context.set_default_timeout(self.config.action_timeout_s * 1000)
        self._context.set_default_navigation_timeout(self.config.navigation_timeout_s * 1000)
        self._context.route("**/*", self._route)
        # A new page's history starts with the first goto; the launch tab's starts at about:blank.
        self._page = self._context.new_page()
        for stale in self._context.pages[:-1]:
            stale.close()
        self._page.on("dialog", lambda dialog: dialog.dismiss())
        self._page.on("request", lambda r: self._track(r, +1))
        self._page.on("requestfinished", lambda r: self._track(r, -1))
        self._page.on("requestfailed", lambda r: self._track(r, -1))
        self.start_result = self.goto(self.start_url)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._context is not None:
            self._context.close()
        if self._playwright is not None:
            self._playwright.stop()
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
        self._context = self._page = self._playwright = None
        self._profile = None

    @property
    def page(self) -> Page:
        """The Playwright page, for reads the actions do not cover. Raises BrowserError if closed."""
        if self._page is None:
            raise BrowserError("the browser is not open; use it inside a `with` block")
        return self._page

    @property
    def url(self) -> str:
        return self.page.url

    def screenshot(self) -> bytes:
        """PNG bytes of the viewport (viewport_width x viewport_height)."""
        return self.page.screenshot(type="png", timeout=self.config.action_timeout_s * 1000)

    def goto(self, url: str) -> ActionResult:
        """Navigate to `url`; refused without any request if its origin is not allowed."""
        if origin_of(url) not in self.allowed:
            self.refused.append(url)
            return ActionResult(False, self.page.url, f"refused: origin of {url} is not allowed")
        return self._act(lambda: self.page.goto(url, wait_until="load"), settle=False)

    def click(self, x: float, y: float) -> ActionResult:
        """Left-click at viewport coordinates (CSS pixels)."""
        return self._act(lambda: self.page.mouse.click(x, y))

    def type(self, text: str) -> ActionResult:
        """Type `text` into the focused element, key by key."""
        return self._act(lambda: self.page.keyboard.type(text), settle=False)

    def press(self, key: str) -> ActionResult:
        """Press one key or chord in Playwright's names ("Enter", "Control+A")."""
        return self._act(lambda: self.page.keyboard.press(key))

    def scroll(self, dx: float, dy: float) -> ActionResult:
        """Scroll by (dx, dy) CSS pixels with the mouse wheel at the viewport centre."""

        def wheel() -> None:
            self.page.mouse.move(self.config.viewport_width / 2, self.config.viewport_height / 2)
            self.page.mouse.wheel(dx, dy)

        return self._act(wheel)

    def back(self) -> ActionResult:
        """Go back one history entry; not ok when there is none or it leads off the allowlist."""
        before = self.page.url
        result = self._act(lambda: self.page.go_back(wait_until="load"), settle=False)
        if result.ok and origin_of(self.page.url) not in self.allowed:
            self._restore()
        if result.ok and self.page.url == before:
            return ActionResult(False, before, "no earlier history entry on an allowed origin")
        return result

    def _act(self, action: Any, settle: bool = True) -> ActionResult:
        from playwright.sync_api import Error

        page = self.page
        self._before = page.url
        n_refused = len(self.refused)
        try:
            action()
            if settle and self.config.settle_s:
                page.wait_for_timeout(self.config.settle_s * 1000)
            deadline = time.monotonic() + self.config.navigation_timeout_s
            while self._navigating > 0 and time.monotonic() < deadline:
                page.wait_for_timeout(50)  # lets the route handler and request events run
            page.wait_for_load_state("load")
        except Error as exc:
            if len(self.refused) == n_refused:
                return ActionResult(False, page.url, f"{type(exc).__name__}: {exc.message}")
        if len(self.refused) > n_refused:
            self._restore()
            return ActionResult(False, page.url, f"refused: navigation to {self.refused[-1]} is not allowed")
        return ActionResult(True, page.url)

    def _restore(self) -> None:
        # An aborted navigation may commit Chromium's error page as a new history entry. Going
        # back to the page we left leaves that entry ahead, where the next navigation drops it.
        from playwright.sync_api import Error

        page = self.page
        with suppress(Error):
            if page.url != self._before and page.url.startswith("chrome-error:"):
                page.go_back(wait_until="load")
            elif page.url != self._before and origin_of(page.url) is None:
                page.go_forward(wait_until="load")
            if page.url != self._before:
                page.goto(self._before, wait_until="load")

    def _track(self, request: Request, step: int) -> None:
        if request.is_navigation_request() and request.frame.parent_frame is None:
            self._navigating = max(0, self._navigating + step)

    def _route(self, route: Route) -> None:
        request = route.request
        if origin_of(request.url) in self.allowed:
            route.continue_()
            return
        self.blocked.append(request.url)
        if request.is_navigation_request() and request.frame.parent_frame is None:
            self.refused.append(request.url)
        route.abort("blockedbyclient")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class LocalServer(NamedTuple):
    """A running loopback server: `url` is its base (`http://127.0.0.1:<port>/`)."""

    url: str
    root: Path


@contextmanager
def serve_directory(root: str | Path) -> Iterator[LocalServer]:
    """Serve `root` read-only over http on 127.0.0.1 at a free port, in a daemon thread."""
    root = Path(root).resolve(strict=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, name="serve-directory", daemon=True)
    thread.start()
    try:
        yield LocalServer(f"http://127.0.0.1:{server.server_address[1]}/", root)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
