"""Real agent traffic for the reuse benchmark: loaders, context policies and the replay.

A trajectory becomes a session of requests: request k is the full message list the agent sent
for its k-th model call. A context policy rewrites each request the way a context manager
would (sliding window, changing system header, masked old observations, reranked tool output),
and the replay runs every request of a session through a fresh ``Planner`` and an n-gram oracle
to measure how much of each prompt an exact-prefix cache reuses, how much content addressing
reuses, and how much was reusable at all.

Data live in ``../shared/data`` beside the repository (``KAMERA_DATA`` overrides it); the
dev/test halves follow that folder's README. This module never copies the data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from cache.cdc import CDCConfig, gear_values, window_hash
from cache.keys import Namespace, digest_key
from cache.planner import Planner, PlannerConfig

Message = dict[str, Any]
Split = Literal["dev", "test", "all"]
REPO_ROOT = Path(__file__).resolve().parents[1]


# --- data -----------------------------------------------------------------------------------


def data_root() -> Path | None:
    """The shared data folder (``$KAMERA_DATA`` or ``<repo>/../shared/data``), None if absent."""
    root = Path(os.environ.get("KAMERA_DATA") or REPO_ROOT.parent / "shared" / "data")
    return root if root.is_dir() else None


class Session(NamedTuple):
    id: str
    requests: tuple[list[Message], ...]  # each the full message list of one model call


def session_from_trajectory(session_id: str, messages: Sequence[Message]) -> Session:
    """One request per assistant message: the messages before it."""
    return Session(
        session_id, tuple(list(messages[:i]) for i, m in enumerate(messages) if m.get("role") == "assistant")
    )


def _in_split(split: Split, dev: bool) -> bool:
    if split not in ("dev", "test", "all"):
        raise ValueError(f"split must be dev, test or all, got {split!r}")
    return split == "all" or dev == (split == "dev")


def load_tau_bench(path: Path, split: Split = "all") -> list[Session]:
    """tau-bench airline trajectories; dev: ``task_id < 25``."""
    items = json.loads(path.read_text())
    return [
        session_from_trajectory(f"tau-{it['task_id']}-{it['trial']}", it["traj"])
        for it in items
        if _in_split(split, it["task_id"] < 25)
    ]


def _sorted_files(folder: Path, pattern: str, split: Split) -> list[Path]:
    return [p for i, p in enumerate(sorted(folder.glob(pattern))) if _in_split(split, i % 2 == 0)]


def load_swe_agent(folder: Path, split: Split = "all") -> list[Session]:
    """SWE-agent ``.traj`` histories; dev: files at even sorted positions.

    Old-format histories send observations as user messages after the first assistant one;
    those are marked ``observation: True`` so policies can find them.
    """
    out = []
    for p in _sorted_files(folder, "*.traj", split):
        history = [dict(m) for m in json.loads(p.read_text())["history"]]
        seen_assistant = False
        for m in history:
            if m.get("role") == "user" and seen_assistant:
                m["observation"] = True
            seen_assistant = seen_assistant or m.get("role") == "assistant"
        out.append(session_from_trajectory(f"swe-{p.stem}", history))
    return out


def load_mini_swe_agent(folder: Path, split: Split = "all") -> list[Session]:
    """mini-swe-agent runs; dev: files at even sorted positions. The final ``exit`` record is
    not a message sent to the model and is dropped."""
    out = []
    for p in _sorted_files(folder, "*.traj.json", split):
        msgs = [m for m in json.loads(p.read_text())["messages"] if m.get("role") != "exit"]
        out.append(session_from_trajectory(f"mini-{p.name.removesuffix('.traj.json')}", msgs))
    return out


def load_jsonl(path: Path) -> list[Session]:
    """Lines of ``{"id": str, "turns": [[message, ...], ...]}``, each turn a full prompt."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec.get("id"), str) or not isinstance(rec.get("turns"), list):
            raise ValueError(f"{path}:{n}: need an 'id' string and a 'turns' list")
        out.append(Session(rec["id"], tuple(list(t) for t in rec["turns"])))
    return out


def mini_swe_agent_usage(folder: Path, split: Split = "all") -> list[tuple[int, int]]:
    """``(prompt_tokens, cached_tokens)`` the provider reported for each model call of the
    mini-swe-agent runs (DeepSeek's own prefix cache), same files and split as the loader."""
    out = []
    for p in _sorted_files(folder, "*.traj.json", split):
        for m in json.loads(p.read_text())["messages"]:
            usage = (
                ((m.get("extra") or {}).get("response") or {}).get("usage")
                if m.get("role") == "assistant"
                else None
            )
            if usage and usage.get("prompt_tokens"):
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                out.append((int(usage["prompt_tokens"]), int(cached)))
    return out


