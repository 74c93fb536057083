"""What one request may ask of the engine and how many requests it takes: ``ServerLimits``.

Every limit is checked before the input it bounds is decoded: counts of messages, images and
videos from the parsed request (before any image is decoded), bytes and pixels of each image
from its header (``tools/media.py``), and a video's bytes, duration and frame size from its
container metadata (``tools/video.py``). The HTTP layer adds the body-size gate that runs before
any of these (``agent/server/limits.py``).

Not here: authentication, the body gate (``agent/server/``), queueing (``scheduler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-server bounds; every field must be positive.

    max_body_bytes: request body; max_messages: chat messages; max_images: images per request
    (``image_url`` parts, or image observations of a step); max_image_bytes / max_image_pixels:
    each image, checked from its header; max_videos: ``video_url`` parts per request;
    max_video_bytes / max_video_seconds: each video, from its metadata; max_frames: sampled
    frames per request, all videos together; video_fps: sampling rate; frame_max_pixels /
    frame_min_pixels: each frame's size after resizing; max_prompt_tokens: a chat prompt after
    the template; max_tokens / default_max_tokens: generated tokens (cap / when not given);
    queue_size: requests admitted beside one (``queue_size + 1`` places: running together up to
    ``max_batch``, which decode as one batch, the rest waiting their turn); prefill_budget_s:
    prefill time the model spends between two decode steps while prompts wait to be prefilled
    (``scheduler.py``: more gives new requests their first token sooner, less keeps running
    streams' tokens coming faster); prefill_pass_tokens: the most prompt tokens one prefill pass
    takes (whole segments: what runs meanwhile waits at most one such pass; fewer, larger passes
    read the weights fewer times);
    max_sessions / session_idle_s: live agent sessions and how long an idle one lives;
    max_session_tokens: a session's window budget; max_observations: per step; drain_s: how
    long shutdown waits for running requests; header_timeout_s: a request's headers must arrive
    within it of the connection opening (or of the previous response); body_timeout_s: its body
    within it of the headers; max_tenant_sessions / max_tenant_queue: one tenant's share of the
    sessions and of the queue, 0 for an equal share (the total over the number of tenants);
    prompt_json_bytes_per_token / prompt_body_allowance: for a model that takes no images, a
    chat body is refused unread past ``max_prompt_tokens * prompt_json_bytes_per_token +
    prompt_body_allowance`` bytes (0 bytes a token: derived from the tokenizer, see
    ``token_bound.py``; the allowance is for what the prompt does not hold: JSON structure,
    names, stop strings, a ``response_format`` schema).
    """

    max_body_bytes: int = 32 << 20
    max_messages: int = 256
    max_images: int = 16
    max_image_bytes: int = 16 << 20
    max_image_pixels: int = 16_000_000
    max_videos: int = 2
    max_video_bytes: int = 64 << 20
    max_video_seconds: float = 600.0
    max_frames: int = 32
    video_fps: float = 1.0
    frame_max_pixels: int = 448 * 448
    frame_min_pixels: int = 56 * 56
    max_prompt_tokens: int = 16384
    max_tokens: int = 1024
    default_max_tokens: int = 256
    queue_size: int = 32
    max_batch: int = 32
    prefill_budget_s: float = 0.25
    prefill_pass_tokens: int = 512
    max_sessions: int = 64
    session_idle_s: float = 900.0
    max_session_tokens: int = 32768
    max_observations: int = 64
    drain_s: float = 30.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_tenant_sessions: int = 0
    max_tenant_queue: int = 0
    prompt_json_bytes_per_token: int = 0
    prompt_body_allowance: int = 1 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in _ZERO_IS_DERIVED and getattr(self, f.name) == 0:
                continue
            if not getattr(self, f.name) > 0:
                raise ValueError(f"limit {f.name} must be positive, got {getattr(self, f.name)!r}")
        if self.max_batch > MAX_BATCH:
            raise ValueError(f"max_batch must be at most {MAX_BATCH}, got {self.max_batch}")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens exceeds max_tokens")
        if self.frame_min_pixels > self.frame_max_pixels:
            raise ValueError("frame_min_pixels exceeds frame_max_pixels")

    def tenant_quotas(self, tenants: int) -> tuple[int, int]:
        """(sessions, queue places, the running job's included) one of ``tenants`` tenants may hold."""
        return (
            _share(self.max_sessions, tenants, self.max_tenant_sessions),
            _share(self.queue_size + 1, tenants, self.max_tenant_queue),
        )


MAX_BATCH = 64  # sequences one batched decode step takes (``agent/adapters/batched.py``)


def _share(total: int, tenants: int, quota: int) -> int:
    return min(total, quota) if quota else max(1, total // max(1, tenants))


# Fields where 0 means "derived": an equal share, or the tokenizer's bound.
_ZERO_IS_DERIVED = frozenset({"max_tenant_sessions", "max_tenant_queue", "prompt_json_bytes_per_token"})


def limit_fields() -> list[tuple[str, type, Any]]:
    """(name, type, default) of every limit, for building CLI options and reading the environment."""
    out = []
    for f in fields(ServerLimits):
        default = f.default
        out.append((f.name, type(default), default))
    return out
