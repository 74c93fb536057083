"""Video frame sampling with PyAV, following qwen-vl-utils' sampling rules.

How many frames to take, which ones, and what size they become are decided by qwen-vl-utils'
own functions (`smart_nframes`, `calculate_video_frame_range`, `smart_resize`) and constants,
so the frames match what `qwen_vl_utils.fetch_video` would give a Qwen-VL model: the count is a
multiple of `FRAME_FACTOR`, the source indices are `linspace(start, end, n).round()`, and every
frame is resized (bicubic, antialiased) to multiples of `patch_size * SPATIAL_MERGE_SIZE` within
the per-frame pixel bounds.

Decoding is streaming: `iter_frames` decodes the stream once, front to back, and yields each
sampled frame as soon as it is decoded; no other decoded frame is kept, so memory stays flat
however long the video is. Limits (file size, duration, frame count, pixels per frame) are checked
from the container and stream metadata before any frame is decoded.

It does not: fetch URLs, read audio, seek (a sparse sample of a long video still decodes every
frame), or handle variable-frame-rate streams beyond trusting the average rate for the frame
count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import av
import numpy as np
import torch
from PIL import Image
from qwen_vl_utils.vision_process import (
    FRAME_FACTOR,
    MODEL_SEQ_LEN,
    SPATIAL_MERGE_SIZE,
    VIDEO_MAX_TOKEN_NUM,
    VIDEO_MIN_TOKEN_NUM,
    calculate_video_frame_range,
    smart_nframes,
    smart_resize,
)
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

# Demuxers that open a still image as a one-frame "video".
# still images, and tty: FFmpeg renders any text file as a video through its tty demuxer
_IMAGE_FORMATS = ("image2", "gif", "webp_pipe", "apng", "tty")


class VideoError(Exception):
    """Base class of every error this module raises about a video input."""


class NotAVideoError(VideoError):
    """The file is missing, is not a container PyAV can read, or is a still image."""


class NoVideoStreamError(VideoError):
    """The container has no video stream (for example, audio only)."""


class VideoMetadataError(VideoError):
    """Size, rate or duration is missing from the metadata, so limits cannot be checked up front."""


class VideoLimitError(VideoError):
    """The video exceeds a configured limit (file size, duration, frame count, pixels per frame)."""


class VideoDecodeError(VideoError):
    """The decoder failed on the stream's data."""


class VideoTruncatedError(VideoDecodeError):
    """The stream ended well before the frame count its metadata promised."""


@dataclass(frozen=True)
class VideoLimits:
    """Bounds checked from metadata before decoding. Every field must be positive."""

    max_file_bytes: int = 2 << 30
    max_duration_s: float = 3 * 3600.0
    max_total_frames: int = 1_000_000
    max_frame_pixels: int = 4096 * 4096
    # Frames missing at the end that are still accepted (metadata rounding, last-frame drops).
    truncation_tolerance: float = 0.02

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_duration_s", "max_total_frames", "max_frame_pixels"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VideoLimits.{name} must be positive, got {getattr(self, name)!r}")
        if not 0.0 <= self.truncation_tolerance < 1.0:
            raise ValueError(f"truncation_tolerance must be in [0, 1), got {self.truncation_tolerance}")


