"""``kamera bench video-multihop``: single- and multi-hop questions on reused video frames.

On the test split of the synthetic video world (``demos/world.py``) every frame and every
``frame k`` label is a chunk, encoded once and reused at other positions under three scenarios
(``slide``, ``recall``, ``reorder``: ``bench/video_multihop_layout.py``). For each episode and
scenario the context (system turn and pieces) is built by each method, then every question of
the episode is asked on it (the question and the assistant header are the only new tokens):

- ``reprefill``: the exact prompt prefilled from scratch, vision encoder included (reference);
- ``blind``: every piece's canonical KV (encoded alone at position 0, labels as well as
  frames) rotated to its place; the pinned prefix (system turn, user header) is exact;
- ``patch-r<m>``: canonical + the rank-m conditioning patch fitted for the piece's actual
  antecedents in this prompt (the recall case with the right stored patch);
- ``stored-r<m>``: canonical + the patch fitted where the piece was first encoded (after the
  previous episode, or in the plain order): what a store that never saw this prompt holds;
- ``cacheblend-<pct>``: blind, then the ``pct`` % of piece tokens whose values deviate most at
  layer 1 recomputed through every layer (``agent/recompute.py`` through an M-RoPE view);
- ``epic-<k>``: blind, then the first k tokens of every piece but the first recomputed.

Per method: accuracy on single- and multi-hop questions, agreement of the greedy answer with
re-prefill's (the model's own answer changes, meaningful even on random weights), KL of the
first answer token's distribution from re-prefill's, time to first token (building the context
+ prefilling the question + the first argmax; fitting patches is offline and reported apart)
and vision encoder runs. The reuse methods share one store per scenario, so the encoder runs
once per distinct frame; re-prefill runs it for every frame of every question's prompt.

Not here: orbit patches for reorderings (``cache/orbit.py``), the store's tiers, plots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from agent.adapters.base import ChunkInput, ImageInput, TextInput
from agent.adapters.qwen_vl import QwenVLAdapter
from agent.recompute import DeviationSelection, FixedSelection, first_tokens, selective_recompute
from bench.fidelity import Codec
from bench.video_multihop_layout import (
    PREFIX,
    SCENARIOS,
    TAIL,
    Case,
    Encoders,
    Piece,
    build_case,
    pairs,
    processor_ids,
    text_encoder,
)
from cache.layout import ChunkKV
from cache.patch import PatchConfig, apply_and_place, fit_delta
from cache.rank import rank_strategy
from demos.world import Episode, Question, WorldConfig, episode_seed, make_episode, make_split


@dataclass(frozen=True)
class VideoConfig:
    """What to compare. cacheblend: % of piece tokens recomputed; epic: first-k per piece."""

    ranks: tuple[int, ...] = (8, 16, 32)
    cacheblend: float = 15.0
    epic: int = 1
    stored: bool = True
    max_new_tokens: int = 2
    scenarios: tuple[str, ...] = SCENARIOS

    def __post_init__(self) -> None:
        if not self.ranks or any(r <= 0 for r in self.ranks):
            raise ValueError(f"ranks must be positive, got {self.ranks}")
        if not 0 < self.cacheblend <= 100 or self.epic <= 0:
            raise ValueError("cacheblend lies in (0, 100] and epic k is positive")
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad or not self.scenarios:
            raise ValueError(f"scenarios must be among {SCENARIOS}, got {self.scenarios}")
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")

    def method_names(self) -> list[str]:
        names = ["reprefill", "blind", *[f"patch-r{m}" for m in self.ranks]]
        if self.stored:
            names.append(f"stored-r{max(self.ranks)}")
        return [*names, f"cacheblend-{self.cacheblend:g}", f"epic-{self.epic}"]


# --- contexts ---------------------------------------------------------------------------


class ContextPass(NamedTuple):
    """A full prefill of prefix + pieces: post-RoPE ``k, v [L, H, N, D]``, each piece's
    conditioned KV (pre-RoPE) by name, wall time and vision encoder runs."""

    k: torch.Tensor
    v: torch.Tensor
    conditioned: dict[str, ChunkKV]
    seconds: float
    encoder_calls: int


class Placement(NamedTuple):
    """Where pieces go: ``starts`` in position units (extents), ``token_starts`` in the cache,
    ``positions`` int64 ``[3, N]`` of the whole context, ``end`` the question's start."""

    starts: list[int]
    token_starts: list[int]
    lengths: list[int]
    positions: torch.Tensor
    end: int
    n_prefix: int


