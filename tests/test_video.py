from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from tools.data import find_data_folder
from tools.video import (
    NotAVideoError,
    NoVideoStreamError,
    SamplingConfig,
    VideoDecodeError,
    VideoError,
    VideoLimitError,
    VideoLimits,
    VideoTruncatedError,
    counter_frames,
    iter_frames,
    plan_sampling,
    probe_video,
    read_video,
    write_video,
)

REPO = Path(__file__).resolve().parents[1]
DATA = find_data_folder().path or REPO.parent / "shared" / "data"
W, H, FPS = 192, 144, 2  # small and slow so a 10-minute video encodes in seconds


def read_counter(image: torch.Tensor) -> int:
    """Decode the 16-bar frame index that `counter_frames` draws into the top half."""
    _, h, w = image.shape
    row = image[:, h // 4, :].float().mean(dim=0)
    bits = [int(row[int((b + 0.5) * w / 16)] > 127) for b in range(16)]
    return int("".join(map(str, bits)), 2)


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for name, minutes in (("1min", 1), ("10min", 10)):
        out[name] = root / f"{name}.mp4"
        write_video(out[name], counter_frames(minutes * 60 * FPS, W, H), fps=FPS)
    return out


def test_probe_reads_metadata(videos: dict[str, Path]) -> None:
    info = probe_video(videos["1min"])
    assert (info.width, info.height, info.fps, info.total_frames) == (W, H, 2.0, 120)
    assert info.duration_s == pytest.approx(60.0)
    assert info.codec == "h264"


@pytest.mark.parametrize(
    ("name", "fps", "expected"),
    [("1min", 0.5, 30), ("10min", 0.5, 300), pytest.param("10min", 2.0, 768, marks=pytest.mark.slow)],
)
def test_fps_sampling_count_indices_and_timestamps(
    videos: dict[str, Path], name: str, fps: float, expected: int
) -> None:
    frames = list(iter_frames(videos[name], SamplingConfig(fps=fps)))
    total = probe_video(videos[name]).total_frames
    # qwen-vl-utils: n = floor_even(clamp(total / video_fps * fps, 4, min(768, total))), spread by linspace.
    assert len(frames) == expected
    ref = torch.linspace(0, total - 1, expected).round().long().tolist()
    assert [f.source_index for f in frames] == ref
    assert [f.position for f in frames] == list(range(expected))
    assert [f.timestamp for f in frames] == pytest.approx([i / FPS for i in ref])
    # The pixels really are the frames named by source_index.
    for f in frames[:: max(1, expected // 20)]:
        assert read_counter(f.image) == f.source_index


def test_nframes_sampling_and_resize(videos: dict[str, Path]) -> None:
    video = read_video(videos["1min"], SamplingConfig(nframes=11))
    assert video.frames.shape[0] == 12  # rounded to a multiple of FRAME_FACTOR = 2
    _, _, h, w = video.frames.shape
    assert h % 28 == 0
    assert w % 28 == 0
    assert 128 * 28 * 28 <= h * w <= 768 * 28 * 28
    assert video.frames.dtype == torch.uint8
    assert video.timestamps[0] == 0.0
    assert video.timestamps[-1] == pytest.approx(119 / FPS)


def test_plan_follows_qwen_pixel_bounds(videos: dict[str, Path]) -> None:
    info = probe_video(videos["1min"])
    plan = plan_sampling(info, SamplingConfig(fps=1.0, patch_size=16, max_pixels=200_000))
    assert plan.height % 32 == 0
    assert plan.width % 32 == 0
    assert plan.height * plan.width <= 200_000
    assert plan.sample_fps == pytest.approx(1.0)
    start_end = plan_sampling(info, SamplingConfig(fps=1.0, video_start=10.0, video_end=30.0))
    assert start_end.indices[0] == 20
    assert start_end.indices[-1] == 60


_RSS_SCRIPT = """
import json, os, resource, sys
from tools.video import SamplingConfig, iter_frames

def rss_kib():  # current resident set; ru_maxrss alone is dominated by the import-time peak
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

it = iter_frames(sys.argv[1], SamplingConfig(fps=0.5))
kept = [next(it) for _ in range(4)]  # warm the decoder, the resize and the allocator
if sys.argv[2] != "keep":
    kept.clear()
base, base_max = rss_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
peak, n = base, 4
for frame in it:
    n += 1
    peak = max(peak, rss_kib())
    if sys.argv[2] == "keep":
        kept.append(frame)
print(json.dumps({"growth_kib": peak - base, "peak_kib": peak, "frames": n,
                  "maxrss_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_max}))
"""


def _decode_rss(path: Path, mode: str = "stream") -> dict[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path), mode],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc/self/statm (Linux)")
def test_peak_rss_flat_on_long_video(videos: dict[str, Path]) -> None:
    short, long = _decode_rss(videos["1min"]), _decode_rss(videos["10min"])
    hoard = _decode_rss(videos["10min"], "keep")
    assert (short["frames"], long["frames"], hoard["frames"]) == (30, 300, 300)
    frame_kib = 3 * 280 * 392 // 1024  # one resized frame
    print(f"RSS growth while decoding: 1 min {short}, 10 min {long}, 10 min keeping frames {hoard}")
    # The measurement sees growth when frames are kept (~300 frames' worth) ...
    assert hoard["growth_kib"] > 200 * frame_kib
    # ... and the peak resident set while streaming the 10-minute video stays within 20% of the
    # 1-minute one (the growth itself is a few MiB of allocator noise against ~350 MiB kept).
    assert long["peak_kib"] <= 1.2 * short["peak_kib"], (short, long)
    # streaming keeps no frames: its growth is allocator noise, seen up to 7 MiB (about 22
    # frames' worth) on a busy machine; keeping every frame grows by 300 frames' worth
    assert long["growth_kib"] < 60 * frame_kib, (long, hoard)
    assert long["maxrss_growth_kib"] <= 1.2 * short["maxrss_growth_kib"] + 4 * frame_kib, (short, long)


def test_truncated_files(videos: dict[str, Path], tmp_path: Path) -> None:
    data = videos["1min"].read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])  # index at the front, so it opens
    with pytest.raises(VideoTruncatedError, match="stream ended"):
        list(iter_frames(cut, SamplingConfig(fps=0.5)))
    webm = tmp_path / "v.webm"
    write_video(webm, counter_frames(60, W, H), fps=FPS, codec="libvpx-vp9")
    cut.write_bytes(webm.read_bytes()[:3000])
    with pytest.raises(VideoDecodeError):
        list(iter_frames(cut))
    cut.write_bytes(data[:200])  # cut inside the index
    with pytest.raises(VideoError):
        list(iter_frames(cut))


