"""The embedded world model: a small Qwen2.5-VL, its word-level tokenizer, processor and prompts.

The model is the real ``transformers.Qwen2_5_VLForConditionalGeneration`` with a few million
parameters, a word-level tokenizer with Qwen's chat and vision special tokens, and the real
``Qwen2VLImageProcessor``. Each video frame is fed as its own *image* (not as a video), so every
frame is one vision chunk of ``(size / 28) ** 2`` tokens, laid out as::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\nframe 1<|vision_start|><|image_pad|>x16<|vision_end|>frame 2<|vision_start|>...
    <question><|im_end|>\\n<|im_start|>assistant\\n<answer><|im_end|>

:func:`evaluate` asks each question on its own turn after the frames and decodes greedily with
``generate`` on the plain model (full prefill, no cache reuse).

Not here: training batches (``batches.py``), the training loop (``train.py``), the world itself
(``render.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from tools.world.render import ANSWER_WORDS, Episode, Question, WorldConfig, episode_seed, make_episode

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