SOURCES: dict[str, Callable[[Path, Split], list[Session]]] = {
    "tau_bench": lambda root, s: load_tau_bench(root / "agent_traces" / "tau_bench_gpt-4o-airline.json", s),
    "swe_agent": lambda root, s: load_swe_agent(root / "agent_traces" / "swe_agent", s),
    "mini_swe_agent": lambda root, s: load_mini_swe_agent(
        root / "agent_traces" / "mini_swe_agent_deepseek", s
    ),
}


def load_sessions(source: str, split: Split = "dev", root: Path | None = None) -> list[Session]:
    """Sessions of a named source (see ``SOURCES``) or of a ``.jsonl`` path."""
    if source.endswith(".jsonl"):
        return load_jsonl(Path(source))
    root = root or data_root()
    if root is None:
        raise FileNotFoundError("no data folder: set KAMERA_DATA or place it at ../shared/data")
    if source not in SOURCES:
        raise KeyError(f"unknown source {source!r}; known: {sorted(SOURCES)} or a .jsonl path")
    return SOURCES[source](root, split)


# --- context policies -------------------------------------------------------------------------


def is_observation(m: Message) -> bool:
    return m.get("role") == "tool" or m.get("observation") is True or m.get("message_type") == "observation"


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """Index where each turn starts: the first non-system message, then every assistant one.

    A turn is one model call and what came back from it (tool results, the user's reply).
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    return [first, *(i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > first)]


class Policy(Protocol):
    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]: ...


@dataclass(frozen=True)
class Append:
    """The raw conversation."""

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        return list(messages)


@dataclass(frozen=True)
class Window:
    """System messages pinned, then only the last ``n`` turns."""

    n: int

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        starts = turn_starts(messages)
        keep_from = starts[max(0, len(starts) - self.n)] if starts else len(messages)
        pinned = [m for m in messages[: starts[0] if starts else len(messages)] if m.get("role") == "system"]
        return pinned + list(messages[keep_from:])


@dataclass(frozen=True)
class DynamicSystem:
    """A timestamp and step counter at the top of the system prompt, new on every request."""

    start: str = "2024-05-15T15:00:00"
    seconds_per_step: int = 37

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        now = datetime.fromisoformat(self.start) + timedelta(seconds=self.seconds_per_step * step)
        header = f"Current time: {now:%Y-%m-%d %H:%M:%S}. Step {step}.\n\n"
        out = list(messages)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": header + str(out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": header.rstrip()})
        return out


@dataclass(frozen=True)
class MaskObservations:
    """Observations older than the last ``n`` turns replaced by a one-line stub."""

    n: int

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        starts = turn_starts(messages)
        cutoff = starts[max(0, len(starts) - self.n)] if starts else 0
        out = []
        for i, m in enumerate(messages):
            if i < cutoff and is_observation(m):
                lines = str(m.get("content") or "").count("\n") + 1
                m = {**m, "content": f"[output omitted: {lines} lines]"}
            out.append(m)
        return out


@dataclass(frozen=True)
class Rerank:
    """Observations (tool output, retrieved text) shuffled among their slots, seeded per step."""

    seed: int = 0

    def __call__(self, messages: Sequence[Message], step: int) -> list[Message]:
        out = list(messages)
        slots = [i for i, m in enumerate(out) if is_observation(m)]
        order = np.random.default_rng([self.seed, step]).permutation(len(slots))
        moved = [out[slots[j]] for j in order]
        for i, m in zip(slots, moved, strict=True):
            out[i] = m
        return out


POLICIES: dict[str, Callable[..., Policy]] = {
    "append": Append,
    "window": Window,
    "dynamic-system": DynamicSystem,
    "mask-observations": MaskObservations,
    "rerank": Rerank,
}


def get_policy(name: str) -> Policy:
    """A policy by name; a trailing ``-N`` is its integer parameter (``window-6``)."""
    m = re.fullmatch(r"(.+?)-(\d+)", name)
    base, arg = (m.group(1), int(m.group(2))) if m and m.group(1) in POLICIES else (name, None)
    if base not in POLICIES:
        raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES)} (some take -N)")
    return POLICIES[base]() if arg is None else POLICIES[base](arg)


# --- tokenizing -------------------------------------------------------------------------------


class Tokenized(NamedTuple):
    """A rendered request and its structure, as the planner's forced chunk bounds.

    ``boundaries`` holds every message start and, inside each message, the start and end of
    its body and the structural points of its tool calls (:func:`body_cuts`), so the role
    header, the end-of-turn marker and the JSON around a call's arguments are chunks of their
    own: a body the context manager replaces (a masked observation) or a message that arrives
    new leaves the chunks around it intact, and no chunk mixes template text with new text.
    """

    ids: np.ndarray  # [T] int64
    message_starts: tuple[int, ...]  # token offset where each message starts
    boundaries: tuple[int, ...]  # sorted forced chunk bounds: message starts and parts


Tokenizer = Callable[[Sequence[Message]], Tokenized]


TOOL_CALLS_OPEN = "\n<tool_call>"
MESSAGE_END = "<|im_end|>\n"
# The free-form fields of a tool call: their values change from call to call, the JSON around
# them repeats. json.dumps escapes every quote inside a string, so this never matches inside one.
_CALL_FIELD = re.compile(r'"(?:arguments|id)": "((?:[^"\\]|\\.)*)"')


def message_body(m: Message) -> str:
    """The text a message shows the model: its content, then its tool calls as JSON."""
    body = "" if m.get("content") is None else str(m["content"])
    if m.get("tool_calls"):
        body += TOOL_CALLS_OPEN + json.dumps(m["tool_calls"], sort_keys=True, default=str) + "</tool_call>"
    return body


def body_cuts(body: str) -> list[int]:
    """Character offsets in ``(0, len(body))`` where a body's structure changes, sorted: the start
    of its tool-call section and the start and end of each call's ``arguments`` and ``id``."""
    at = body.find(TOOL_CALLS_OPEN)
    if at < 0:
        return []
    cuts = {at, *(x for f in _CALL_FIELD.finditer(body, at) for x in f.span(1))}
    return sorted(c for c in cuts if 0 < c < len(body))


