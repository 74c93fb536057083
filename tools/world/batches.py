"""Training batches for the world model: answer labels, fast pixel values, caption turns and the
dense frame-token objective.

Training sequences hold one episode with all its questions as successive chat turns; the loss
covers only answer tokens (and the ``<|im_end|>`` closing each answer).

Not here: the model, tokenizer and prompts (``model.py``), the optimiser loop (``train.py``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

from tools.world.model import chat
from tools.world.render import SLOTS, Episode, Question


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
