"""Request media to images: ``image_url`` parts through ``tools/media.py``, ``video_url`` parts
sampled into frames through ``tools/video.py``, each under the server's limits.

Accepted sources: ``data:`` URLs; local files only inside the allowed directory (none by
default); http(s) only when fetching is enabled, with the host allowlist and every other check
of ``tools/media.py``. A video is written to a temporary file (PyAV reads files), probed, and
refused from its metadata (bytes, duration, frame size) before a frame is decoded.

Not here: turning images into model chunks (the adapter does, in the model thread).
"""

from __future__ import annotations

import base64
import binascii
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from PIL import Image

from agent.engine.limits import ServerLimits
from tools.media import (
    FetchConfig,
    ImageLimits,
    ImageTooLargeError,
    MediaConfig,
    MediaError,
    fetch_bytes,
    load_image,
    read_allowed_file,
)


class MediaLimitError(ValueError):
    """A media input is over a limit (maps to 413)."""


class BadMediaError(ValueError):
    """A media input is malformed, unreachable or not allowed (maps to 400)."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from: ``allowed_dir`` for local files (None: none), ``fetch`` for
    http(s) (off by default)."""

    allowed_dir: Path | None = None
    fetch: FetchConfig = field(default_factory=FetchConfig)

    def config(self, limits: ServerLimits) -> MediaConfig:
        return MediaConfig(
            ImageLimits(max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels),
            self.allowed_dir,
            self.fetch,
        )


class VideoClip(NamedTuple):
    """A video's sampled frames and their timestamps (seconds from the stream's start)."""

    frames: list[Image.Image]
    timestamps: list[float]


def load_image_url(url: str, policy: MediaPolicy, limits: ServerLimits) -> Image.Image:
    try:
        return load_image(url, policy.config(limits)).image
    except ImageTooLargeError as exc:
        raise MediaLimitError(f"image: {exc}") from exc
    except MediaError as exc:
        raise BadMediaError(f"image: {exc}") from exc


def _video_bytes(url: str, policy: MediaPolicy, limits: ServerLimits) -> bytes:
    cap = limits.max_video_bytes
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not (sep and head.startswith("data:video/") and head.endswith(";base64")):
            raise BadMediaError(f"video: not a base64 video data URL: {head[:64]!r}")
        if len(payload) * 3 // 4 > cap:
            raise MediaLimitError(f"video: data URL carries about {len(payload) * 3 // 4} bytes, over {cap}")
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadMediaError(f"video: data URL payload is not valid base64: {exc}") from exc
    try:
        if url.split(":", 1)[0].lower() in ("http", "https"):
            return fetch_bytes(url, policy.fetch, cap)
        if policy.allowed_dir is None:
            raise BadMediaError("video: local files are not allowed")
        return read_allowed_file(url.removeprefix("file://"), policy.allowed_dir, cap)[1]
    except ImageTooLargeError as exc:
        raise MediaLimitError(f"video: {exc}") from exc
    except MediaError as exc:
        raise BadMediaError(f"video: {exc}") from exc


def load_video_url(url: str, policy: MediaPolicy, limits: ServerLimits, max_frames: int) -> VideoClip:
    """Sampled frames of a video, at most ``max_frames`` (the request's remaining frame budget)."""
    from tools.video import (
        FRAME_FACTOR,
        SamplingConfig,
        VideoError,
        VideoLimitError,
        VideoLimits,
        iter_frames,
    )

    if max_frames < FRAME_FACTOR:
        raise MediaLimitError(f"video: the request's frame limit ({limits.max_frames}) is used up")
    data = _video_bytes(url, policy, limits)
    sampling = SamplingConfig(
        fps=limits.video_fps,
        min_frames=FRAME_FACTOR,
        max_frames=max_frames,
        min_pixels=limits.frame_min_pixels,
        max_pixels=limits.frame_max_pixels,
    )
    bounds = VideoLimits(
        max_file_bytes=limits.max_video_bytes,
        max_duration_s=limits.max_video_seconds,
        max_frame_pixels=limits.max_image_pixels,
    )
    clip = VideoClip([], [])
    with tempfile.NamedTemporaryFile(prefix="kamera-video-", suffix=".bin") as f:
        f.write(data)
        f.flush()
        try:
            for fr in iter_frames(f.name, sampling, bounds):
                clip.frames.append(fr.to_pil())
                clip.timestamps.append(float(fr.timestamp))
        except VideoLimitError as exc:
            raise MediaLimitError(f"video: {exc}") from exc
        except VideoError as exc:
            raise BadMediaError(f"video: {exc}") from exc
    if len(clip.frames) > max_frames:
        raise MediaLimitError(f"video: {len(clip.frames)} frames exceed the request's limit")
    return clip
