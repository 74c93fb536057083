"""``kamera bench video-multihop``: single- and multi-hop questions on reused video frames.

On the test split of the synthetic video world (``tools/world/render.py``) every frame and every
``frame k`` label is a chunk, encoded once and reused at other positions under three scenarios
(``slide``, ``recall``, ``reorder``: ``bench/video_multihop_layout.py``). For each episode and
scenario the context (system turn and pieces) is built by each method, then every question of
the episode is asked on it (the question and the assistant header are the only new tokens):

- ``reprefill``: the exact prompt prefilled from scratch, vision encoder included (reference);
- ``blind``: every piece's canonical KV (encoded alone at position 0, labels as well as
  frames) rotated to its place; the pinned prefix (system turn, user header) is exact;
- ``patch-r<m>`` (oracle): canonical + the rank-m conditioning patch fitted for the piece's
  actual antecedents from this prompt's own full prefill (the recall case with the right stored
  patch: an upper bound, not deployable);
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

The deployable methods (``blind``, ``stored-r<m>``, ``cacheblend-<pct>``, ``epic-<k>``, with
``reprefill`` as the reference) are reported apart from the oracles: each method's JSON has
``"oracle": true|false``, the report lists ``deployable`` and ``oracle`` names, and the tables
print them separately. The contexts are built in ``video_multihop_methods.py`` (from the shared
``bench/methods.py``), asked and scored in ``video_multihop_eval.py``.

Not here: orbit patches for reorderings (``cache/orbit.py``), the store's tiers, plots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from agent.adapters.qwen_vl import QwenVLAdapter
from agent.tables import make_console
from agent.tables import print_table as draw
from bench.answers import Codec
from bench.methods import split_oracles
from bench.video_multihop_eval import frame_encoder, run
from bench.video_multihop_layout import (
    PREFIX,
    SCENARIOS,
    TAIL,
    Encoders,
    pairs,
    processor_ids,
    text_encoder,
)
from bench.video_multihop_methods import VideoConfig
from tools.world.render import Episode, WorldConfig, make_split


def print_table(console: Any, title: str, methods: dict[str, dict[str, Any]]) -> None:
    """The deployable methods (re-prefill, the reference, among them), then the oracles apart."""
    deployable, oracles = split_oracles(methods)
    _table(console, f"{title}: deployable methods", {n: methods[n] for n in deployable})
    if oracles:
        note = "oracles (patch fitted in the served prompt's own full prefill: an upper bound)"
        _table(console, f"{title}: {note}", {n: methods[n] for n in oracles})


def _table(console: Any, title: str, methods: dict[str, dict[str, Any]]) -> None:
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
    draw(console, t)


def load_model(name: str | None) -> QwenVLAdapter:
    """``tiny`` (random weights), a checkpoint folder, or by default the world model when present."""
    from tools.world import WORLD_VL_DIR

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
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="draws the reorder scenario's permutations (0: the documented runs'); the episodes are "
        "the world's fixed test split",
    )
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.limit <= 0:
        parser.error("--limit must be positive")

    from rich.progress import Progress

    console = make_console()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = VideoConfig(
        ranks=tuple(int(r) for r in args.ranks.split(",") if r.strip()),
        cacheblend=args.cacheblend,
        epic=args.epic,
        stored=not args.no_stored,
        max_new_tokens=args.max_new_tokens,
        scenarios=SCENARIOS if args.scenario == "all" else (args.scenario,),
        seed=args.seed,
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
        "deployable": split_oracles(result["methods"])[0],
        "oracle": split_oracles(result["methods"])[1],
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