def context_pass(adapter: QwenVLAdapter, prefix: TextInput, pieces: Sequence[Piece]) -> ContextPass:
    """Prefill the prefix, then each piece in order on one cache."""
    calls, t0 = adapter.vision_encoder_calls, time.perf_counter()
    out = adapter.prefill(prefix, adapter.empty_cache(), 0)
    pos, conditioned = out.kv.extent, {}
    for piece in pieces:
        kv = adapter.prefill(piece.chunk, out.cache, pos).kv
        conditioned[piece.name] = kv
        pos += kv.extent
    seconds = time.perf_counter() - t0
    layers = [adapter.layer_kv(out.cache, i) for i in range(adapter.info.n_layers)]
    k = torch.stack([lk for lk, _ in layers])
    v = torch.stack([lv for _, lv in layers])
    return ContextPass(k, v, conditioned, seconds, adapter.vision_encoder_calls - calls)


def placement(adapter: QwenVLAdapter, prefix: TextInput, pieces: Sequence[Piece]) -> Placement:
    rel, pos = adapter.chunk_positions(prefix)
    positions, starts, token_starts, lengths = [rel], [], [], []
    tokens = prefix.n_tokens
    for piece in pieces:
        rel, extent = adapter.chunk_positions(piece.chunk)
        starts.append(pos)
        token_starts.append(tokens)
        lengths.append(piece.chunk.n_tokens)
        positions.append(rel + pos)
        pos += extent
        tokens += piece.chunk.n_tokens
    return Placement(starts, token_starts, lengths, torch.cat(positions, dim=1), pos, prefix.n_tokens)


def content_id(chunk: ChunkInput) -> str:
    if isinstance(chunk, ImageInput):
        return chunk.content_key
    return "text:" + ",".join(str(i) for i in chunk.ids.tolist())


class Store:
    """Canonical KV (each chunk encoded alone at 0) by content; the encoder runs once per frame."""

    def __init__(self, adapter: QwenVLAdapter) -> None:
        self.adapter = adapter
        self.canonical: dict[str, ChunkKV] = {}

    def get(self, chunk: ChunkInput) -> ChunkKV:
        key = content_id(chunk)
        if key not in self.canonical:
            self.canonical[key] = self.adapter.encode(chunk)
        return self.canonical[key]

    def embeds(self, chunks: Sequence[ChunkInput]) -> torch.Tensor:
        """Input embeddings ``[N, hidden]``: vision features from the feature cache at image pads."""
        return torch.cat([self.adapter.embed(chunk) for chunk in chunks])


class Built(NamedTuple):
    """A method's context KV (post-RoPE ``[L, H, N, D]``), build time, share of piece tokens
    recomputed, offline patch-fitting time, and patch bytes over the pieces' KV bytes (both at
    float16)."""

    k: torch.Tensor
    v: torch.Tensor
    seconds: float
    recompute: float = 0.0
    fit_seconds: float = 0.0
    bytes_ratio: float = 0.0


