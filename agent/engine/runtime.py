"""The serving runtime: one model, one store, one model thread, the prompt cache and sessions.

Built once (``Runtime.load(config)`` or ``Runtime(adapter, config)``) and handed to
``create_app``; nothing here is global. Jobs run under the scheduler (``scheduler.py``: admission
bounded overall and per tenant, tenants started in turn, the running ones decoded as one batch and
their prefills interleaved pass by pass), one at a time between model steps, so nothing here
needs a lock. Jobs carry a cancel event, checked before they start and between generated tokens.

Not here: HTTP, JSON, metrics (``app.py``, ``metrics.py``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from agent.adapters import batched
from agent.adapters.base import ModelAdapter
from agent.adapters.vision import VisionAdapter
from agent.context import WindowConfig
from agent.engine.answer import answer
from agent.engine.chat import ByteTokenizer, Message, Piece, TextPiece, render
from agent.engine.generation import Decoded, SamplingParams, TextCallback
from agent.engine.limits import ServerLimits
from agent.engine.media import MediaPolicy
from agent.engine.prompt_cache import PromptCache, PromptCacheConfig, PromptUsage, build_prompt
from agent.engine.scheduler import ModelWorker
from agent.engine.sessions import Session, SessionManager
from agent.engine.token_bound import TokenBound
from agent.grammar import GrammarEngine
from agent.loop import Agent, Observation, StepResult
from agent.modes import ReuseMode
from agent.window_ops import WindowOp, apply
from cache.numerics import PREFILL_PRODUCTS
from cache.store import StoreConfig, TieredStore

T = TypeVar("T")


class PromptTooLongError(ValueError):
    """The prompt exceeds ``max_prompt_tokens``."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything ``kamera serve`` configures. ``model``: an embedded name, a checkpoint folder, a
    .gguf file, or ``tiny:<family>`` (random weights, for tests); None is the embedded model.
    ``api_keys``: (key, tenant) pairs; empty means no authentication (one anonymous tenant).
    ``lenient_fields``: unknown request fields are dropped instead of refused; ``public_metrics``:
    ``/metrics`` answers without a key when keys are set."""

    model: str | None = None
    served_name: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    prefill_products: str = "float32"
    limits: ServerLimits = field(default_factory=ServerLimits)
    store: StoreConfig = field(default_factory=lambda: StoreConfig(host_bytes=2 << 30))
    prompt_cache: PromptCacheConfig = field(default_factory=PromptCacheConfig)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    api_keys: tuple[tuple[str, str], ...] = ()
    lenient_fields: bool = False
    public_metrics: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.prefill_products not in PREFILL_PRODUCTS:
            raise ValueError(
                f"prefill products must be one of {', '.join(PREFILL_PRODUCTS)}, "
                f"got {self.prefill_products!r}"
            )
        if self.prefill_products != "float32" and self.dtype != "float32":
            raise ValueError(
                f"{self.prefill_products} prefill products need float32 weights, not {self.dtype}"
            )
        keys = [k for k, _ in self.api_keys]
        if len(set(keys)) != len(keys) or any(not k for k in keys):
            raise ValueError("API keys must be non-empty and distinct")

    @property
    def name(self) -> str:
        """The name clients see: never a filesystem path (a folder or file gives its last part)."""
        if self.served_name:
            return self.served_name
        if self.model is None:
            return "smollm2-135m-instruct"
        return Path(self.model).name if "/" in self.model or os.sep in self.model else self.model


def load_model(config: RuntimeConfig) -> ModelAdapter:
    from agent.adapters.loading import load_adapter

    dtype = getattr(torch, config.dtype)
    return load_adapter(
        config.model,
        dtype=dtype,
        device=config.device,
        tokenizer=ByteTokenizer(),
        prefill_products=config.prefill_products,
    )


class ChatOutcome(NamedTuple):
    decoded: Decoded
    usage: PromptUsage
    ttft_s: float
    total_s: float


class Runtime:
    """What the app serves. Model work goes through :attr:`worker`; the rest is thread-safe."""

    def __init__(
        self, adapter: ModelAdapter, config: RuntimeConfig | None = None, store: TieredStore | None = None
    ) -> None:
        self.adapter = adapter
        self.config = config or RuntimeConfig()
        self.limits = self.config.limits
        self.store = store or TieredStore.from_config(self.config.store)
        self.prompt_cache = PromptCache(adapter, self.store, self.config.prompt_cache)
        self.tenants = dict(self.config.api_keys)
        tenant_sessions, tenant_queue = self.limits.tenant_quotas(len(set(self.tenants.values())))
        self.sessions = SessionManager(self.limits.max_sessions, self.limits.session_idle_s, tenant_sessions)
        self.worker = ModelWorker(
            self.limits.queue_size,
            tenant_queue,
            self.limits.max_batch,
            self.limits.prefill_budget_s,
            self.limits.prefill_pass_tokens,
        )
        self.token_bound = TokenBound.of(adapter.tokenizer)
        self.draining = False
        self.error: str | None = None
        self.started = time.time()
        self._grammar: GrammarEngine | None = None
        self._grammar_lock = threading.Lock()

    @classmethod
    def load(cls, config: RuntimeConfig) -> Runtime:
        return cls(load_model(config), config)

    @property
    def takes_images(self) -> bool:
        return isinstance(self.adapter, VisionAdapter)

    @property
    def grammar(self) -> GrammarEngine:
        """The grammar engine over the model's tokenizer, built on first use (under a second)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarEngine.for_adapter(self.adapter)
            return self._grammar

    # --- health and lifecycle ---------------------------------------------------------------

    def warmup(self) -> None:
        """One token through the model (on the model thread); a failure marks the runtime unhealthy."""
        try:
            cache = self.adapter.empty_cache()
            self.adapter.prefill(self.adapter.text([0]), cache, 0)
        except Exception as exc:
            self.error = f"the model failed its warm-up: {type(exc).__name__}: {exc}"
            raise

    def health(self) -> tuple[bool, str]:
        if self.error is not None:  # the detail (paths included) is in the log, not on /health
            return False, "the model failed its warm-up"
        if self.draining or self.worker.closed:
            return False, "shutting down"
        return True, "ok"

    def drain(self, timeout_s: float) -> bool:
        """Refuse new work, wait up to ``timeout_s`` for admitted jobs, then flush the store to its
        disk tier (so a restart finds what memory held); whether the jobs all finished."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.worker.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        finished = self.worker.pending == 0
        self.worker.shutdown()
        self.store.close()  # what is queued for the shared tier is written before exit
        return finished

    def tenant_salt(self, tenant: str, cache_salt: str | None) -> str:
        """The namespace salt of a tenant's (optionally salted) requests."""
        return tenant if not cache_salt else f"{tenant}\x1f{cache_salt}"

    # --- prompt length, checked before the model thread -------------------------------------

    def check_length(self, texts: Sequence[str], limit: int, what: str = "the prompt") -> None:
        """PromptTooLongError when ``texts`` certainly exceed ``limit`` tokens, from their length
        alone (no tokenizing; nothing when the tokenizer gives no bound)."""
        if self.token_bound is None:
            return
        least = self.token_bound.min_tokens(texts, limit)
        if least > limit:
            raise PromptTooLongError(
                f"{what} has at least {least} tokens (from its length), over the limit of {limit}"
            )

    def chat_body_bytes(self) -> int | None:
        """The most bytes a chat request's JSON body can take and still be a prompt this server
        serves: ``max_prompt_tokens * json_bytes_per_token + prompt_body_allowance``. None when
        there is no such bound: the model takes images (a data URL is any size up to the image
        limits), or the tokenizer gives no bound and the limits name none."""
        if self.takes_images:
            return None
        per_token = self.limits.prompt_json_bytes_per_token
        if not per_token and self.token_bound is not None:
            per_token = self.token_bound.json_bytes_per_token
        if not per_token:
            return None
        return self.limits.max_prompt_tokens * per_token + self.limits.prompt_body_allowance

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> list[Piece]:
        """The prompt's pieces (``tools``: function definitions rendered into it), tokenized by
        the calling thread (not the model's); PromptTooLongError when its text alone exceeds
        ``max_prompt_tokens``."""
        pieces = render(self.adapter.tokenizer, messages, tools)
        n_text = sum(len(p.ids) for p in pieces if isinstance(p, TextPiece))
        if n_text > self.limits.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt has {n_text} text tokens, over max_prompt_tokens={self.limits.max_prompt_tokens}"
            )
        return pieces

    # --- jobs, run on the model thread -------------------------------------------------------

    def chat(
        self,
        pieces: Sequence[Piece],
        params: SamplingParams,
        tenant_salt: str,
        cancel: threading.Event,
        on_start: Callable[[], None] | None = None,
        on_text: TextCallback | None = None,
        mode: ReuseMode | None = None,
        grammar: str | None = None,
    ) -> ChatOutcome:
        """Plan and prefill the prompt (from :meth:`render`), generate (under ``grammar``, Lark,
        when given), then store its new chunks."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            constraint = None if grammar is None else self.grammar.constraint(grammar)
            prompt = build_prompt(self.adapter, pieces, self.prompt_cache.image_unit)
            if prompt.n_tokens > self.limits.max_prompt_tokens:
                raise PromptTooLongError(
                    f"the prompt has {prompt.n_tokens} tokens, over max_prompt_tokens="
                    f"{self.limits.max_prompt_tokens}"
                )
            out = answer(
                self.prompt_cache, prompt, tenant_salt, mode, params, cancel, on_text, constraint, on_start
            )
            decoded = out.decoded
        ttft = (decoded.first_token_at - t0) if decoded.first_token_at else time.perf_counter() - t0
        return ChatOutcome(decoded, out.usage, ttft, time.perf_counter() - t0)

    def new_agent(
        self,
        system_prompt: str,
        budget_tokens: int,
        policy: str,
        max_tokens: int,
        salt: str,
        reuse: str | None = None,
    ) -> Agent:
        """A session's agent; ``reuse``: its window's reuse mode (None: the server's default)."""
        pc = self.prompt_cache.config
        window = WindowConfig(
            budget_tokens=budget_tokens,
            tenant_salt=salt,
            reuse=reuse or pc.mode,
            repair_ratio=pc.repair_ratio,
            repair_max_ratio=max(pc.repair_ratio, pc.repair_max_ratio),
            repair_margin=pc.repair_margin,
            repair_residual_unit=pc.repair_residual_unit,
            repair_margin_cap=pc.repair_margin_cap,
            repair_depth_unit=pc.repair_depth_unit,
            repair_must_pay=pc.repair_must_pay,
        )
        with torch.inference_mode():
            return Agent(
                self.adapter,
                system_prompt,
                window,
                store=self.store,
                policy=policy,
                max_new_tokens=max_tokens,
                grammar=self.grammar if policy == "action" else None,
                close_calls=self.prompt_cache.close_calls,
            )

    def step(
        self,
        session: Session,
        operations: Sequence[WindowOp],
        observations: Sequence[Observation],
        instruction: str,
        max_tokens: int | None,
        cancel: threading.Event | None = None,
    ) -> StepResult:
        """Apply window operations in order, then one agent step; under the session's lock."""
        _acquire(session.lock)
        try:
            with torch.inference_mode():
                cm = session.agent.context
                for op in operations:
                    apply(cm, op)
                result = session.agent.step(observations, instruction, max_tokens, cancel=cancel)
                session.steps += 1
                return result
        finally:
            session.lock.release()


def _acquire(lock: threading.Lock) -> None:
    """Take ``lock``; under the scheduler, by giving others the turn until its holder lets go
    (the holder is a job too, and runs only when others pause)."""
    if batched.current() is None:
        lock.acquire()
        return
    while not lock.acquire(blocking=False):
        batched.pause()