def message_header(m: Message) -> str:
    """ChatML header of one message: the start marker and the role line."""
    return f"<|im_start|>{m.get('role', 'user')}\n"


def message_parts(m: Message) -> list[str]:
    """One message's ChatML text cut at its structure: header, body pieces (see
    :func:`body_cuts`), end marker. Empty pieces are kept out."""
    body = message_body(m)
    cuts = [0, *body_cuts(body), len(body)]
    pieces = [body[a:b] for a, b in pairwise(cuts)]
    return [message_header(m), *(p for p in pieces if p), MESSAGE_END]


def render_message(m: Message) -> str:
    """ChatML-style text of one message, tool calls included."""
    return message_header(m) + message_body(m) + MESSAGE_END


class MessageTokenizer:
    """Tokenizes each part of each message (:func:`message_parts`) on its own (cached), so
    messages and their structural parts start and end on token bounds."""

    def __init__(self, encode: Callable[[str], Sequence[int]]) -> None:
        self.encode = encode
        self._cache: dict[str, np.ndarray] = {}

    def _ids(self, text: str) -> np.ndarray:
        if text not in self._cache:
            self._cache[text] = np.asarray(self.encode(text), dtype=np.int64)
        return self._cache[text]

    def __call__(self, messages: Sequence[Message]) -> Tokenized:
        ids: list[np.ndarray] = []
        starts, bounds, at = [], set(), 0
        for m in messages:
            starts.append(at)
            for part in message_parts(m):
                bounds.add(at)
                ids.append(self._ids(part))
                at += len(ids[-1])
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return Tokenized(flat, tuple(starts), tuple(sorted(bounds)))


_WORD = re.compile(r"\w+|[^\w\s]|\s+")


def word_encode(text: str, vocab: int = 50_000) -> list[int]:
    """Tokenizer-free stand-in: words, punctuation and whitespace runs hashed into ``vocab`` ids."""
    return [_word_id(w, vocab) for w in _WORD.findall(text)]


@lru_cache(maxsize=1 << 18)
def _word_id(word: str, vocab: int) -> int:
    return int.from_bytes(digest_key("word", [word.encode()]).digest[:4], "big") % vocab


# --- replay -----------------------------------------------------------------------------------


class NgramOracle:
    """Which prompt tokens lie in some ``n``-token window seen earlier in the session."""

    def __init__(self, n: int = 16) -> None:
        if n < 1 or n & (n - 1):
            raise ValueError(f"n must be a power of two, got {n}")
        self.n = n
        self._seen = np.zeros(0, dtype=np.uint64)

    def _hashes(self, ids: np.ndarray) -> np.ndarray:
        """64-bit hash of the window ending at each position >= n - 1: [T] -> [T - n + 1]."""
        hi = window_hash(gear_values(ids, 101), self.n, 0x9E3779B1).astype(np.uint64)
        lo = window_hash(gear_values(ids, 202), self.n, 0x01000193).astype(np.uint64)
        return ((hi << np.uint64(32)) | lo)[self.n - 1 :]

    def covered(self, ids: np.ndarray) -> int:
        if len(ids) < self.n or not self._seen.size:
            return 0
        hit_end = np.flatnonzero(np.isin(self._hashes(ids), self._seen, assume_unique=False)) + self.n - 1
        delta = np.bincount(hit_end - self.n + 1, minlength=len(ids) + 1)[: len(ids) + 1]
        delta -= np.bincount(hit_end + 1, minlength=len(ids) + 1)[: len(ids) + 1]
        return int((np.cumsum(delta)[: len(ids)] > 0).sum())

    def add(self, ids: np.ndarray) -> None:
        if len(ids) >= self.n:
            self._seen = np.union1d(self._seen, self._hashes(ids))


