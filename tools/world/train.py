"""Train the embedded demo model: a small Qwen2.5-VL on the synthetic video world.

Each step renders fresh training episodes (``render.py``), builds a batch (``batches.py``) and
takes one AdamW step on the model of ``model.py``; validation accuracy is plotted as it goes,
and the test split's accuracy is written beside the checkpoint (``world_vl/``).

It does *not* reuse or cache anything across steps: the vision tower is trained end to end on
freshly rendered episodes. Run ``python -m tools.world.train --help`` (or
``kamera train-demo-model``).

Long windows: with ``--context-frames N`` every batch shows its episodes after ``0 .. N`` frames
of the batch's other episodes (drawn per batch), as a video stream's window holds them
(:func:`~tools.world.render.after_frames`), and the test split is scored by prompt length
(``--eval-windows``). ``--init DIR`` starts from a checkpoint instead of random weights:
``world_vl_long/`` is ``world_vl/`` trained on such windows.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from tools.world import WORLD_VL_DIR
from tools.world.batches import train_batch, training_loss
from tools.world.model import (
    CHAT_TEMPLATE,
    MAX_FRAME_LABEL,
    Accuracy,
    ModelSize,
    build_config,
    build_processor,
    evaluate,
)
from tools.world.render import Episode, WorldConfig, after_frames, episode_seed, make_episode


@dataclass(frozen=True)
class TrainConfig:
    """One training run; everything that changes the result is here and seeded."""

    steps: int = 1100
    batch_size: int = 16
    lr: float = 1.5e-3
    warmup: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    n_val: int = 48
    n_test: int = 200
    eval_every: int = 200
    # One thread by default: on a 2-core machine shared with other jobs, two OpenMP threads made a
    # step 5-10x slower than one (spinning at barriers); pass --threads 2 on an idle machine.
    threads: int = 1
    n_captions: int = 2
    # weight of the frame-token objective (:func:`frame_token_targets`); 0 trains on answers only
    aux_weight: float = 0.5
    max_minutes: float = 50.0
    out_dir: str = str(WORLD_VL_DIR)
    log_dir: str = "docs"
    log_name: str = "world_model"  # <log_dir>/<log_name>_metrics.json and _loss.png
    # frames of other episodes shown before each batch's episodes: 0 .. context_frames, per batch
    context_frames: int = 0
    # prompt lengths (frames) the test split is scored at, besides the episodes alone
    eval_windows: tuple[int, ...] = ()
    init: str | None = None  # a checkpoint folder to start from; None: random weights
    model: ModelSize = field(default_factory=ModelSize)
    world: WorldConfig = field(default_factory=WorldConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.threads < 1:
            raise ValueError("steps, batch_size and threads must be >= 1")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if self.aux_weight < 0:
            raise ValueError(f"aux_weight must not be negative, got {self.aux_weight}")
        if self.context_frames < 0:
            raise ValueError(f"context_frames must not be negative, got {self.context_frames}")
        if any(w < self.world.n_frames for w in self.eval_windows):
            raise ValueError(f"eval_windows must each hold an episode ({self.world.n_frames} frames)")
        held = (min(self.batch_size, self.n_val) - 1) * self.world.n_frames
        if self.context_frames and self.context_frames > held:
            raise ValueError(
                f"context_frames {self.context_frames} is more than the other episodes of a batch or "
                f"of the validation set hold ({held} frames)"
            )
        if any(w - self.world.n_frames > (self.n_test - 1) * self.world.n_frames for w in self.eval_windows):
            raise ValueError("an eval window is longer than the test episodes hold")
        longest = max((self.context_frames + self.world.n_frames, *self.eval_windows))
        if longest > MAX_FRAME_LABEL:
            raise ValueError(f"a prompt of {longest} frames: frame labels go up to {MAX_FRAME_LABEL}")


# --------------------------------------------------------------------------- training


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def with_context(episodes: Sequence[Episode], n: int) -> list[Episode]:
    """Each episode after the last ``n`` frames of the others, the ones before it first (wrapping
    round): episode ``i`` follows ``i - 1``, ``i - 2``, ... as in a stream. ``n = 0``: as they are."""
    if n == 0:
        return list(episodes)
    out = []
    for i, ep in enumerate(episodes):
        others = [episodes[(i - j) % len(episodes)] for j in range(len(episodes) - 1, 0, -1)]
        out.append(after_frames(ep, others, n))
    return out


def accuracy_by_window(
    model: Qwen2_5_VLForConditionalGeneration,
    processor: Any,
    episodes: Sequence[Episode],
    windows: Sequence[int],
) -> dict[int, Accuracy]:
    """Accuracy with each of ``episodes`` (of one length) shown after the frames of the episodes
    before it (the first ones after the last), for each prompt length ``w`` in frames."""
    n = len(episodes[0].frames)
    return {w: evaluate(model, processor, with_context(episodes, w - n)) for w in windows}


def _plot(losses: list[float], evals: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    w = 25
    smooth = [
        sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1])
        for i in range(len(losses))
    ]
    ax[0].plot(losses, alpha=0.25, color="tab:blue")
    ax[0].plot(smooth, color="tab:blue")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("answer-token loss")
    ax[0].set_title("training loss")
    steps = [e["step"] for e in evals]
    ax[1].plot(steps, [e["single"] for e in evals], marker="o", label="single-hop")
    ax[1].plot(steps, [e["multi"] for e in evals], marker="o", label="multi-hop")
    ax[1].set_ylim(0, 1.02)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("validation accuracy (greedy)")
    ax[1].legend()
    ax[1].set_title("validation accuracy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _long_flags(cfg: TrainConfig) -> str:
    if not (cfg.context_frames or cfg.init or cfg.eval_windows):
        return ""
    windows = ",".join(str(w) for w in cfg.eval_windows)
    init = f" --init {cfg.init}" if cfg.init else ""
    return (
        f" \\\n        --context-frames {cfg.context_frames} --eval-windows '{windows}'"
        f" --lr {cfg.lr:g} --warmup {cfg.warmup}{init} \\\n"
        f"        --out-dir {cfg.out_dir} --log-name {cfg.log_name}"
    )


def _by_window(result: dict[str, Any]) -> str:
    rows = result.get("test_by_window") or {}
    if not rows:
        return ""
    lines = [
        "",
        "By prompt length (each test episode after the frames of the test episodes before it, its",
        "questions' frame numbers counted within the prompt):",
        "",
        "| frames a prompt holds | single-hop | multi-hop |",
        "|---|---|---|",
    ]
    lines += [f"| {w} | {a['single']:.3f} | {a['multi']:.3f} |" for w, a in rows.items()]
    return "\n".join(lines) + "\n"


def _readme(cfg: TrainConfig, result: dict[str, Any]) -> str:
    stop_note = (
        "The run hit the --max-minutes limit before its last step, so the weights depend on how fast\n"
        "the machine was; rerunning with the same seed and no time limit is deterministic.\n"
        if result["steps_done"] < cfg.steps
        else "Rerunning with the same seed gives the same weights on the same software stack.\n"
    )
    return f"""# {Path(cfg.out_dir).name}: a small Qwen2.5-VL trained on the synthetic video world

