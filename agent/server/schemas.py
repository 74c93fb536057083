"""Request and response bodies: the OpenAI chat-completions subset we serve, and agent sessions.

Unknown fields of a request are ignored (clients send more than we use); wrong types, unknown
content-part types and out-of-range values are refused with 400 and the field's location.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# --- chat completions --------------------------------------------------------------------


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Loose):
    type: Literal["text"]
    text: str


class ImageURL(_Loose):
    url: str = Field(min_length=1)
    detail: str | None = None


class ImagePart(_Loose):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Loose):
    url: str = Field(min_length=1)


class VideoPart(_Loose):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Loose):
    include_usage: bool = False


class ChatCompletionRequest(_Loose):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    cache_salt: str | None = Field(default=None, max_length=256)
    user: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CacheReport(BaseModel):
    """Where the prompt's KV came from and what it cost (our extension of the response)."""

    prefix_tokens: int
    relocated_tokens: int
    prefilled_tokens: int
    rotated_tokens: int
    lost_entries: int
    vision_encoder_calls: int
    shared_tokens: int = 0  # of the reused tokens, those whose KV came from the shared tier (Redis)
    queue_ms: float
    ttft_ms: float
    total_ms: float


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    kamera: CacheReport


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kamera"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --- agent sessions ---------------------------------------------------------------------


class SessionCreate(_Loose):
    system_prompt: str = Field(default="You are a helpful assistant.", min_length=1)
    budget_tokens: int = Field(default=4096, ge=16)
    policy: Literal["text", "action"] = "text"
    max_tokens: int = Field(default=64, ge=1)
    cache_salt: str | None = Field(default=None, max_length=256)


class TextObs(_Loose):
    type: Literal["text"]
    text: str = Field(min_length=1)


class ImageObs(_Loose):
    type: Literal["image"]
    image_url: str = Field(min_length=1)
    label: str = ""


class FramesObs(_Loose):
    type: Literal["frames"]
    frames: list[str] = Field(min_length=1)
    timestamps: list[float] | None = None


Observation = Annotated[TextObs | ImageObs | FramesObs, Field(discriminator="type")]


class SlideOp(_Loose):
    op: Literal["slide"]
    n: int = Field(default=1, ge=0)


class ReorderOp(_Loose):
    op: Literal["reorder"]
    order: list[str]


class RecallOp(_Loose):
    op: Literal["recall"]
    chunk_id: str = Field(min_length=1)
    at: int | None = Field(default=None, ge=1)


WindowOp = Annotated[SlideOp | ReorderOp | RecallOp, Field(discriminator="op")]


class StepRequest(_Loose):
    observations: list[Observation] = Field(default_factory=list)
    instruction: str = Field(min_length=1)
    operations: list[WindowOp] = Field(default_factory=list)
    max_tokens: int | None = Field(default=None, ge=1)


class ChunkOut(BaseModel):
    chunk_id: str
    kind: str
    n_tokens: int
    extent: int
    start: int
    source: str
    meta: dict[str, Any]


class WindowOut(BaseModel):
    id: str
    created: float
    steps: int
    budget_tokens: int
    tokens: int
    chunks: list[ChunkOut]
    evicted: list[str]
    counters: dict[str, float]


class StepReportOut(BaseModel):
    ttft_ms: float
    total_ms: float
    finalize_ms: float
    tokens_prefilled: int
    tokens_reused: int
    tokens_rotated: int
    patches_applied: int
    vision_encoder_calls: int
    window_tokens: int
    evicted: list[str]


class StepResponse(BaseModel):
    output: str
    parsed: Any
    chunk_ids: list[str]
    report: StepReportOut
    queue_ms: float