def _cat(
    prefix: tuple[torch.Tensor, torch.Tensor], parts: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix's and the placed pieces' ``(k, v)`` side by side along tokens."""
    k = torch.cat([prefix[0], *[p[0] for p in parts]], 2)
    return k, torch.cat([prefix[1], *[p[1] for p in parts]], 2)


def build_methods(
    adapter: QwenVLAdapter,
    store: Store,
    case: Case,
    prefix: TextInput,
    ref: ContextPass,
    origin: dict[str, ChunkKV],
    config: VideoConfig,
) -> dict[str, Built]:
    """Every method's context for the case's target; ``origin``: conditioned KV where first seen."""
    place = placement(adapter, prefix, case.target)
    pk = (ref.k[:, :, : place.n_prefix], ref.v[:, :, : place.n_prefix])
    spec = adapter.spec
    out = {"reprefill": Built(ref.k, ref.v, ref.seconds, recompute=1.0)}  # timed by direct_ttft

    canon = [store.get(p.chunk) for p in case.target]  # the store's, encoded before any question
    t0 = time.perf_counter()
    blind = _cat(pk, [c.place(s, spec) for c, s in zip(canon, place.starts, strict=True)])
    out["blind"] = Built(*blind, time.perf_counter() - t0)

    def patched(conditioned: dict[str, ChunkKV], rank: int) -> Built:
        placed, fit_s, apply_s, nbytes, kv_bytes = [], 0.0, 0.0, 0, 0
        cfg = PatchConfig(rank=rank_strategy("fixed", rank=rank))
        for piece, c, start in zip(case.target, canon, place.starts, strict=True):
            cond = conditioned[piece.name]
            t0 = time.perf_counter()
            patch = fit_delta(cond.k - c.k, cond.v - c.v, cfg).patch
            t1 = time.perf_counter()
            nbytes, kv_bytes = nbytes + patch.nbytes, kv_bytes + 2 * (c.k.numel() + c.v.numel())
            placed.append(apply_and_place(c.k, c.v, patch, c.placed_positions(start), spec))
            fit_s, apply_s = fit_s + t1 - t0, apply_s + time.perf_counter() - t1
        ratio = nbytes / max(1, kv_bytes)
        return Built(*_cat(pk, placed), apply_s, fit_seconds=fit_s, bytes_ratio=ratio)

    for m in config.ranks:
        out[f"patch-r{m}"] = patched(ref.conditioned, m)
    if config.stored:
        out[f"stored-r{max(config.ranks)}"] = patched(origin, max(config.ranks))

    n = int(ref.k.shape[2])
    candidates = torch.arange(place.n_prefix, n)
    selections: dict[str, Any] = {
        f"cacheblend-{config.cacheblend:g}": DeviationSelection(config.cacheblend / 100, candidates),
        f"epic-{config.epic}": FixedSelection(
            first_tokens(place.token_starts[1:], place.lengths[1:], config.epic)
        ),
    }
    for name, selection in selections.items():
        t0 = time.perf_counter()
        embeds = store.embeds([prefix, *[p.chunk for p in case.target]])
        rec = selective_recompute(adapter, embeds, place.positions, *blind, selection)
        seconds = out["blind"].seconds + time.perf_counter() - t0
        out[name] = Built(rec.k, rec.v, seconds, recompute=rec.selected.numel() / max(1, candidates.numel()))
    return out


# --- questions --------------------------------------------------------------------------


class Answer(NamedTuple):
    tokens: list[int]
    text: str
    first_logits: torch.Tensor
    seconds: float


def ask(
    adapter: QwenVLAdapter, codec: Codec, built: Built, tail: TextInput, start: int, max_new: int
) -> Answer:
    """Prefill the question on the method's context and decode greedily; the cache takes the
    context buffers over without writing them."""
    cache = adapter.new_cache([(built.k, built.v)])
    t0 = time.perf_counter()
    logits = adapter.prefill(tail, cache, start).logits[-1]
    int(logits.argmax())
    seconds = time.perf_counter() - t0
    gen = adapter.generate(tail, cache, start, max_new, first_logits=logits)
    return Answer(gen.tokens, codec.decode(gen.tokens).strip(), logits, seconds)


def direct_ttft(adapter: QwenVLAdapter, chunks: Sequence[ChunkInput]) -> float:
    """Seconds to the first token of one plain HF forward over the whole prompt, vision encoder
    included: re-prefill's time to first token (its answers come from the chunked pass, which
    the tests hold equal to this forward)."""
    t0 = time.perf_counter()
    int(adapter.reference_logits(chunks, last_only=True)[-1].argmax())
    return time.perf_counter() - t0


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    lp, lq = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


class Record(NamedTuple):
    scenario: str
    method: str
    kind: str
    template: str
    correct: bool
    agree: bool
    kl_first: float
    ttft_s: float
    recompute: float
    fit_s: float
    bytes_ratio: float


def evaluate_case(
    adapter: QwenVLAdapter,
    reference: QwenVLAdapter,
    store: Store,
    codec: Codec,
    case: Case,
    questions: Sequence[Question],
    config: VideoConfig,
) -> tuple[list[Record], int]:
    """Every method on every question of one episode under one scenario; also the encoder runs
    of one re-prefill of this prompt."""
    prefix = text_encoder(codec)(PREFIX)
    ref = context_pass(reference, prefix, case.target)
    origin: dict[str, ChunkKV] = {}
    for layout in case.origins:
        if any(p.name not in origin for p in layout):
            passed = context_pass(reference, prefix, layout).conditioned
            origin.update({k: v for k, v in passed.items() if k not in origin})
    built = build_methods(adapter, store, case, prefix, ref, origin, config)
    end = placement(adapter, prefix, case.target).end
    records = []
    for q in questions:
        tail = text_encoder(codec)(TAIL.format(question=q.text))
        answers = {
            name: ask(model, codec, b, tail, end, config.max_new_tokens)
            for name, b in built.items()
            for model in [reference if name == "reprefill" else adapter]
        }
        gold = answers["reprefill"]
        prompt = [prefix, *[p.chunk for p in case.target], tail]
        ttft = {name: b.seconds + answers[name].seconds for name, b in built.items()}
        ttft["reprefill"] = direct_ttft(reference, prompt)
        for name, a in answers.items():
            b = built[name]
            records.append(
                Record(
                    case.scenario,
                    name,
                    q.kind,
                    q.template,
                    a.text == q.answer,
                    a.tokens == gold.tokens,
                    _kl(gold.first_logits, a.first_logits),
                    ttft[name],
                    b.recompute,
                    b.fit_seconds,
                    b.bytes_ratio,
                )
            )
    return records, ref.encoder_calls


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def aggregate(records: Sequence[Record], calls: dict[str, int], questions: int) -> dict[str, dict[str, Any]]:
    """Per method: the JSON numbers (see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.method for r in records):
        rs = [r for r in records if r.method == name]
        single, multi = [r for r in rs if r.kind == "single"], [r for r in rs if r.kind == "multi"]
        out[name] = {
            "acc_single": _mean([float(r.correct) for r in single]),
            "acc_multi": _mean([float(r.correct) for r in multi]),
            "agree_single": _mean([float(r.agree) for r in single]),
            "agree_multi": _mean([float(r.agree) for r in multi]),
            "kl_first": _mean([r.kl_first for r in rs]),
            "ttft_ms": 1e3 * (_mean([r.ttft_s for r in rs]) or 0.0),
            "encoder_calls": calls[name],
            "encoder_calls_per_question": calls[name] / max(1, questions),
            "recompute": _mean([r.recompute for r in rs]),
            "fit_ms": 1e3 * (_mean([r.fit_s for r in rs]) or 0.0),
            "patch_bytes_ratio": _mean([r.bytes_ratio for r in rs]),
            "n_single": len(single),
            "n_multi": len(multi),
        }
    return out


