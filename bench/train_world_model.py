"""Train the embedded demo model: a small Qwen2.5-VL on the synthetic video world.

The model is the real ``transformers.Qwen2_5_VLForConditionalGeneration`` with a few million
parameters, a word-level tokenizer with Qwen's chat and vision special tokens, and the real
``Qwen2VLImageProcessor``. Each video frame is fed as its own *image* (not as a video), so every
frame is one vision chunk of ``(size / 28) ** 2`` tokens, laid out as::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\nframe 1<|vision_start|><|image_pad|>x16<|vision_end|>frame 2<|vision_start|>...
    <question><|im_end|>\\n<|im_start|>assistant\\n<answer><|im_end|>

Training sequences hold one episode with all its questions as successive chat turns; the loss
covers only answer tokens (and the ``<|im_end|>`` closing each answer). Evaluation asks each
test question on its own turn after the frames and decodes greedily with ``generate`` on the
plain model (full prefill, no cache reuse).

It does *not* reuse or cache anything across steps: the vision tower is trained end to end on
freshly rendered episodes. Run ``python -m bench.train_world_model --help``.
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

import numpy as np
import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from agent.models import WORLD_VL_DIR
from demos.world import ANSWER_WORDS, SLOTS, Episode, Question, WorldConfig, episode_seed, make_episode

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
UNK = "[UNK]"
SYSTEM_PROMPT = "You are a helpful assistant."
MAX_FRAME_LABEL = 99

# Qwen2-VL / Qwen2.5-VL chat template (images as <|vision_start|><|image_pad|><|vision_end|>).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Dimensions of the small Qwen2.5-VL; ``sum(mrope_section)`` must be ``head_dim / 2``."""

    hidden: int = 128
    layers: int = 5
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    vision_hidden: int = 96
    vision_depth: int = 2
    vision_heads: int = 3
    vision_intermediate: int = 192

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must divide by heads and heads by kv_heads")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        if self.vision_hidden % self.vision_heads:
            raise ValueError("vision_hidden must divide by vision_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


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
    model: ModelSize = field(default_factory=ModelSize)
    world: WorldConfig = field(default_factory=WorldConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.threads < 1:
            raise ValueError("steps, batch_size and threads must be >= 1")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if self.aux_weight < 0:
            raise ValueError(f"aux_weight must not be negative, got {self.aux_weight}")


# --------------------------------------------------------------------------- tokenizer, processor, model


def vocabulary(cfg: WorldConfig) -> list[str]:
    """All words the world's prompts and answers use (specials excluded), in a fixed order."""
    words: set[str] = set(ANSWER_WORDS) | {"frame", *SYSTEM_PROMPT.replace(".", " .").split()}
    words |= {str(i) for i in range(MAX_FRAME_LABEL + 1)}
    for i in range(400):  # every template and word shows up well within this many episodes
        for q in make_episode(episode_seed("train", i), cfg).questions:
            words.update(q.text.split())
    words |= {"user", "assistant", "system", "describe", ","}
    return sorted(words)


def build_tokenizer(cfg: WorldConfig) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: Qwen specials first (ids 0..6), then ``[UNK]``, then the words."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, UNK, *vocabulary(cfg)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[?.,:]"), behavior="isolated")]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_processor(cfg: WorldConfig) -> Qwen2_5_VLProcessor:
    """The real Qwen2.5-VL processor, sized so a ``cfg.size`` square frame is kept as is."""
    pixels = cfg.size * cfg.size
    image_processor = Qwen2VLImageProcessor(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(cfg),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(size: ModelSize, tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config whose special token ids match ``tokenizer``."""
    ids: dict[str, int] = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}  # type: ignore[arg-type]
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": list(size.mrope_section),
        },
        "tie_word_embeddings": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden,
        "intermediate_size": size.vision_intermediate,
        "num_heads": size.vision_heads,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": size.hidden,
        "fullatt_block_indexes": [size.vision_depth - 1],
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


# --------------------------------------------------------------------------- prompts and batches


def frame_content(episode: Episode) -> list[dict[str, str]]:
    """User-message content for the frames: ``frame k`` text followed by the frame as an image."""
    content: list[dict[str, str]] = []
    for k in range(1, len(episode.frames) + 1):
        content += [{"type": "text", "text": f"frame {k}"}, {"type": "image"}]
    return content


def chat(episode: Episode, questions: Sequence[Question], with_answers: bool) -> list[dict[str, Any]]:
    """Messages asking ``questions`` in turn; the first user turn carries the frames."""
    messages: list[dict[str, Any]] = []
    for i, q in enumerate(questions):
        content = (frame_content(episode) if i == 0 else []) + [{"type": "text", "text": q.text}]
        messages.append({"role": "user", "content": content})
        if with_answers:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": q.answer}]})
    return messages


def answer_labels(input_ids: torch.Tensor, tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """-100 everywhere except assistant turns' content and their closing ``<|im_end|>``."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assistant = tokenizer.convert_tokens_to_ids("assistant")
    labels = torch.full_like(input_ids, -100)
    for b in range(input_ids.shape[0]):
        ids = input_ids[b].tolist()
        inside = False
        for t in range(1, len(ids)):
            if ids[t - 1] == assistant and t >= 2 and ids[t - 2] == start:
                inside = True
            if inside:
                labels[b, t] = ids[t]
                if ids[t] == end:
                    inside = False
    return labels


def pixel_values(frames: Sequence[Image.Image], processor: Qwen2_5_VLProcessor) -> torch.Tensor:
    """What ``processor.image_processor`` gives for frames already at the processor's size.

    A vectorised copy of its rescale, CLIP normalisation and patchify (each frame repeated over the
    temporal patch), used to prepare training batches fast; ``tests/test_world.py`` checks it
    against the real processor. Returns ``[n_frames * grid_h * grid_w, 3 * t * p * p]``.
    """
    ip = processor.image_processor
    p, m, t = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    x = torch.from_numpy(np.stack([np.asarray(f.convert("RGB")) for f in frames])).float()
    n, h, w, c = x.shape  # x: [N, H, W, C] uint8 values
    mean = torch.tensor(ip.image_mean).view(1, 1, 1, c)
    std = torch.tensor(ip.image_std).view(1, 1, 1, c)
    x = ((x * ip.rescale_factor - mean) / std).permute(0, 3, 1, 2)  # [N, C, H, W]
    gh, gw = h // p, w // p
    x = x.reshape(n, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    return x.reshape(n * gh * gw, c * t * p * p).contiguous()


def caption_questions(episode: Episode, rng: random.Random, n: int) -> list[Question]:
    """Training-only turns ``describe frame k ?`` answered with every object of that frame.

    The answer lists, in slot order, ``slot colour shape digit`` per object (``,`` between
    objects). These dense targets teach the vision tower what is where far sooner than the sparse
    one-word answers; they are never evaluated.
    """
    out = []
    for k in rng.sample(range(1, len(episode.frames) + 1), min(n, len(episode.frames))):
        objs = sorted(episode.states[k - 1], key=lambda o: SLOTS.index(o.slot))
        answer = " , ".join(f"{o.slot} {o.colour} {o.shape} {o.digit}" for o in objs)
        out.append(Question(f"describe frame {k} ?", answer, "single", (k,), "describe"))
    return out


def train_batch(
    episodes: Sequence[Episode], processor: Qwen2_5_VLProcessor, rng: random.Random, n_captions: int = 0
) -> dict[str, torch.Tensor]:
    """Model inputs for a batch of episodes, each with all its questions as shuffled turns.

    ``n_captions`` caption turns (:func:`caption_questions`) follow the questions, never precede
    them, so no answer can be copied from a caption. Same tensors as
    ``processor(text=..., images=...)`` with right padding (checked in the tests), plus ``labels``
    on the answer tokens only.
    """
    tok = processor.tokenizer
    ip = processor.image_processor
    frames = [f for ep in episodes for f in ep.frames]
    h, w = frames[0].height // ip.patch_size, frames[0].width // ip.patch_size
    pads = processor.image_token * (h * w // ip.merge_size**2)
    texts = []
    for ep in episodes:
        qs = list(ep.questions)
        rng.shuffle(qs)
        qs += caption_questions(ep, rng, n_captions)
        text = processor.apply_chat_template(chat(ep, qs, with_answers=True), tokenize=False)
        texts.append(text.replace(processor.image_token, pads))
    tok.padding_side = "right"
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = answer_labels(enc["input_ids"], tok)
    labels[enc["attention_mask"] == 0] = -100
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "mm_token_type_ids": (enc["input_ids"] == processor.image_token_id).long(),
        "pixel_values": pixel_values(frames, processor),
        "image_grid_thw": torch.tensor([[1, h, w]] * len(frames)),
        "labels": labels,
        "frame_targets": frame_token_targets(episodes, tok),
    }


def frame_token_targets(episodes: Sequence[Episode], tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """Soft word targets for every image token of ``episodes``, in the batch's image-token order.

    Each merged vision token covers one slot of one frame; its target spreads equal mass over the
    words that describe what it shows: the slot, the frame's number and, when an object sits
    there, its colour, shape and digit. Read off the model's logits at the image positions (the
    tied LM head), this dense objective makes the language model carry what each frame token shows
    and which frame it belongs to in a form its answers can copy from; without it the answers
    alone left the model on the answer prior (docs/world_model.md). Returns ``[n_tokens, vocab]``.
    """
    rows: list[list[str]] = []
    for ep in episodes:
        for f, state in enumerate(ep.states, start=1):
            at = {o.slot: o for o in state}
            for slot in SLOTS:
                words = [slot, str(f)]
                if slot in at:
                    words += [at[slot].colour, at[slot].shape, at[slot].digit]
                rows.append(words)
    target = torch.zeros(len(rows), len(tokenizer))
    for r, words in enumerate(rows):
        ids = tokenizer.convert_tokens_to_ids(words)
        for i in ids if isinstance(ids, list) else [ids]:  # a digit may be the frame's number too
            target[r, i] += 1.0 / len(words)
    return target


def training_loss(
    model: Qwen2_5_VLForConditionalGeneration,
    batch: dict[str, torch.Tensor],
    image_token_id: int,
    aux_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer-token loss plus ``aux_weight`` times the frame-token loss; returns both parts."""
    inputs = {k: v for k, v in batch.items() if k != "frame_targets"}
    out = model(**inputs)
    if not aux_weight or "frame_targets" not in batch:
        return out.loss, torch.zeros(())
    logp = out.logits[batch["input_ids"] == image_token_id].log_softmax(-1)
    aux = -(batch["frame_targets"] * logp).sum(-1).mean()
    return out.loss + aux_weight * aux, aux.detach()


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Accuracy:
    """Greedy answer accuracy per question kind and per template."""

    single: float
    multi: float
    n_single: int
    n_multi: int
    per_template: dict[str, float]


@torch.no_grad()
def evaluate(
    model: Qwen2_5_VLForConditionalGeneration,
    processor: Qwen2_5_VLProcessor,
    episodes: Sequence[Episode],
    episodes_per_batch: int = 4,
) -> Accuracy:
    """Ask every question on its own (frames then question), decode greedily, compare the word."""
    model.eval()
    processor.tokenizer.padding_side = "left"
    hits: dict[str, list[bool]] = {}
    kinds: dict[str, list[bool]] = {"single": [], "multi": []}
    for i in range(0, len(episodes), episodes_per_batch):
        texts, images, questions = [], [], []
        for ep in episodes[i : i + episodes_per_batch]:
            for q in ep.questions:
                texts.append(
                    processor.apply_chat_template(
                        chat(ep, [q], with_answers=False), tokenize=False, add_generation_prompt=True
                    )
                )
                images += ep.frames
                questions.append(q)
        batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
        answers = processor.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for q, a in zip(questions, answers, strict=True):
            ok = a.strip() == q.answer
            hits.setdefault(q.template, []).append(ok)
            kinds[q.kind].append(ok)
    model.train()

    def mean(xs: list[bool]) -> float:
        return sum(xs) / max(1, len(xs))

    return Accuracy(
        single=mean(kinds["single"]),
        multi=mean(kinds["multi"]),
        n_single=len(kinds["single"]),
        n_multi=len(kinds["multi"]),
        per_template={k: round(mean(v), 4) for k, v in sorted(hits.items())},
    )


# --------------------------------------------------------------------------- training


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


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


def _readme(cfg: TrainConfig, result: dict[str, Any]) -> str:
    stop_note = (
        "The run hit the --max-minutes limit before its last step, so the weights depend on how fast\n"
        "the machine was; rerunning with the same seed and no time limit is deterministic.\n"
        if result["steps_done"] < cfg.steps
        else "Rerunning with the same seed gives the same weights on the same software stack.\n"
    )
    return f"""# world_vl: a small Qwen2.5-VL trained on the synthetic video world

Architecture: `Qwen2_5_VLForConditionalGeneration` ({result["parameters"]:,} parameters, float32).
Text: hidden {cfg.model.hidden}, {cfg.model.layers} layers,
{cfg.model.heads} query / {cfg.model.kv_heads} KV heads, head_dim {cfg.model.head_dim},
mrope_section {list(cfg.model.mrope_section)}.
Vision: depth {cfg.model.vision_depth}, hidden {cfg.model.vision_hidden}, patch 14, spatial merge 2,
temporal patch 2.
Frames are {cfg.world.size}x{cfg.world.size} images: {(cfg.world.size // 28) ** 2} vision tokens each.

Trained with

    python -m bench.train_world_model --steps {cfg.steps} --batch-size {cfg.batch_size} --seed {cfg.seed} \\
        --max-minutes {cfg.max_minutes:g} --threads {cfg.threads}

(seed {cfg.seed}, {cfg.threads} CPU thread(s), {result["train_seconds"] / 60:.1f} minutes,
{result["steps_done"]} of {cfg.steps} steps, {result["train_episodes"]} training episodes).
{stop_note}
Greedy test accuracy, full prefill, plain HF model, {cfg.n_test} test-split episodes:

| kind | accuracy | questions |
|---|---|---|
| single-hop | {result["test"]["single"]:.3f} | {result["test"]["n_single"]} |
| multi-hop | {result["test"]["multi"]:.3f} | {result["test"]["n_multi"]} |

Per template: {json.dumps(result["test"]["per_template"])}

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
    model = Qwen2_5_VLForConditionalGeneration(build_config(cfg.model, processor.tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    val = [make_episode(episode_seed("val", i), cfg.world) for i in range(cfg.n_val)]
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
                _plot(losses, evals, log_dir / "world_model_loss.png")
            progress.update(task, advance=1, info=info)
            if time.time() - t0 > 60 * cfg.max_minutes:
                progress.console.print(f"stopping at step {step + 1}: the {cfg.max_minutes} minute limit")
                break
    train_seconds = time.time() - t0
    test = evaluate(
        model, processor, [make_episode(episode_seed("test", i), cfg.world) for i in range(cfg.n_test)]
    )
    result = {
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "train_episodes": next_episode,
        "steps_done": len(losses),
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "test": asdict(test),
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
    (log_dir / "world_model_metrics.json").write_text(
        json.dumps({"losses": losses, **result}, indent=1) + "\n"
    )
    _plot(losses, evals, log_dir / "world_model_loss.png")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point (``kamera train-demo-model`` calls this)."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="train_world_model", description=__doc__.splitlines()[0])
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
    p.add_argument("--out-dir", default=defaults.out_dir)
    p.add_argument("--log-dir", default=defaults.log_dir)
    a = p.parse_args(argv)
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
    result = train(cfg)
    print(json.dumps({k: result[k] for k in ("parameters", "train_seconds", "test")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