Architecture: `Qwen2_5_VLForConditionalGeneration` ({result["parameters"]:,} parameters, float32).
Text: hidden {cfg.model.hidden}, {cfg.model.layers} layers,
{cfg.model.heads} query / {cfg.model.kv_heads} KV heads, head_dim {cfg.model.head_dim},
mrope_section {list(cfg.model.mrope_section)}.
Vision: depth {cfg.model.vision_depth}, hidden {cfg.model.vision_hidden}, patch 14, spatial merge 2,
temporal patch 2.
Frames are {cfg.world.size}x{cfg.world.size} images: {(cfg.world.size // 28) ** 2} vision tokens each.

Trained with

    python -m tools.world.train --steps {cfg.steps} --batch-size {cfg.batch_size} --seed {cfg.seed} \\
        --max-minutes {cfg.max_minutes:g} --threads {cfg.threads}{_long_flags(cfg)}

(seed {cfg.seed}, {cfg.threads} CPU thread(s), {result["train_seconds"] / 60:.1f} minutes,
{result["steps_done"]} of {cfg.steps} steps, {result["train_episodes"]} training episodes).
{stop_note}
Greedy test accuracy, full prefill, plain HF model, {cfg.n_test} test-split episodes:

| kind | accuracy | questions |
|---|---|---|
| single-hop | {result["test"]["single"]:.3f} | {result["test"]["n_single"]} |
| multi-hop | {result["test"]["multi"]:.3f} | {result["test"]["n_multi"]} |

Per template: {json.dumps(result["test"]["per_template"])}
{_by_window(result)}
Load it as any Qwen2.5-VL checkpoint:

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
"""


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train, evaluate on the test split, save the checkpoint folder and the metrics."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    processor = build_processor(cfg.world)
    if cfg.init is None:
        model = Qwen2_5_VLForConditionalGeneration(build_config(cfg.model, processor.tokenizer))
    else:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(cfg.init)
        text = getattr(model.config, "text_config", model.config)
        vision = model.config.vision_config
        if text.vocab_size != len(processor.tokenizer):
            raise ValueError(f"{cfg.init} was trained on another vocabulary than this world's")
        has = (text.hidden_size, text.num_hidden_layers, vision.hidden_size, vision.depth)
        want = (cfg.model.hidden, cfg.model.layers, cfg.model.vision_hidden, cfg.model.vision_depth)
        if has != want:
            raise ValueError(
                f"{cfg.init} has (hidden, layers, vision hidden, vision depth) {has}; "
                f"this run's model size says {want}"
            )
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    val = [make_episode(episode_seed("val", i), cfg.world) for i in range(cfg.n_val)]
    val = with_context(val, cfg.context_frames)  # checked at the longest prompt trained on
    losses: list[float] = []
    aux_losses: list[float] = []
    evals: list[dict[str, Any]] = []
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    next_episode = 0
    t0 = time.time()
    model.train()
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as progress:
        task = progress.add_task("train", total=cfg.steps, info="")
        for step in range(cfg.steps):
            eps = [
                make_episode(episode_seed("train", next_episode + j), cfg.world)
                for j in range(cfg.batch_size)
            ]
            next_episode += cfg.batch_size
            if cfg.context_frames:
                eps = with_context(eps, rng.randint(0, cfg.context_frames))
            batch = train_batch(eps, processor, rng, cfg.n_captions)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            loss, aux = training_loss(model, batch, processor.image_token_id, cfg.aux_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            losses.append(loss.item())
            aux_losses.append(aux.item())
            recent, recent_aux = losses[-20:], aux_losses[-20:]
            info = f"loss {sum(recent) / len(recent):.3f} frames {sum(recent_aux) / len(recent_aux):.3f}"
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                acc = evaluate(model, processor, val)
                evals.append(
                    {"step": step + 1, "single": acc.single, "multi": acc.multi, "time": time.time() - t0}
                )
                progress.console.print(
                    f"step {step + 1}: loss {info[5:]} val single {acc.single:.3f} multi {acc.multi:.3f} "
                    f"{json.dumps(acc.per_template)} ({(time.time() - t0) / 60:.1f} min)"
                )
                _plot(losses, evals, log_dir / f"{cfg.log_name}_loss.png")
            progress.update(task, advance=1, info=info)
            if time.time() - t0 > 60 * cfg.max_minutes:
                progress.console.print(f"stopping at step {step + 1}: the {cfg.max_minutes} minute limit")
                break
    train_seconds = time.time() - t0
    test_episodes = [make_episode(episode_seed("test", i), cfg.world) for i in range(cfg.n_test)]
    # the episodes alone are the window of their own length: scored once
    windows = tuple(dict.fromkeys((cfg.world.n_frames, *cfg.eval_windows)))
    by_window = accuracy_by_window(model, processor, test_episodes, windows)
    test = by_window[cfg.world.n_frames]
    if cfg.world.n_frames not in cfg.eval_windows:
        del by_window[cfg.world.n_frames]
    result = {
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "train_episodes": next_episode,
        "steps_done": len(losses),
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "test": asdict(test),
        "test_by_window": {str(w): asdict(a) for w, a in by_window.items()},
        "val_curve": evals,
        "config": asdict(cfg),
    }
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = [
        processor.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        processor.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)  # preprocessor_config.json, as Qwen releases ship
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE  # older loaders read it only from here
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "README.md").write_text(_readme(cfg, result))
    (log_dir / f"{cfg.log_name}_metrics.json").write_text(
        json.dumps({"losses": losses, **result}, indent=1) + "\n"
    )
    _plot(losses, evals, log_dir / f"{cfg.log_name}_loss.png")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``kamera train-demo-model``: train the embedded vision-language model on the synthetic world."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="kamera train-demo-model", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--n-test", type=int, default=defaults.n_test)
    p.add_argument("--n-val", type=int, default=defaults.n_val)
    p.add_argument("--max-minutes", type=float, default=defaults.max_minutes)
    p.add_argument("--n-captions", type=int, default=defaults.n_captions)
    p.add_argument("--threads", type=int, default=defaults.threads)
    p.add_argument(
        "--aux-weight",
        type=float,
        default=defaults.aux_weight,
        help="weight of the frame-token objective (0: answers only)",
    )
    size = defaults.model
    p.add_argument("--hidden", type=int, default=size.hidden, help="text model width")
    p.add_argument("--layers", type=int, default=size.layers, help="text model layers")
    p.add_argument("--vision-hidden", type=int, default=size.vision_hidden)
    p.add_argument("--vision-depth", type=int, default=size.vision_depth)
    p.add_argument("--vision-heads", type=int, default=size.vision_heads)
    p.add_argument("--warmup", type=int, default=defaults.warmup)
    p.add_argument(
        "--context-frames",
        type=int,
        default=defaults.context_frames,
        help="show each batch's episodes after 0..N frames of other episodes (long windows; 0: alone)",
    )
    p.add_argument(
        "--eval-windows",
        default="",
        help="comma-separated prompt lengths in frames to score the test split at (e.g. 6,16,32,48)",
    )
    p.add_argument("--init", default=None, help="start from this checkpoint folder instead of random weights")
    p.add_argument("--out-dir", default=defaults.out_dir)
    p.add_argument("--log-dir", default=defaults.log_dir)
    p.add_argument("--log-name", default=defaults.log_name, help="stem of the metrics and loss-plot files")
    a = p.parse_args(argv)
    try:
        windows = tuple(int(w) for w in a.eval_windows.split(",") if w.strip())
    except ValueError:
        p.error(f"--eval-windows takes comma-separated frame counts, got {a.eval_windows!r}")
    try:
        cfg = TrainConfig(
            steps=a.steps,
            batch_size=a.batch_size,
            lr=a.lr,
            seed=a.seed,
            eval_every=a.eval_every,
            n_test=a.n_test,
            n_val=a.n_val,
            threads=a.threads,
            n_captions=a.n_captions,
            aux_weight=a.aux_weight,
            max_minutes=a.max_minutes,
            out_dir=a.out_dir,
            log_dir=a.log_dir,
            log_name=a.log_name,
            warmup=a.warmup,
            context_frames=a.context_frames,
            eval_windows=windows,
            init=a.init,
            model=ModelSize(
                hidden=a.hidden,
                layers=a.layers,
                intermediate=3 * a.hidden,
                vision_hidden=a.vision_hidden,
                vision_depth=a.vision_depth,
                vision_heads=a.vision_heads,
                vision_intermediate=2 * a.vision_hidden,
            ),
        )
    except ValueError as e:
        p.error(str(e))
    result = train(cfg)
    print(json.dumps({k: result[k] for k in ("parameters", "train_seconds", "test")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
