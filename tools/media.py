"""Safe image loading from bytes, data URLs, local paths and (opt-in) http(s) URLs.

Every image passes the same gate before its pixels are decoded: a byte cap, a format allowlist
(so PIL never hands a file to an external interpreter such as Ghostscript for EPS), and a pixel
cap read from the header by PIL's lazy `Image.open`. PIL's own decompression-bomb check
(`Image.MAX_IMAGE_PIXELS`) stays on and is reported as ImageTooLargeError. The result is RGB:
alpha is composited on white, as qwen-vl-utils' `to_rgb` does, and EXIF orientation is applied.

Local paths are served only from one allowed directory: the path is resolved with symlinks
followed and refused if it lands outside. Fetching is off unless `FetchConfig.enabled`; then the
host must be on an allowlist, every address it resolves to must be public (no private, loopback,
link-local, reserved, multicast or unspecified address), the connection goes to the checked
address (so a second DNS answer cannot swap it), redirects are followed by hand with the same
checks at every hop, and the body is streamed under a byte cap and a deadline.

It does not: resize for a model (see qwen-vl-utils' `smart_resize`), keep animation frames
beyond the first, use proxies, or send cookies or credentials.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:
    import httpx

Resolver = Callable[[str, int], list[str]]


class MediaError(Exception):
    """Base class of every error this module raises about an image input."""


class NotAnImageError(MediaError):
    """The data is not an image in an allowed format (or the data URL is malformed)."""


class ImageTruncatedError(MediaError):
    """The header parsed but the pixel data ended early or is corrupt."""


class ImageTooLargeError(MediaError):
    """The input exceeds the byte cap or the pixel cap (including PIL's bomb check)."""


class ImageNotFoundError(MediaError):
    """The local path does not exist or is not a regular file."""


class DisallowedPathError(MediaError):
    """The local path resolves outside the allowed directory, or no directory is allowed."""


class FetchError(MediaError):
    """A URL was refused or its fetch failed: fetching off, scheme or host not allowed, a
    non-public address, too many redirects, an HTTP error status, or a timeout."""


@dataclass(frozen=True)
class ImageLimits:
    """Caps checked before pixels are decoded. `formats` are PIL format names."""

    max_bytes: int = 32 << 20
    max_pixels: int = 50_000_000
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0:
            raise ValueError(
                f"limits must be positive: max_bytes={self.max_bytes}, max_pixels={self.max_pixels}"
            )
        if not self.formats:
            raise ValueError("at least one image format must be allowed")


@dataclass(frozen=True)
class FetchConfig:
    """http(s) fetching; off by default. Hosts match exactly, case-insensitively."""

    enabled: bool = False
    allowed_hosts: frozenset[str] = frozenset()
    allowed_schemes: frozenset[str] = frozenset({"https"})
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    total_timeout_s: float = 30.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", frozenset(h.lower() for h in self.allowed_hosts))
        if not self.allowed_schemes <= {"http", "https"}:
            raise ValueError(f"only http and https can be allowed, got {sorted(self.allowed_schemes)}")
        if min(self.connect_timeout_s, self.read_timeout_s, self.total_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        if self.enabled and not self.allowed_hosts:
            raise ValueError("fetching is enabled but no host is allowed")


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from. `allowed_dir` None refuses every local path."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    allowed_dir: Path | None = None
    fetch: FetchConfig = field(default_factory=FetchConfig)


class LoadedImage(NamedTuple):
    """A decoded RGB image with where it came from, its source format and its encoded size."""

    image: Image.Image
    source: str
    format: str
    byte_size: int


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), source: str = "bytes") -> LoadedImage:
    """Decode image bytes to RGB after the byte, format and header pixel checks.

    Raises ImageTooLargeError, NotAnImageError or ImageTruncatedError.
    """
    if len(data) > limits.max_bytes:
        raise ImageTooLargeError(f"{source}: {len(data)} bytes exceeds max_bytes={limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=limits.formats)
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"{source}: {exc}") from exc
    except (UnidentifiedImageError, SyntaxError, ValueError, OSError) as exc:
        raise NotAnImageError(f"{source}: not an image in {'/'.join(limits.formats)}: {exc}") from exc
    with image:
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ImageTooLargeError(
                f"{source}: {width}x{height} pixels exceeds max_pixels={limits.max_pixels}"
            )
        fmt = image.format or "?"
        try:
            image.load()
            rgb = _to_rgb(ImageOps.exif_transpose(image))
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(f"{source}: {exc}") from exc
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ImageTruncatedError(f"{source}: pixel data is truncated or corrupt: {exc}") from exc
    return LoadedImage(rgb, source, fmt, len(data))


def decode_data_url(url: str, limits: ImageLimits = ImageLimits()) -> LoadedImage:
    """Decode a `data:image/<type>;base64,<payload>` URL. Errors as `decode_image`."""
    head, sep, payload = url.partition(",")
    if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
        raise NotAnImageError(f"not a base64 image data URL: {head[:64]!r}")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageTooLargeError(
            f"data URL carries about {len(payload) * 3 // 4} bytes, over max_bytes={limits.max_bytes}"
        )
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise NotAnImageError(f"data URL payload is not valid base64: {exc}") from exc
    return decode_image(data, limits, source=head)