def test_corrupt_bytes(videos: dict[str, Path], tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    noise = tmp_path / "noise.mp4"
    noise.write_bytes(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    with pytest.raises(NotAVideoError):
        probe_video(noise)
    data = bytearray(videos["1min"].read_bytes())
    mid = len(data) // 3
    data[mid : mid + 4000] = rng.integers(0, 256, 4000, dtype=np.uint8).tobytes()
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(bytes(data))
    try:  # damage mid-stream: either the decoder conceals it or we get a VideoError, nothing else
        frames = list(iter_frames(broken, SamplingConfig(fps=0.5)))
        assert len(frames) == 30
    except VideoError:
        pass


def test_non_video_inputs(tmp_path: Path) -> None:
    text = tmp_path / "notes.mp4"
    text.write_text("not a video at all\n" * 100)
    with pytest.raises(NotAVideoError):
        probe_video(text)
    png = tmp_path / "still.png"
    Image.new("RGB", (64, 48), "red").save(png)
    with pytest.raises(NotAVideoError, match="still image"):
        probe_video(png)
    with pytest.raises(NotAVideoError, match="no such file"):
        probe_video(tmp_path / "missing.mp4")
    wav = tmp_path / "tone.wav"
    with av.open(str(wav), mode="w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        samples = (1000 * np.sin(np.arange(8000) / 10)).astype(np.int16)[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(NoVideoStreamError, match="audio"):
        probe_video(wav)


@pytest.mark.parametrize(
    ("limits", "what"),
    [
        (VideoLimits(max_file_bytes=1000), "bytes"),
        (VideoLimits(max_duration_s=30.0), "duration_s"),
        (VideoLimits(max_total_frames=100), "total_frames"),
        (VideoLimits(max_frame_pixels=100 * 100), "frame_pixels"),
    ],
)
def test_limits_checked_before_decoding(videos: dict[str, Path], limits: VideoLimits, what: str) -> None:
    with pytest.raises(VideoLimitError, match=what):
        probe_video(videos["1min"], limits)
    with pytest.raises(VideoLimitError, match=what):
        next(iter_frames(videos["1min"], limits=limits))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="either fps or nframes"):
        SamplingConfig(fps=1.0, nframes=8)
    with pytest.raises(ValueError, match="nframes"):
        SamplingConfig(nframes=1)
    with pytest.raises(ValueError, match="positive"):
        VideoLimits(max_duration_s=0)
    with pytest.raises(ValueError, match="max_pixels"):
        SamplingConfig(min_pixels=1000, max_pixels=999)
    with pytest.raises(ValueError, match="only apply with fps"):
        SamplingConfig(nframes=8, max_frames=4)


def test_too_short_for_sampling(tmp_path: Path) -> None:
    path = tmp_path / "short.mp4"
    write_video(path, counter_frames(6, W, H), fps=FPS)
    with pytest.raises(VideoError, match="cannot sample"):
        list(iter_frames(path, SamplingConfig(nframes=8)))


def test_write_video_codecs(tmp_path: Path) -> None:
    for name, codec in (("a.mkv", "mpeg4"), ("b.webm", "libvpx-vp9")):
        assert write_video(tmp_path / name, counter_frames(8, W, H), fps=FPS, codec=codec) == 8
        frames = list(iter_frames(tmp_path / name, SamplingConfig(nframes=8)))
        assert [read_counter(f.image) for f in frames] == list(range(8))
    with pytest.raises(ValueError, match="at least one frame"):
        write_video(tmp_path / "empty.mp4", [])


REAL_VIDEOS = sorted(DATA.glob("videos/*.mp4")) + sorted(DATA.glob("videos/*.webm"))


@pytest.mark.skipif(not REAL_VIDEOS, reason=f"real videos not found under {DATA}/videos (set KAMERA_DATA)")
@pytest.mark.parametrize("path", REAL_VIDEOS, ids=lambda p: p.name)
def test_real_videos(path: Path) -> None:
    info = probe_video(path)
    frames = list(iter_frames(path, SamplingConfig(nframes=4, min_pixels=32 * 784, max_pixels=64 * 784)))
    assert len(frames) == 4
    times = [f.timestamp for f in frames]
    assert times == sorted(times)
    assert times[0] < 1.0
    assert times[-1] == pytest.approx(info.duration_s, abs=1.0)
    assert torch.stack([f.image for f in frames]).float().std() > 1.0  # not blank
    assert frames[0].to_pil().mode == "RGB"
