from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tools.data import find_data_folder
from tools.media import (
    DisallowedPathError,
    FetchConfig,
    FetchError,
    ImageLimits,
    ImageNotFoundError,
    ImageTooLargeError,
    ImageTruncatedError,
    MediaConfig,
    NotAnImageError,
    Resolver,
    check_public_host,
    decode_data_url,
    decode_image,
    load_image,
)

REPO = Path(__file__).resolve().parents[1]
DATA = find_data_folder().path or REPO.parent / "shared" / "data"
PUBLIC_IP = "93.184.215.14"


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with one tiny IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def test_modes_normalised_to_rgb() -> None:
    rgba = Image.new("RGBA", (8, 6), (255, 0, 0, 0))  # fully transparent red composites to white
    out = decode_image(encode(rgba))
    assert out.image.mode == "RGB"
    assert out.image.size == (8, 6)
    assert out.image.getpixel((0, 0)) == (255, 255, 255)
    assert out.format == "PNG"
    for mode in ("L", "P", "CMYK", "LA", "I;16"):
        fmt = "JPEG" if mode == "CMYK" else "PNG"
        assert decode_image(encode(Image.new(mode, (4, 4)), fmt)).image.mode == "RGB"
    jpeg = decode_image(encode(Image.new("RGB", (16, 16), (0, 128, 255)), "JPEG"))
    assert jpeg.format == "JPEG"


def test_exif_orientation_applied() -> None:
    image = Image.new("RGB", (20, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif)
    assert decode_image(buf.getvalue()).image.size == (10, 20)


def test_bad_bytes() -> None:
    with pytest.raises(NotAnImageError):
        decode_image(b"hello, this is text\n" * 10)
    with pytest.raises(NotAnImageError):
        decode_image(b"")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with pytest.raises(NotAnImageError):
        decode_image(eps)
    tiff = encode(Image.new("RGB", (4, 4)), "TIFF")
    with pytest.raises(NotAnImageError):
        decode_image(tiff)  # not in the default format allowlist
    assert decode_image(tiff, ImageLimits(formats=("TIFF",))).format == "TIFF"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated(fmt: str) -> None:
    noisy = Image.effect_noise((64, 64), 50).convert("RGB")
    data = encode(noisy, fmt)
    with pytest.raises(ImageTruncatedError):
        decode_image(data[: len(data) // 2])


def test_size_limits_before_decoding() -> None:
    data = encode(Image.new("RGB", (2000, 1000)))
    with pytest.raises(ImageTooLargeError, match="bytes"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))
    with pytest.raises(ImageTooLargeError, match="pixels"):
        decode_image(data, ImageLimits(max_pixels=1_999_999))
    # The header claims 10 gigapixels; only the header is read.
    bomb = png_header_only(100_000, 100_000)
    with pytest.raises(ImageTooLargeError):
        decode_image(bomb)
    # Our cap off, PIL's MAX_IMAGE_PIXELS bomb check still refuses it.
    with pytest.raises(ImageTooLargeError):
        decode_image(bomb, ImageLimits(max_pixels=10**12))


def test_data_urls() -> None:
    png = encode(Image.new("RGB", (5, 7), "green"))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert decode_data_url(url).image.size == (5, 7)
    assert load_image(url).image.getpixel((0, 0)) == (0, 128, 0)
    for bad in (
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png,rawbytes",
        "data:image/png;base64,@@@notbase64",
        "data:image/png;base64,aGVsbG8=",
    ):
        with pytest.raises(NotAnImageError):
            decode_data_url(bad)
    with pytest.raises(ImageTooLargeError):
        decode_data_url(url, ImageLimits(max_bytes=len(png) // 2))


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    (root / "sub").mkdir(parents=True)
    Image.new("RGB", (3, 3), "blue").save(root / "sub" / "ok.png")
    Image.new("RGB", (3, 3), "red").save(tmp_path / "secret.png")
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "alias.png").symlink_to(root / "sub" / "ok.png")
    return root


def test_local_paths(image_dir: Path) -> None:
    config = MediaConfig(allowed_dir=image_dir)
    assert load_image("sub/ok.png", config).image.size == (3, 3)
    assert load_image(image_dir / "sub" / "ok.png", config).source == str(image_dir / "sub" / "ok.png")
    assert load_image(f"file://{image_dir}/alias.png", config).image.getpixel((0, 0)) == (0, 0, 255)
    for escape in ("../secret.png", "escape.png", str(image_dir.parent / "secret.png"), "/etc/passwd"):
        with pytest.raises(DisallowedPathError):
            load_image(escape, config)
    with pytest.raises(ImageNotFoundError):
        load_image("missing.png", config)
    with pytest.raises(ImageNotFoundError):
        load_image("sub", config)
    with pytest.raises(DisallowedPathError, match="not allowed"):
        load_image("sub/ok.png")
    with pytest.raises(ImageTooLargeError):
        load_image("sub/ok.png", MediaConfig(limits=ImageLimits(max_bytes=10), allowed_dir=image_dir))


def test_fetch_off_by_default_and_config_checks() -> None:
    with pytest.raises(FetchError, match="disabled"):
        load_image("https://example.com/a.png")
    with pytest.raises(ValueError, match="no host"):
        FetchConfig(enabled=True)
    with pytest.raises(ValueError, match="http and https"):
        FetchConfig(allowed_schemes=frozenset({"ftp"}))


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "192.168.0.7",
        "172.16.5.5",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "240.0.0.1",
        "224.0.0.1",
        "::1",
        "fe80::1%eth0",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::",
    ],
)
def test_non_public_addresses_refused(address: str) -> None:
    with pytest.raises(FetchError, match="non-public"):
        check_public_host("example.com", 443, lambda host, port: [PUBLIC_IP, address])


def _fetch_config(**kw: object) -> MediaConfig:
    fetch = FetchConfig(enabled=True, allowed_hosts=frozenset({"img.example", "cdn.example"}), **kw)  # type: ignore[arg-type]
    return MediaConfig(fetch=fetch, limits=ImageLimits(max_bytes=50_000))


def _resolver(table: dict[str, str]) -> Resolver:
    return lambda host, port: [table[host]]


PNG = encode(Image.new("RGB", (9, 4), "yellow"))


def test_fetch_pins_checked_address() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=PNG)

    out = load_image(
        "https://IMG.example/a.png?x=1",
        _fetch_config(),
        _resolver({"img.example": PUBLIC_IP}),
        httpx.MockTransport(handler),
    )
    assert out.image.size == (9, 4)
    assert seen[0].url.host == PUBLIC_IP
    assert seen[0].headers["host"] == "img.example"
    assert seen[0].extensions["sni_hostname"] == "img.example"