def read_allowed_file(path: str | Path, allowed_dir: Path, max_bytes: int) -> tuple[Path, bytes]:
    """Read a file that must resolve (symlinks followed) inside `allowed_dir`; relative paths are
    taken from `allowed_dir`. Returns the resolved path and its bytes.

    Raises DisallowedPathError, ImageNotFoundError or ImageTooLargeError (checked before reading).
    """
    root = allowed_dir.resolve(strict=True)
    target = root / path
    try:
        resolved = target.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise ImageNotFoundError(f"{path}: no such file") from exc
    except RuntimeError as exc:  # symlink loop
        raise DisallowedPathError(f"{path}: cannot be resolved: {exc}") from exc
    if not resolved.is_relative_to(root):
        raise DisallowedPathError(f"{path}: resolves to {resolved}, outside {root}")
    if not resolved.is_file():
        raise ImageNotFoundError(f"{path}: not a regular file")
    # O_NOFOLLOW: a symlink swapped in after resolving is refused rather than followed.
    try:
        fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise DisallowedPathError(f"{path}: cannot open {resolved} without following links: {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ImageTooLargeError(f"{path}: {size} bytes exceeds max_bytes={max_bytes}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageTooLargeError(f"{path}: grew past max_bytes={max_bytes} while reading")
    return resolved, data


def load_image(
    source: str | bytes | Path,
    config: MediaConfig = MediaConfig(),
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> LoadedImage:
    """Load an image from bytes, a data URL, an http(s) URL, a `file://` URL or a local path.

    `resolver` and `transport` (an httpx transport) replace DNS and the network for tests.
    Raises a MediaError subclass for every bad input.
    """
    limits = config.limits
    if isinstance(source, bytes):
        return decode_image(source, limits)
    text = str(source)
    if isinstance(source, str) and text.startswith("data:"):
        return decode_data_url(text, limits)
    if isinstance(source, str) and text.split(":", 1)[0].lower() in ("http", "https"):
        return decode_image(
            fetch_bytes(text, config.fetch, limits.max_bytes, resolver, transport), limits, source=text
        )
    if isinstance(source, str) and text.startswith("file://"):
        text = text[len("file://") :]
    if config.allowed_dir is None:
        raise DisallowedPathError(f"{text}: local files are not allowed (no allowed_dir)")
    resolved, data = read_allowed_file(text, config.allowed_dir, limits.max_bytes)
    return decode_image(data, limits, source=str(resolved))


def check_public_host(host: str, port: int, resolver: Resolver | None = None) -> list[str]:
    """Resolve `host` and return its addresses if every one is public; else raise FetchError."""
    try:
        addresses = (resolver or _getaddrinfo)(host, port)
    except OSError as exc:
        raise FetchError(f"{host}: DNS resolution failed: {exc}") from exc
    if not addresses:
        raise FetchError(f"{host}: resolved to no address")
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
            raise FetchError(f"{host}: resolves to non-public address {ip}")
    return addresses


def fetch_bytes(
    url: str,
    fetch: FetchConfig,
    max_bytes: int,
    resolver: Resolver | None = None,
    transport: httpx.BaseTransport | None = None,
) -> bytes:
    """GET `url` under `fetch`'s policy (module doc), following redirects by hand.

    Raises FetchError for a refused or failed fetch and ImageTooLargeError past `max_bytes`.
    """
    import httpx  # optional dependency, needed only when fetching is on

    if not fetch.enabled:
        raise FetchError(f"{url}: fetching URLs is disabled")
    deadline = time.monotonic() + fetch.total_timeout_s
    timeout = httpx.Timeout(fetch.read_timeout_s, connect=fetch.connect_timeout_s)
    with httpx.Client(
        timeout=timeout, trust_env=False, follow_redirects=False, transport=transport
    ) as client:
        current = httpx.URL(url)
        for _ in range(fetch.max_redirects + 1):
            request = _pinned_request(client, current, fetch, resolver)
            try:
                response = client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise FetchError(f"{current}: request failed: {exc}") from exc
            try:
                if response.is_redirect:
                    current = current.join(response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise FetchError(f"{current}: HTTP {response.status_code}")
                return _read_capped(response, max_bytes, deadline, str(current))
            finally:
                response.close()
        raise FetchError(f"{url}: more than {fetch.max_redirects} redirects")


def _pinned_request(
    client: httpx.Client, url: httpx.URL, fetch: FetchConfig, resolver: Resolver | None
) -> httpx.Request:
    if url.scheme not in fetch.allowed_schemes:
        raise FetchError(f"{url}: scheme {url.scheme!r} is not allowed")
    host = url.host.lower()
    if host not in fetch.allowed_hosts:
        raise FetchError(f"{url}: host {host!r} is not on the allowlist")
    port = url.port or (443 if url.scheme == "https" else 80)
    address = check_public_host(host, port, resolver)[0]
    headers = {"Host": url.netloc.decode("ascii"), "Accept": "image/*", "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}
    return client.build_request("GET", url.copy_with(host=address), headers=headers, extensions=extensions)


def _read_capped(response: httpx.Response, max_bytes: int, deadline: float, where: str) -> bytes:
    import httpx

    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ImageTooLargeError(f"{where}: Content-Length {declared} exceeds max_bytes={max_bytes}")
    body = bytearray()
    try:
        for chunk in response.iter_bytes():  # decoded, so a compressed body is capped too
            body += chunk
            if len(body) > max_bytes:
                raise ImageTooLargeError(f"{where}: body exceeds max_bytes={max_bytes}")
            if time.monotonic() > deadline:
                raise FetchError(f"{where}: download exceeded the total timeout")
    except httpx.HTTPError as exc:
        raise FetchError(f"{where}: download failed: {exc}") from exc
    return bytes(body)


def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