class RequestStat(NamedTuple):
    n_tokens: int
    prefix: int  # tokens an exact-prefix cache reuses
    content: int  # tokens reused by prefix or content
    oracle: int  # tokens in a window seen earlier in the session
    plan_ms: float  # chunking + lookup
    stored: int = 0  # tokens of chunks this request added to the content store


class PolicyResult(NamedTuple):
    policy: str
    n_requests: int
    prompt_tokens: int
    prefix_hit_rate: float
    content_hit_rate: float
    oracle_hit_rate: float
    recovered_of_oracle: float  # (content - prefix) / (oracle - prefix); nan when nothing to recover
    p50_plan_ms: float
    store_tokens: int = 0  # tokens of the distinct chunks the content store holds, all sessions


NAMESPACE = Namespace(model="trace-replay", dtype="none")


def replay_session(
    session: Session, policy: Policy, tokenize: Tokenizer, config: PlannerConfig, oracle_n: int = 16
) -> list[RequestStat]:
    """Plan and commit every request of ``session`` in order against session-local caches."""
    planner, oracle = Planner(NAMESPACE, config), NgramOracle(oracle_n)
    stats = []
    for step, request in enumerate(session.requests):
        tok = tokenize(policy(request, step))
        t0 = time.process_time()  # CPU time: the machine may be shared
        plan = planner.plan(tok.ids, tok.boundaries)
        ms = (time.process_time() - t0) * 1e3
        by = plan.tokens_by_status()
        new = {
            c.key: c.n_tokens
            for c in plan.chunks
            if c.status != "relocated-hit" and c.key not in planner.index
        }
        stats.append(
            RequestStat(
                len(tok.ids),
                by["prefix-hit"],
                plan.reused_tokens,
                oracle.covered(tok.ids),
                ms,
                sum(new.values()),
            )
        )
        planner.commit(plan, tok.ids, f"{session.id}/{step}")
        oracle.add(tok.ids)
    return stats


def summarize(policy: str, stats: Iterable[RequestStat]) -> PolicyResult:
    s = list(stats)
    total = sum(r.n_tokens for r in s)
    prefix, content, oracle = (
        sum(getattr(r, f) for r in s) / max(total, 1) for f in ("prefix", "content", "oracle")
    )
    recovered = (content - prefix) / (oracle - prefix) if oracle > prefix else float("nan")
    p50 = float(np.median([r.plan_ms for r in s])) if s else float("nan")
    stored = sum(r.stored for r in s)
    return PolicyResult(policy, len(s), total, prefix, content, oracle, recovered, p50, stored)


def evaluate(
    sessions: Sequence[Session],
    policies: Sequence[str],
    tokenize: Tokenizer,
    config: PlannerConfig | None = None,
) -> list[PolicyResult]:
    """Token-weighted hit rates of every policy over all requests of all sessions."""
    cfg = config or PlannerConfig()
    return [
        summarize(name, [r for s in sessions for r in replay_session(s, get_policy(name), tokenize, cfg)])
        for name in policies
    ]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Prefix vs content reuse on real agent traces")
    ap.add_argument("--source", default="tau_bench", help=f"{sorted(SOURCES)} or a .jsonl path")
    ap.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument(
        "--policies",
        default="append,window-6,dynamic-system,mask-observations-3,rerank",
        help="comma-separated",
    )
    ap.add_argument("--min-size", type=int, default=16)
    ap.add_argument("--avg-size", type=int, default=64)
    ap.add_argument("--max-size", type=int, default=256)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--normalization", type=int, default=1)
    ap.add_argument("--chunker", default="gear")
    args = ap.parse_args(argv)
    sessions = load_sessions(args.source, args.split)[: args.sessions]
    cfg = PlannerConfig(
        args.chunker, CDCConfig(args.min_size, args.avg_size, args.max_size, args.window, args.normalization)
    )
    print(
        f"{'policy':<22}{'req':>5}{'tokens':>10}{'prefix':>8}{'content':>8}{'oracle':>8}{'recov':>7}{'p50ms':>7}"
    )
    for r in evaluate(sessions, args.policies.split(","), MessageTokenizer(word_encode), cfg):
        print(
            f"{r.policy:<22}{r.n_requests:>5}{r.prompt_tokens:>10}{r.prefix_hit_rate:>8.3f}"
            f"{r.content_hit_rate:>8.3f}{r.oracle_hit_rate:>8.3f}{r.recovered_of_oracle:>7.3f}{r.p50_plan_ms:>7.2f}"
        )


if __name__ == "__main__":
    main()
