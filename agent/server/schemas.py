"""Request and response bodies: the OpenAI chat-completions subset we serve, and agent sessions.

Strict, as OpenAI's API is: an unknown field, a value of the wrong JSON type (``true`` or ``"3"``
for a number, ``"yes"`` for a boolean), a non-finite number, an unknown content-part type or an
out-of-range value is refused with 400 naming the field. A server started with
``--lenient-fields`` ignores unknown fields instead (:data:`LENIENT_FIELDS`, set per request by the
route, see ``strict.py``); types stay strict either way.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.modes import ReuseMode
from agent.window_ops import Recall, Reorder, Slide

# Whether the request being validated may carry unknown fields (dropped), per app.
LENIENT_FIELDS: ContextVar[bool] = ContextVar("kamera_lenient_fields", default=False)


class RequestModel(BaseModel):
    """A request body (or a part of one): unknown fields and lax coercion refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown(cls, data: Any) -> Any:
        if LENIENT_FIELDS.get() and isinstance(data, dict):
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data


# --- chat completions --------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str = Field(min_length=1)
    detail: str | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(RequestModel):
    url: str = Field(min_length=1)


class VideoPart(RequestModel):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ToolCallFunction(RequestModel):
    name: str = Field(min_length=1)
    arguments: str  # JSON text of an object


class ToolCallIn(RequestModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class FunctionDef(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ToolDef(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestModel):
    name: str = Field(min_length=1)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class JSONSchemaSpec(RequestModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    cache_salt: str | None = Field(default=None, max_length=256)
    # how cached KV may be reused for this request (the server's --reuse-mode by default):
    # "exact" (prefix only, the full prefill's answer bit for bit), "repair", "fast" (blind)
    kamera_reuse: ReuseMode | None = None
    user: str | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("frequency_penalty", "presence_penalty", "logit_bias")
    @classmethod
    def _neutral_only(cls, value: Any) -> Any:
        # Known OpenAI parameters we do not implement: their neutral value passes, any other is refused.
        if value:
            raise ValueError("not supported by this server (only its neutral value: 0, null or {})")
        return value


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CacheReport(BaseModel):
    """Where the prompt's KV came from and what it cost (our extension of the response)."""

    reuse_mode: ReuseMode
    prefix_tokens: int  # reused exactly (the exact prefix, bit for bit)
    relocated_tokens: int  # reused by content at a moved position or after other antecedents
    repaired_tokens: int  # of those, recomputed through every layer by the repair
    prefilled_tokens: int  # recomputed
    rotated_tokens: int
    lost_entries: int
    vision_encoder_calls: int
    shared_tokens: int = 0  # of the reused tokens, those whose KV came from the shared tier (Redis)
    # prefilled again when a close call on repaired KV moved decoding to exact KV (a repair given
    # up: the exact prefill, the same tokens as prefilled_tokens)
    fallback_tokens: int = 0
    # how the answer was served: on exact KV only (prefix), on moved KV (moved), on exact KV after
    # a close call on moved KV (fallback), on exact KV for a repair given up before decoding
    served: Literal["prefix", "moved", "fallback", "given_up"] = "prefix"
    abandoned_tokens: int = 0  # moved KV found, then not answered from (fallback, given up, not tried)
    repair_residual: float = 0.0  # the deviation repair left, which the guard's margin scales with
    repair_depth: float | None = None  # how its recomputed tokens' deviation grew past layer 1 (ditto)
    # the step at which a close call moved decoding to exact KV (None: none), and of the tokens
    # already sent by then (streamed or under a grammar), how many the exact path would not have
    # chosen: the answer's text keeps them, the tokens after them are the exact path's
    escalated_at: int | None = None
    diverged_tokens: int = 0
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


class SessionCreate(RequestModel):
    system_prompt: str = Field(default="You are a helpful assistant.", min_length=1)
    budget_tokens: int = Field(default=4096, ge=16)
    policy: Literal["text", "action"] = "text"
    max_tokens: int = Field(default=64, ge=1)
    cache_salt: str | None = Field(default=None, max_length=256)
    # how the session's steps may rest on reused KV; None: the server's --reuse-mode
    kamera_reuse: ReuseMode | None = None


class TextObs(TextPart):
    """A text observation: chat's text part, not empty."""

    text: str = Field(min_length=1)


class ImageObs(RequestModel):
    """An image observation in the session form (``image_url`` a string, a ``label`` before it)."""

    type: Literal["image"]
    image_url: str = Field(min_length=1)
    label: str = ""


class FramesObs(RequestModel):
    type: Literal["frames"]
    frames: list[str] = Field(min_length=1)
    timestamps: list[float] | None = None


# Chat's content parts (text, image_url, video_url) or the session forms (image, frames).
Observation = Annotated[TextObs | ImagePart | VideoPart | ImageObs | FramesObs, Field(discriminator="type")]


class SlideOp(RequestModel):
    op: Literal["slide"]
    n: int = Field(default=1, ge=0)

    def typed(self) -> Slide:
        return Slide(self.n)


class ReorderOp(RequestModel):
    op: Literal["reorder"]
    order: list[str]

    def typed(self) -> Reorder:
        return Reorder(tuple(self.order))


class RecallOp(RequestModel):
    op: Literal["recall"]
    chunk_id: str = Field(min_length=1)
    at: int | None = Field(default=None, ge=1)

    def typed(self) -> Recall:
        return Recall(self.chunk_id, self.at)


WindowOpIn = Annotated[SlideOp | ReorderOp | RecallOp, Field(discriminator="op")]


class StepRequest(RequestModel):
    observations: list[Observation] = Field(default_factory=list)
    instruction: str = Field(min_length=1)
    operations: list[WindowOpIn] = Field(default_factory=list)
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