def test_fetch_redirects_rechecked() -> None:
    table = {"img.example": PUBLIC_IP, "cdn.example": "10.0.0.5", "other.example": PUBLIC_IP}

    def handler(request: httpx.Request) -> httpx.Response:
        where = {
            "/private": "https://cdn.example/x.png",
            "/elsewhere": "https://other.example/x.png",
            "/loop": "/loop",
            "/plain": "http://img.example/x.png",
            "/ok": "/final",
        }
        if request.url.path in where:
            return httpx.Response(302, headers={"location": where[request.url.path]})
        return httpx.Response(200, content=PNG)

    transport = httpx.MockTransport(handler)
    config = _fetch_config()
    assert load_image("https://img.example/ok", config, _resolver(table), transport).image.size == (9, 4)
    for path, message in (
        ("/private", "non-public"),
        ("/elsewhere", "allowlist"),
        ("/loop", "redirects"),
        ("/plain", "scheme"),
    ):
        with pytest.raises(FetchError, match=message):
            load_image(f"https://img.example{path}", config, _resolver(table), transport)


def test_fetch_size_cap_and_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/declared":
            return httpx.Response(200, headers={"content-length": "999999"}, content=b"x" * 10)
        if request.url.path == "/missing":
            return httpx.Response(404)
        return httpx.Response(200, content=iter([b"\0" * 10_000] * 100))  # streamed, no length

    transport = httpx.MockTransport(handler)
    resolver = _resolver({"img.example": PUBLIC_IP})
    with pytest.raises(ImageTooLargeError, match="Content-Length"):
        load_image("https://img.example/declared", _fetch_config(), resolver, transport)
    with pytest.raises(ImageTooLargeError, match="body exceeds"):
        load_image("https://img.example/stream", _fetch_config(), resolver, transport)
    with pytest.raises(FetchError, match="404"):
        load_image("https://img.example/missing", _fetch_config(), resolver, transport)


def test_fetch_real_loopback_refused() -> None:
    config = MediaConfig(
        fetch=FetchConfig(
            enabled=True, allowed_hosts=frozenset({"localhost"}), allowed_schemes=frozenset({"http"})
        )
    )
    with pytest.raises(FetchError, match="non-public"):
        load_image("http://localhost:9/a.png", config)


SCREENSHOTS = DATA / "screenshots"


@pytest.mark.skipif(
    not SCREENSHOTS.is_dir(), reason=f"real screenshots not found at {SCREENSHOTS} (set KAMERA_DATA)"
)
def test_real_screenshots() -> None:
    config = MediaConfig(allowed_dir=SCREENSHOTS)
    paths = sorted(p for p in SCREENSHOTS.iterdir() if p.suffix in (".png", ".jpg"))
    assert paths
    for path in paths:
        out = load_image(path.name, config)
        with Image.open(path) as reference:
            assert out.image.size == reference.size
        assert out.image.mode == "RGB"
        assert out.format in ("PNG", "JPEG")