def fresh_adapter(adapter: QwenVLAdapter, vision_cache_size: int) -> QwenVLAdapter:
    """Another adapter on the same weights with its own vision feature cache and counter."""
    return adapter.fresh(vision_cache_size)


def frame_encoder(adapter: QwenVLAdapter) -> Callable[[Episode, int], ChunkInput]:
    images: dict[tuple[str, int], ImageInput] = {}

    def encode(episode: Episode, index: int) -> ChunkInput:
        key = (episode.seed, index)
        if key not in images:
            images[key] = adapter.image(episode.frames[index])
        return images[key]

    return encode


def previous_episode(index: int, world: WorldConfig) -> Episode:
    """The other episode of slide and recall: validation episode ``index`` (never a test one)."""
    return make_episode(episode_seed("val", index), world)


def run(
    adapter: QwenVLAdapter,
    episodes: Sequence[Episode],
    config: VideoConfig,
    world: WorldConfig | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """All scenarios on ``episodes``; the report's ``scenarios`` and pooled ``methods``."""
    codec = Codec(adapter.tokenizer)
    enc = Encoders(text_encoder(codec), frame_encoder(adapter))
    reference = fresh_adapter(adapter, vision_cache_size=0)
    scenarios: dict[str, Any] = {}
    all_records: list[Record] = []
    all_calls: dict[str, int] = dict.fromkeys(config.method_names(), 0)
    all_questions = 0
    if episodes:  # warm the kernels up so the first method timed does not pay for it
        context_pass(fresh_adapter(adapter, 0), enc.text(PREFIX), pairs(episodes[0], enc))
    for scenario in config.scenarios:
        reuse = fresh_adapter(adapter, vision_cache_size=4096)
        store = Store(reuse)
        records: list[Record] = []
        prefill_calls, frames = 0, set[str]()
        for i, ep in enumerate(episodes):
            case = build_case(scenario, ep, previous_episode(i, world or WorldConfig()), enc)
            frames |= {content_id(p.chunk) for p in case.target if isinstance(p.chunk, ImageInput)}
            recs, pass_calls = evaluate_case(reuse, reference, store, codec, case, ep.questions, config)
            records += recs
            prefill_calls += pass_calls * len(ep.questions)
            if progress is not None:
                progress()
        questions = sum(len(ep.questions) for ep in episodes)
        calls = dict.fromkeys(config.method_names(), reuse.vision_encoder_calls)
        calls["reprefill"] = prefill_calls
        scenarios[scenario] = {
            "questions": questions,
            "distinct_frames": len(frames),
            "methods": aggregate(records, calls, questions),
        }
        all_records += records
        all_questions += questions
        for name, c in calls.items():
            all_calls[name] += c
    return {"scenarios": scenarios, "methods": aggregate(all_records, all_calls, all_questions)}


# --- output -----------------------------------------------------------------------------


def print_table(console: Any, title: str, methods: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title=title)
    cols = (
        "method",
        "acc single",
        "acc multi",
        "= ref single",
        "= ref multi",
        "KL first",
        "TTFT ms",
        "encoder",
        "recompute %",
    )
    for col in cols:
        t.add_column(col, justify="right")

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for name, m in methods.items():
        t.add_row(
            name,
            f(m["acc_single"], ".3f"),
            f(m["acc_multi"], ".3f"),
            f(m["agree_single"], ".3f"),
            f(m["agree_multi"], ".3f"),
            f(m["kl_first"], ".2e"),
            f(m["ttft_ms"], ".1f"),
            str(m["encoder_calls"]),
            f(100 * m["recompute"], ".0f"),
        )
    console.print(t)


def load_model(name: str | None) -> QwenVLAdapter:
    """``tiny`` (random weights), a checkpoint folder, or by default the world model when present."""
    from agent.models import WORLD_VL_DIR

    if name is None:
        name = str(WORLD_VL_DIR) if (WORLD_VL_DIR / "config.json").is_file() else "tiny"
    from agent.adapters.loading import load_adapter

    adapter = load_adapter(name)
    if not isinstance(adapter, QwenVLAdapter):
        raise ValueError(f"{name!r} is not a Qwen2.5-VL model")
    return adapter


def world_config(adapter: QwenVLAdapter) -> WorldConfig:
    """The world's frame size as the model's image processor keeps it (a checkpoint trained on
    the world pins ``min_pixels = max_pixels = size²``); the default world otherwise."""
    lo, hi = adapter.pixel_bounds()
    if lo == hi:
        side = math.isqrt(int(lo))
        if side * side == lo and side >= 56 and side % 28 == 0:
            return WorldConfig(size=side)
    return WorldConfig()


def layout_check(adapter: QwenVLAdapter, episode: Episode) -> bool | None:
    """Whether the chunked plain prompt has the processor's own token ids (None: no template)."""
    q = episode.questions[0]
    want = processor_ids(adapter, episode, q.text)
    if want is None:
        return None
    codec = Codec(adapter.tokenizer)
    enc = Encoders(text_encoder(codec), frame_encoder(adapter))
    chunks = [
        enc.text(PREFIX),
        *[p.chunk for p in pairs(episode, enc)],
        enc.text(TAIL.format(question=q.text)),
    ]
    got = torch.cat([c.ids for c in chunks])
    return bool(torch.equal(got, want))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kamera bench video-multihop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="checkpoint folder or 'tiny' (default: world model)")
    parser.add_argument("--limit", type=int, default=8, help="test episodes")
    parser.add_argument("--ranks", default="8,16,32")
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    parser.add_argument("--cacheblend", type=float, default=15.0, help="recompute ratio, %% of piece tokens")
    parser.add_argument("--epic", type=int, default=1, help="first tokens of each piece recomputed")
    parser.add_argument("--no-stored", action="store_true", help="leave out stored-r<max rank>")
    parser.add_argument("--max-new-tokens", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.limit <= 0:
        parser.error("--limit must be positive")

    from rich.console import Console
    from rich.progress import Progress

    console = Console() if sys.stdout.isatty() else Console(width=150)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = VideoConfig(
        ranks=tuple(int(r) for r in args.ranks.split(",") if r.strip()),
        cacheblend=args.cacheblend,
        epic=args.epic,
        stored=not args.no_stored,
        max_new_tokens=args.max_new_tokens,
        scenarios=SCENARIOS if args.scenario == "all" else (args.scenario,),
    )
    adapter = load_model(args.model)
    world = world_config(adapter)
    episodes = make_split("test", args.limit, world)
    t0 = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("episodes", total=len(episodes) * len(config.scenarios))
        result = run(adapter, episodes, config, world, lambda: progress.advance(task))
    report: dict[str, Any] = {
        "command": "kamera bench video-multihop " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": adapter.info.name,
        "random_weights": adapter.info.name.startswith("tiny-"),
        "episodes": len(episodes),
        "frame_size": world.size,
        "questions": sum(len(ep.questions) for ep in episodes),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
        "canonical": "alone at position 0 (frames and labels); pinned prefix exact",
        "layout_matches_processor": layout_check(adapter, episodes[0]),
        **result,
        "wall_s": time.perf_counter() - t0,
        "threads": torch.get_num_threads(),
    }
    for scenario, s in result["scenarios"].items():
        print_table(console, f"{scenario}: {s['questions']} questions", s["methods"])
    print_table(console, f"all scenarios, {report['model']}, {len(episodes)} episodes", result["methods"])
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json_path}")
    return 0
