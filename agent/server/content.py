"""OpenAI content parts, one implementation for chat messages and session observations.

A part is ``{"type": "text", "text"}``, ``{"type": "image_url", "image_url": {"url"}}`` or
``{"type": "video_url", "video_url": {"url"}}`` (``schemas.py`` validates them, the same classes
for both routes). ``check_media`` bounds their counts before anything is decoded (413 over a
limit, 400 when the model takes no images); ``load_part`` decodes one part under the server's
limits (on the thread pool): text stays text, an image becomes a PIL image, a video its sampled
frames with their timestamps. So an image sent to a session and the same image sent to chat
decode to the same pixels, hence the same content key and the same vision features.

Not here: what a route builds from the decoded parts (chat messages in ``routes/chat.py``,
observations in ``routes/sessions.py``), how an image is fetched or probed (``media.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from PIL import Image

from agent.engine.media import VideoClip, load_image_url, load_video_url
from agent.server import schemas as S
from agent.server.errors import ApiError
from agent.server.state import ServerState

Part = S.TextPart | S.ImagePart | S.VideoPart


class MediaCount(NamedTuple):
    images: int
    videos: int


def count_media(parts: Iterable[object]) -> MediaCount:
    """Images and videos among ``parts`` (anything else is not counted)."""
    images = videos = 0
    for p in parts:
        images += isinstance(p, S.ImagePart)
        videos += isinstance(p, S.VideoPart)
    return MediaCount(images, videos)


def check_media(state: ServerState, count: MediaCount, param: str, frames: int = 0) -> None:
    """413 when the request holds more images, videos or (given) frames than the limits allow;
    400 when it holds any and the model takes none. ``param`` names the field in the error."""
    limits = state.limits
    for n, cap, what in (
        (count.images, limits.max_images, "images"),
        (count.videos, limits.max_videos, "videos"),
        (frames, limits.max_frames, "frames"),
    ):
        if n > cap:
            raise ApiError(413, f"{n} {what} exceed max_{what}={cap}", f"too_many_{what}", param=param)
    if (count.images or count.videos or frames) and not state.runtime.takes_images:
        raise state.no_images(param)


def load_part(state: ServerState, part: Part, frames_left: int) -> str | Image.Image | VideoClip:
    """``part`` decoded: its text, its image, or its video's frames (at most ``frames_left``).
    BadMediaError / MediaLimitError for media that is malformed, not allowed, or too large."""
    runtime = state.runtime
    if isinstance(part, S.TextPart):
        return part.text
    if isinstance(part, S.ImagePart):
        return load_image_url(part.image_url.url, runtime.config.media, state.limits)
    return load_video_url(part.video_url.url, runtime.config.media, state.limits, frames_left)
