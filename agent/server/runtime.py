"""The serving runtime: one model, one store, one model thread, the prompt cache and sessions.

Built once (``Runtime.load(config)`` or ``Runtime(adapter, config)``) and handed to
``create_app``; nothing here is global. The model runs one job at a time on a single worker
thread; a job is admitted only while fewer than ``queue_size`` wait beside the running one
(``QueueFullError`` otherwise, a 429). Jobs carry a cancel event, checked before they start and
between generated tokens.

Not here: HTTP, JSON, metrics (``app.py``, ``metrics.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from agent.adapters.base import ModelAdapter
from agent.context import WindowConfig
from agent.loop import Agent, Observation, StepResult
from agent.server.chat import ByteTokenizer, Message, render
from agent.server.generation import Decoded, SamplingParams, decode
from agent.server.limits import ServerLimits
from agent.server.media import MediaPolicy
from agent.server.prompt_cache import PromptCache, PromptCacheConfig, PromptUsage, build_prompt
from agent.server.sessions import Session, SessionManager
from cache.store import StoreConfig, TieredStore

T = TypeVar("T")
TINY_PREFIX = "tiny:"


class QueueFullError(RuntimeError):
    """The model's queue is full."""


class DrainingError(RuntimeError):
    """The server is shutting down and takes no new work."""


class CancelledJobError(RuntimeError):
    """The client went away before the job started."""


class PromptTooLongError(ValueError):
    """The prompt exceeds ``max_prompt_tokens``."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything ``kamera serve`` configures. ``model``: an embedded name, a checkpoint folder, a
    .gguf file, or ``tiny:<family>`` (random weights, for tests); None is the embedded model.
    ``api_keys``: (key, tenant) pairs; empty means no authentication (one anonymous tenant)."""

    model: str | None = None
    served_name: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    limits: ServerLimits = field(default_factory=ServerLimits)
    store: StoreConfig = field(default_factory=lambda: StoreConfig(host_bytes=2 << 30))
    prompt_cache: PromptCacheConfig = field(default_factory=PromptCacheConfig)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    api_keys: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        keys = [k for k, _ in self.api_keys]
        if len(set(keys)) != len(keys) or any(not k for k in keys):
            raise ValueError("API keys must be non-empty and distinct")

    @property
    def name(self) -> str:
        return self.served_name or self.model or "smollm2-135m-instruct"


def load_model(config: RuntimeConfig) -> ModelAdapter:
    dtype = getattr(torch, config.dtype)
    if config.model is not None and config.model.startswith(TINY_PREFIX):
        from agent.adapters.tiny import tiny_adapter

        adapter = tiny_adapter(config.model.removeprefix(TINY_PREFIX), dtype=dtype)
        adapter.tokenizer = ByteTokenizer()
        return adapter
    from agent.adapters.loading import load_adapter

    return load_adapter(config.model, dtype=dtype, device=config.device)


class ChatOutcome(NamedTuple):
    decoded: Decoded
    usage: PromptUsage
    ttft_s: float
    total_s: float


class ModelWorker:
    """One thread for the model; admission bounded by ``capacity`` waiting jobs."""

    def __init__(self, queue_size: int) -> None:
        self.capacity = queue_size + 1  # the running job and those waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kamera-model")
        self._lock = threading.Lock()
        self.pending = 0
        self.closed = False

    def admit(self) -> None:
        """Take a place in the queue; QueueFullError when there is none. Pair with :meth:`leave`."""
        with self._lock:
            if self.closed:
                raise DrainingError("the server is shutting down")
            if self.pending >= self.capacity:
                raise QueueFullError(f"the model queue is full ({self.capacity - 1} waiting); retry shortly")
            self.pending += 1

    def leave(self) -> None:
        with self._lock:
            self.pending -= 1

    async def run(self, fn: Callable[[], T], cancel: threading.Event) -> T:
        """Run ``fn`` on the model thread (after an :meth:`admit`); skipped if cancelled first."""

        def job() -> T:
            if cancel.is_set():
                raise CancelledJobError("the client went away before the job started")
            return fn()

        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def shutdown(self) -> None:
        with self._lock:
            self.closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)


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
        self.sessions = SessionManager(self.limits.max_sessions, self.limits.session_idle_s)
        self.worker = ModelWorker(self.limits.queue_size)
        self.tenants = dict(self.config.api_keys)
        self.draining = False
        self.error: str | None = None
        self.started = time.time()

    @classmethod
    def load(cls, config: RuntimeConfig) -> Runtime:
        return cls(load_model(config), config)

    @property
    def takes_images(self) -> bool:
        return hasattr(self.adapter, "image")

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
        if self.error is not None:
            return False, self.error
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

    # --- jobs, run on the model thread -------------------------------------------------------

    def chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        tenant_salt: str,
        cancel: threading.Event,
        on_start: Callable[[], None] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> ChatOutcome:
        """Render, plan and prefill the prompt, generate, then store its new chunks."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            pieces = render(self.adapter.tokenizer, messages)
            prompt = build_prompt(self.adapter, pieces, self.prompt_cache.image_unit)
            if prompt.n_tokens > self.limits.max_prompt_tokens:
                raise PromptTooLongError(
                    f"the prompt has {prompt.n_tokens} tokens, over max_prompt_tokens="
                    f"{self.limits.max_prompt_tokens}"
                )
            prepared = self.prompt_cache.prepare(prompt, tenant_salt)
            if on_start is not None:
                on_start()
            try:
                decoded = decode(
                    self.adapter, prepared.logits, prepared.cache, prepared.position, params, cancel, on_text
                )
            finally:
                prepared.cache = None  # the request's own cache is not kept
                self.prompt_cache.commit(prepared)
        ttft = (decoded.first_token_at - t0) if decoded.first_token_at else time.perf_counter() - t0
        return ChatOutcome(decoded, prepared.usage, ttft, time.perf_counter() - t0)

    def new_agent(
        self, system_prompt: str, budget_tokens: int, policy: str, max_tokens: int, salt: str
    ) -> Agent:
        with torch.inference_mode():
            return Agent(
                self.adapter,
                system_prompt,
                WindowConfig(budget_tokens=budget_tokens, tenant_salt=salt),
                store=self.store,
                policy=policy,
                max_new_tokens=max_tokens,
            )

    def step(
        self,
        session: Session,
        operations: Sequence[tuple[str, Any]],
        observations: Sequence[Observation],
        instruction: str,
        max_tokens: int | None,
    ) -> StepResult:
        """Apply window operations in order, then one agent step; under the session's lock."""
        with session.lock, torch.inference_mode():
            cm = session.agent.context
            for op, arg in operations:
                if op == "slide":
                    cm.slide(int(arg))
                elif op == "reorder":
                    cm.reorder(list(arg))
                elif op == "recall":
                    chunk_id, at = arg
                    cm.recall(chunk_id, at)
            result = session.agent.step(observations, instruction, max_tokens)
            session.steps += 1
            return result