@dataclass(frozen=True)
class SamplingConfig:
    """How frames are sampled and resized, with qwen-vl-utils' meaning for every field.

    Give at most one of `fps` and `nframes`; with neither, qwen-vl-utils' default `FPS` applies.
    `min_frames`/`max_frames` only apply with `fps`. Pixel bounds left as None take the values
    `fetch_video` computes (`VIDEO_MIN_TOKEN_NUM`/`VIDEO_MAX_TOKEN_NUM` tokens per frame, and
    `total_pixels` spread over the sampled frames). `patch_size` is 14 for Qwen2/2.5-VL, 16 for
    Qwen3-VL.
    """

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    patch_size: int = 14
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    video_start: float | None = None
    video_end: float | None = None

    def __post_init__(self) -> None:
        if self.fps is not None and self.nframes is not None:
            raise ValueError("give either fps or nframes, not both")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.nframes is not None and self.nframes < FRAME_FACTOR:
            raise ValueError(f"nframes must be at least {FRAME_FACTOR}, got {self.nframes}")
        if self.nframes is not None and (self.min_frames is not None or self.max_frames is not None):
            raise ValueError("min_frames/max_frames only apply with fps")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.min_pixels is not None and self.max_pixels is not None and self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels={self.max_pixels} is below min_pixels={self.min_pixels}")
        if self.patch_size <= 0:
            raise ValueError(f"patch_size must be positive, got {self.patch_size}")
        for name in ("video_start", "video_end"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def image_factor(self) -> int:
        """Side multiple of every resized frame: patch size times the spatial merge size."""
        return self.patch_size * SPATIAL_MERGE_SIZE

    def qwen_element(self) -> dict[str, float | int]:
        """The `ele` dict that qwen-vl-utils' functions read these settings from."""
        ele: dict[str, float | int] = {}
        for name in ("fps", "nframes", "min_frames", "max_frames", "video_start", "video_end"):
            value = getattr(self, name)
            if value is not None:
                ele[name] = value
        return ele


class VideoInfo(NamedTuple):
    """Metadata read without decoding. `total_frames` is estimated from duration where absent."""

    path: Path
    file_bytes: int
    format_name: str
    codec: str
    width: int
    height: int
    fps: float
    total_frames: int
    duration_s: float
    start_time_s: float


class SamplePlan(NamedTuple):
    """Which source frames to take (sorted, may repeat) and the size each is resized to."""

    indices: tuple[int, ...]
    height: int
    width: int
    sample_fps: float


class VideoFrame(NamedTuple):
    """One sampled frame. `image` is uint8 `[3, H, W]` RGB; `timestamp` is seconds from stream start."""

    position: int
    source_index: int
    timestamp: float
    image: torch.Tensor

    def to_pil(self) -> Image.Image:
        """The frame as a PIL RGB image."""
        return Image.fromarray(self.image.permute(1, 2, 0).numpy())


class SampledVideo(NamedTuple):
    """All sampled frames stacked: `frames` is uint8 `[T, 3, H, W]`, `timestamps` has T entries."""

    frames: torch.Tensor
    timestamps: tuple[float, ...]
    source_indices: tuple[int, ...]
    sample_fps: float
    info: VideoInfo


def probe_video(path: str | Path, limits: VideoLimits = VideoLimits()) -> VideoInfo:
    """Read a video's metadata and check it against `limits`; decodes nothing.

    Raises NotAVideoError, NoVideoStreamError, VideoMetadataError or VideoLimitError.
    """
    path = Path(path)
    if not path.is_file():
        raise NotAVideoError(f"{path}: no such file")
    file_bytes = path.stat().st_size
    if file_bytes > limits.max_file_bytes:
        raise VideoLimitError(f"{path}: {file_bytes} bytes exceeds max_file_bytes={limits.max_file_bytes}")
    with _open(path) as container:
        return _read_info(path, file_bytes, container, limits)


def plan_sampling(info: VideoInfo, sampling: SamplingConfig = SamplingConfig()) -> SamplePlan:
    """Pick source frame indices and the output size by qwen-vl-utils' rules (see module doc).

    Raises VideoError when the video is too short for the requested sampling.
    """
    ele = sampling.qwen_element()
    try:
        start, end, n_range = calculate_video_frame_range(ele, info.total_frames, info.fps)
        nframes = smart_nframes(ele, total_frames=n_range, video_fps=info.fps)
    except ValueError as exc:
        raise VideoError(f"{info.path}: cannot sample {ele} from {info.total_frames} frames: {exc}") from exc
    indices = tuple(torch.linspace(start, end, nframes).round().long().tolist())
    sample_fps = nframes / max(n_range, 1e-6) * info.fps

    factor = sampling.image_factor
    min_pixels = sampling.min_pixels or VIDEO_MIN_TOKEN_NUM * factor * factor
    total_pixels = sampling.total_pixels or MODEL_SEQ_LEN * factor * factor * 0.9
    cap = max(
        min(VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * FRAME_FACTOR),
        int(min_pixels * 1.05),
    )
    max_pixels = min(sampling.max_pixels, cap) if sampling.max_pixels is not None else cap
    try:
        height, width = smart_resize(
            info.height, info.width, factor=factor, min_pixels=min_pixels, max_pixels=int(max_pixels)
        )
    except (ValueError, AssertionError) as exc:
        raise VideoError(f"{info.path}: cannot resize {info.width}x{info.height}: {exc}") from exc
    return SamplePlan(indices=indices, height=height, width=width, sample_fps=sample_fps)


def iter_frames(
    path: str | Path,
    sampling: SamplingConfig = SamplingConfig(),
    limits: VideoLimits = VideoLimits(),
) -> Iterator[VideoFrame]:
    """Decode `path` once, front to back, yielding each sampled frame as it is decoded.

    Only the current frame and the last decoded one are held. Metadata and limits are checked
    before the first frame (errors as `probe_video`). If the stream ends early by at most
    `limits.truncation_tolerance` of its frames, the missing samples repeat the last decoded
    frame; if it ends earlier, VideoTruncatedError is raised after the frames already yielded.
    Decoder failures raise VideoDecodeError.
    """
    path = Path(path)
    info = probe_video(path, limits)
    plan = plan_sampling(info, sampling)
    with _open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        targets = plan.indices
        pos = 0
        last: tuple[int, float, av.VideoFrame] | None = None
        try:
            for src, frame in enumerate(container.decode(stream)):
                last = (src, _timestamp(frame, src, info), frame)
                while pos < len(targets) and targets[pos] == src:
                    yield VideoFrame(pos, src, last[1], _resize(frame, plan))
                    pos += 1
                if pos == len(targets):
                    return
        except av.error.FFmpegError as exc:
            raise VideoDecodeError(f"{path}: decoding failed after {pos} sampled frames: {exc}") from exc
        decoded = last[0] + 1 if last is not None else 0
        missing = info.total_frames - decoded
        if last is None or missing > limits.truncation_tolerance * info.total_frames + 1:
            raise VideoTruncatedError(f"{path}: stream ended after {decoded} of {info.total_frames} frames")
        image = _resize(last[2], plan)
        for p in range(pos, len(targets)):
            yield VideoFrame(p, last[0], last[1], image)


def read_video(
    path: str | Path,
    sampling: SamplingConfig = SamplingConfig(),
    limits: VideoLimits = VideoLimits(),
) -> SampledVideo:
    """Collect `iter_frames` into one tensor; holds the sampled frames only. Errors as `iter_frames`."""
    info = probe_video(path, limits)
    plan = plan_sampling(info, sampling)
    frames = list(iter_frames(path, sampling, limits))
    return SampledVideo(
        frames=torch.stack([f.image for f in frames]),
        timestamps=tuple(f.timestamp for f in frames),
        source_indices=tuple(f.source_index for f in frames),
        sample_fps=plan.sample_fps,
        info=info,
    )


def write_video(
    path: str | Path,
    frames: Iterable[np.ndarray | Image.Image],
    fps: int | Fraction = 4,
    codec: str = "libx264",
    options: dict[str, str] | None = None,
) -> int:
    """Encode RGB frames (uint8 `[H, W, 3]` arrays or PIL images, all one size) into `path`.

    The container follows the suffix (.mp4, .mkv, .webm, ...). MP4 files get their index at the
    front (`movflags=faststart`), so a truncated copy still opens. Width and height must be even
    for yuv420p. Returns the number of frames written; raises ValueError on an empty iterable.
    """
    path = Path(path)
    written = 0
    faststart = {"movflags": "faststart"} if path.suffix.lower() in (".mp4", ".mov", ".m4v") else {}
    with av.open(str(path), mode="w", options=faststart) as container:
        stream: av.VideoStream | None = None
        for item in frames:
            array = np.asarray(item.convert("RGB")) if isinstance(item, Image.Image) else item
            if stream is None:
                stream = _video_stream(container.add_stream(codec, rate=fps, options=options or {}))
                stream.height, stream.width = array.shape[:2]
                stream.pix_fmt = "yuv420p"
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array, dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
            written += 1
        if stream is None:
            raise ValueError("write_video needs at least one frame")
        container.mux(stream.encode(None))
    return written


def counter_frames(n: int, width: int = 320, height: int = 240) -> Iterator[np.ndarray]:
    """`n` synthetic frames: the top half shows the frame index as 16 black/white bars (MSB
    left), robust to lossy coding; the bottom half is a moving gradient. uint8 `[H, W, 3]`."""
    xs = np.arange(width)
    bar = (xs * 16) // width
    ys = np.arange(height // 2)[:, None]
    for i in range(n):
        bits = ((i >> (15 - bar)) & 1).astype(np.uint8) * 255
        top = np.broadcast_to(bits[None, :, None], (height // 2, width, 3))
        grad = ((xs[None, :] + ys + 3 * i) % 256).astype(np.uint8)
        bottom = np.stack([grad, grad[::-1], np.full_like(grad, (7 * i) % 256)], axis=-1)
        bottom = np.broadcast_to(bottom, (height - height // 2, width, 3))
        yield np.concatenate([top, bottom], axis=0)


def _open(path: Path) -> av.container.InputContainer:
    try:
        return av.open(str(path), mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        raise NotAVideoError(f"{path}: not a readable video container: {exc}") from exc


def _video_stream(stream: object) -> av.VideoStream:
    if not isinstance(stream, av.VideoStream):
        raise ValueError(f"codec did not give a video stream: {stream!r}")
    return stream


def _read_info(
    path: Path, file_bytes: int, container: av.container.InputContainer, limits: VideoLimits
) -> VideoInfo:
    fmt = container.format.name
    if fmt in _IMAGE_FORMATS or fmt.endswith("_pipe"):
        raise NotAVideoError(f"{path}: {fmt} is a still image, not a video")
    if not container.streams.video:
        kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "none"
        raise NoVideoStreamError(f"{path}: no video stream (streams: {kinds})")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    rate = stream.average_rate or stream.guessed_rate
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / av.time_base
    else:
        duration = 0.0
    if not (width and height and rate and duration > 0):
        raise VideoMetadataError(
            f"{path}: metadata lacks size, frame rate or duration "
            f"(size={width}x{height}, rate={rate}, duration={duration})"
        )
    fps = float(rate)
    total = stream.frames if stream.frames > 0 else round(duration * fps)
    start = float(stream.start_time * stream.time_base) if stream.start_time and stream.time_base else 0.0
    checks = (
        ("duration_s", duration, limits.max_duration_s),
        ("total_frames", total, limits.max_total_frames),
        ("frame_pixels", width * height, limits.max_frame_pixels),
    )
    for name, value, bound in checks:
        if value > bound:
            raise VideoLimitError(f"{path}: {name}={value} exceeds the limit {bound}")
    return VideoInfo(
        path, file_bytes, fmt, stream.codec_context.name, width, height, fps, total, duration, start
    )


def _timestamp(frame: av.VideoFrame, src: int, info: VideoInfo) -> float:
    t = frame.time
    return max(0.0, t - info.start_time_s) if t is not None else src / info.fps


def _resize(frame: av.VideoFrame, plan: SamplePlan) -> torch.Tensor:
    # image: [3, H, W] uint8; the same bicubic antialiased resize fetch_video applies.
    # reformat then to_ndarray: the same pixels as to_ndarray(format="rgb24"), several times faster
    image = torch.from_numpy(frame.reformat(format="rgb24").to_ndarray()).permute(2, 0, 1)
    if image.shape[1:] == (plan.height, plan.width):
        return image.contiguous()
    return TF.resize(
        image, [plan.height, plan.width], interpolation=InterpolationMode.BICUBIC, antialias=True
    )
