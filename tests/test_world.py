"""Tests for the synthetic video world, the batch builder and the shipped world_vl checkpoint."""

from __future__ import annotations

import hashlib
import random
import re

import numpy as np
import pytest
import torch

from tools.world import WORLD_VL_DIR
from tools.world.render import (
    ANSWER_WORDS,
    BACKGROUND,
    COLOURS,
    COUNTS,
    SLOTS,
    Episode,
    ObjectState,
    WorldConfig,
    episode_seed,
    make_episode,
    make_split,
    write_video,
)


def _fingerprint(ep: Episode) -> str:
    h = hashlib.sha256()
    for f in ep.frames:
        h.update(f.tobytes())
    for q in ep.questions:
        h.update(f"{q.text}|{q.answer}|{q.kind}|{q.frames_needed}".encode())
    return h.hexdigest()


def test_same_seed_same_episode() -> None:
    for i in range(5):
        a = make_episode(episode_seed("train", i))
        b = make_episode(episode_seed("train", i))
        assert _fingerprint(a) == _fingerprint(b)
        assert a.states == b.states
        assert a.events == b.events
    assert _fingerprint(make_episode("a")) != _fingerprint(make_episode("b"))


def test_splits_are_disjoint() -> None:
    prints = {s: {_fingerprint(ep) for ep in make_split(s, 60)} for s in ("train", "val", "test")}
    assert all(len(p) == 60 for p in prints.values())
    assert not prints["train"] & prints["val"]
    assert not prints["train"] & prints["test"]
    assert not prints["val"] & prints["test"]
    seeds = {episode_seed(s, i) for s in ("train", "val", "test") for i in range(1000)}
    assert len(seeds) == 3000


def test_bad_config_and_seed_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of 28"):
        WorldConfig(size=60)
    with pytest.raises(ValueError, match="n_frames"):
        WorldConfig(n_frames=1)
    with pytest.raises(ValueError, match="split"):
        episode_seed("dev", 0)


def _slot_box(slot: str, size: int) -> tuple[int, int, int, int]:
    half = size // 2
    col, row = SLOTS.index(slot) % 2, SLOTS.index(slot) // 2
    return col * half, row * half, (col + 1) * half, (row + 1) * half


@pytest.mark.parametrize("size", [56, 112])
def test_pixels_show_the_state(size: int) -> None:
    """Each occupied slot is mostly its object's colour; empty slots are background only."""
    cfg = WorldConfig(size=size)
    for i in range(20):
        ep = make_episode(episode_seed("val", i), cfg)
        assert len(ep.frames) == cfg.n_frames
        for frame, state in zip(ep.frames, ep.states, strict=True):
            px = np.asarray(frame)
            assert px.shape == (size, size, 3)
            by_slot = {o.slot: o for o in state}
            for slot in SLOTS:
                x0, y0, x1, y1 = _slot_box(slot, size)
                cell = px[y0:y1, x0:x1].reshape(-1, 3)
                if slot not in by_slot:
                    assert (cell == BACKGROUND).all()
                    continue
                share = {c: (cell == rgb).all(axis=1).mean() for c, rgb in COLOURS.items()}
                assert max(share, key=share.__getitem__) == by_slot[slot].colour
                assert share[by_slot[slot].colour] > 0.2


def _obj(state: tuple[ObjectState, ...], shape: str) -> ObjectState:
    return next(o for o in state if o.shape == shape)


def _check_answer(ep: Episode, text: str, template: str) -> str:
    """Recompute an answer from the per-frame states alone (not from the event log)."""
    s = ep.states
    changes = [
        (k, a.shape, b_)
        for k in range(1, len(s))
        for a in s[k - 1]
        for b_ in s[k]
        if a.shape == b_.shape and (a.slot != b_.slot or a.colour != b_.colour)
    ]
    moves = [(k, shape) for k, shape, _ in changes if _obj(s[k - 1], shape).slot != _obj(s[k], shape).slot]
    if template == "colour_at":
        shape, k = re.fullmatch(r"what colour is the (\w+) in frame (\d+) \?", text).groups()  # type: ignore[union-attr]
        return _obj(s[int(k) - 1], shape).colour
    if template == "digit_at":
        shape, k = re.fullmatch(r"what digit is on the (\w+) in frame (\d+) \?", text).groups()  # type: ignore[union-attr]
        return _obj(s[int(k) - 1], shape).digit
    if template == "shape_at":
        slot, k = re.fullmatch(r"what shape is at the ([\w-]+) in frame (\d+) \?", text).groups()  # type: ignore[union-attr]
        return next(o.shape for o in s[int(k) - 1] if o.slot == slot)
    if template == "count_at":
        (k,) = re.fullmatch(r"how many objects are in frame (\d+) \?", text).groups()  # type: ignore[union-attr]
        return COUNTS[len(s[int(k) - 1]) - 1]
    if template == "moved_last":
        return moves[-1][1]
    if template == "digit_moved_last":
        return _obj(s[-1], moves[-1][1]).digit
    if template == "colour_before_change":
        (shape,) = re.fullmatch(r"what colour was the (\w+) before it changed colour \?", text).groups()  # type: ignore[union-attr]
        colours = [_obj(st, shape).colour for st in s if any(o.shape == shape for o in st)]
        changed = [colours[i] for i in range(1, len(colours)) if colours[i] != colours[i - 1]]
        assert len(changed) == 1
        return colours[0]
    if template == "where_before_move":
        (shape,) = re.fullmatch(r"where was the (\w+) before it moved \?", text).groups()  # type: ignore[union-attr]
        slots = [_obj(st, shape).slot for st in s if any(o.shape == shape for o in st)]
        assert sum(slots[i] != slots[i - 1] for i in range(1, len(slots))) == 1
        return slots[0]
    if template == "colour_when_appeared":
        shape, new = re.fullmatch(r"what colour was the (\w+) when the (\w+) appeared \?", text).groups()  # type: ignore[union-attr]
        k = next(i for i, st in enumerate(s) if any(o.shape == new for o in st))
        assert k > 0
        return _obj(s[k], shape).colour
    raise AssertionError(template)


def test_answers_match_the_states() -> None:
    seen: set[str] = set()
    for i in range(150):
        ep = make_episode(episode_seed("test", i))
        for q in ep.questions:
            assert q.answer in ANSWER_WORDS
            assert all(1 <= k <= len(ep.frames) for k in q.frames_needed)
            assert _check_answer(ep, q.text, q.template) == q.answer, (ep.seed, q)
            seen.add(q.template)
        kinds = [q.kind for q in ep.questions]
        assert kinds.count("single") == 4
    assert len(seen) == 9


def test_video_round_trip(tmp_path) -> None:
    av = pytest.importorskip("av")
    eps = make_split("val", 2)
    path = write_video(eps, tmp_path / "world.mp4", fps=1)
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 12
    assert [round(float(f.time)) for f in frames] == list(range(12))
    first = np.asarray(frames[0].to_image(), dtype=np.int16)
    assert np.abs(first - np.asarray(eps[0].frames[0], dtype=np.int16)).mean() < 12


def test_fast_batch_matches_processor() -> None:
    from tools.world.batches import train_batch
    from tools.world.model import build_processor, chat

    processor = build_processor(WorldConfig())
    eps = make_split("train", 3)
    batch = train_batch(eps, processor, random.Random(0))
    texts, rng = [], random.Random(0)
    for ep in eps:
        qs = list(ep.questions)
        rng.shuffle(qs)
        texts.append(processor.apply_chat_template(chat(ep, qs, with_answers=True), tokenize=False))
    processor.tokenizer.padding_side = "right"
    ref = processor(
        text=texts, images=[f for ep in eps for f in ep.frames], return_tensors="pt", padding=True
    )
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(ref[key], batch[key]), key
    torch.testing.assert_close(ref["pixel_values"], batch["pixel_values"], atol=1e-5, rtol=0)
    tok = processor.tokenizer
    answers = [tok.decode(t) for t in batch["labels"][0][batch["labels"][0] != -100].tolist()]
    assert answers[1::2] == ["<|im_end|>"] * len(eps[0].questions)
    assert sorted(answers[0::2]) == sorted(q.answer for q in eps[0].questions)


def test_captions_follow_the_questions() -> None:
    from tools.world.batches import train_batch
    from tools.world.model import build_processor

    processor = build_processor(WorldConfig())
    ep = make_episode(episode_seed("train", 7))
    batch = train_batch([ep], processor, random.Random(1), n_captions=2)
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert "[UNK]" not in text
    last_question = max(text.index(q.text) for q in ep.questions)
    captions = [m.start() for m in re.finditer("describe frame", text)]
    assert len(captions) == 2
    assert min(captions) > last_question


def test_frame_targets_describe_each_image_token() -> None:
    from tools.world.batches import train_batch
    from tools.world.model import build_processor

    processor = build_processor(WorldConfig())
    tok = processor.tokenizer
    eps = make_split("train", 2)
    batch = train_batch(eps, processor, random.Random(0))
    target = batch["frame_targets"]
    n_image = int((batch["input_ids"] == processor.image_token_id).sum())
    assert target.shape == (n_image, len(tok))
    torch.testing.assert_close(target.sum(-1), torch.ones(n_image))
    row = 0
    for ep in eps:
        for f, state in enumerate(ep.states, start=1):
            at = {o.slot: o for o in state}
            for slot in SLOTS:
                words = set(tok.convert_ids_to_tokens(target[row].nonzero().flatten().tolist()))
                obj = at.get(slot)
                expected = {slot, str(f)} | ({obj.colour, obj.shape, obj.digit} if obj else set())
                assert words == expected
                row += 1


def test_training_loss_adds_the_frame_objective() -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tools.world.batches import train_batch, training_loss
    from tools.world.model import ModelSize, build_config, build_processor

    torch.manual_seed(0)
    processor = build_processor(WorldConfig())
    model = Qwen2_5_VLForConditionalGeneration(build_config(ModelSize(), processor.tokenizer))
    batch = train_batch(make_split("train", 1), processor, random.Random(0))
    with torch.no_grad():
        plain, zero = training_loss(model, batch, processor.image_token_id, 0.0)
        both, aux = training_loss(model, batch, processor.image_token_id, 0.5)
    assert float(zero) == 0.0
    assert float(aux) > 0
    torch.testing.assert_close(both, plain + 0.5 * aux)


needs_checkpoint = pytest.mark.skipif(
    not (WORLD_VL_DIR / "model.safetensors").is_file(), reason="world_vl checkpoint not present"
)


@needs_checkpoint
def test_checkpoint_loads_and_answers() -> None:
    """Loads like a downloaded Qwen2.5-VL and answers test-split questions greedily.

    Checks what the shipped weights reliably do (see ``metrics.json``): well-formed one-word
    answers everywhere, and most counting questions right.
    """
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(WORLD_VL_DIR)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(WORLD_VL_DIR).eval()
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    assert processor.tokenizer.convert_tokens_to_ids("<|vision_start|>") == model.config.vision_start_token_id
    per_frame = (WorldConfig().size // 28) ** 2
    counts = []
    for i in range(8):
        ep = make_episode(episode_seed("test", i))
        content: list[dict[str, str]] = []
        for k in range(len(ep.frames)):
            content += [{"type": "text", "text": f"frame {k + 1}"}, {"type": "image"}]
        for q in ep.questions:
            if q.template not in ("count_at", "colour_at") and i > 0:
                continue
            messages = [{"role": "user", "content": [*content, {"type": "text", "text": q.text}]}]
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = processor(text=[text], images=ep.frames, return_tensors="pt")
            assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == per_frame * len(
                ep.frames
            )
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
            new = out[0, inputs["input_ids"].shape[1] :]
            answer = processor.decode(new, skip_special_tokens=True).strip()
            assert answer in ANSWER_WORDS, answer
            if q.template == "count_at":
                counts.append(answer == q.answer)
    assert sum(counts) >= 6, counts


def test_training_is_deterministic_for_a_seed(tmp_path) -> None:
    """Two short runs with the same seed end on the same weights and the same losses."""
    from safetensors.torch import load_file

    from tools.world.model import ModelSize
    from tools.world.train import TrainConfig, train

    def run(name: str) -> dict:
        cfg = TrainConfig(
            steps=3, batch_size=2, warmup=1, n_val=1, n_test=1, eval_every=100, threads=1,
            out_dir=str(tmp_path / name), log_dir=str(tmp_path / f"{name}-logs"),
            model=ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                            mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=1, vision_heads=2,
                            vision_intermediate=64),
        )  # fmt: skip
        return train(cfg)

    threads = torch.get_num_threads()
    try:
        first, second = run("a"), run("b")
    finally:
        torch.set_num_threads(threads)  # train() sets its own thread count
    assert first["final_loss"] == second["final_loss"]
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_episode_after_other_frames_counts_frames_within_the_prompt() -> None:
    """A longer prompt: the last n frames of the episodes before, then the episode; questions and
    events renumbered, states aligned with frames, the answers unchanged."""
    from tools.world.render import after_frames

    a, b, ep = make_split("test", 3)
    long = after_frames(ep, [a, b], 8)
    assert len(long.frames) == len(long.states) == 8 + len(ep.frames)
    assert long.frames[:2] == a.frames[-2:]
    assert long.frames[2:8] == b.frames
    assert long.frames[8:] == ep.frames
    assert long.states[8:] == ep.states
    for q, orig in zip(long.questions, ep.questions, strict=True):
        assert q.answer == orig.answer
        assert q.template == orig.template
        assert q.frames_needed == tuple(k + 8 for k in orig.frames_needed)
        numbers = [int(k) for k in re.findall(r"frame (\d+)", q.text)]
        assert numbers == [int(k) + 8 for k in re.findall(r"frame (\d+)", orig.text)]
        for k in numbers:  # the frame a single-hop question names shows what it asks about
            assert long.states[k - 1] == ep.states[k - 9]
    assert [e.frame for e in long.events] == [e.frame + 8 for e in ep.events]
    assert after_frames(ep, [a], 0).frames == ep.frames
    with pytest.raises(ValueError, match="hold 12"):
        after_frames(ep, [a, b], 13)
    with pytest.raises(ValueError, match=">= 0"):
        after_frames(ep, [a], -1)


def test_with_context_follows_the_episodes_before_wrapping_round() -> None:
    from tools.world.train import with_context

    eps = make_split("test", 4)
    out = with_context(eps, 9)
    assert [len(e.frames) for e in out] == [15] * 4
    for i, e in enumerate(out):
        before, last = eps[(i - 2) % 4], eps[(i - 1) % 4]
        assert e.frames[:3] == before.frames[-3:]
        assert e.frames[3:9] == last.frames
        assert e.frames[9:] == eps[i].frames
    assert with_context(eps, 0) == eps


def test_long_window_training_starts_from_a_checkpoint(tmp_path) -> None:
    """--init fine-tunes a checkpoint on windows of other episodes' frames and scores the test split
    by prompt length; a checkpoint of another size, or windows the batch cannot fill, are refused."""
    from safetensors.torch import load_file

    from tools.world.model import ModelSize
    from tools.world.train import TrainConfig, train

    size = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, mrope_section=(2, 3, 3),
                     vision_hidden=32, vision_depth=1, vision_heads=2, vision_intermediate=64)  # fmt: skip
    common = {
        "batch_size": 3,
        "warmup": 1,
        "n_val": 3,
        "n_test": 3,
        "eval_every": 100,
        "threads": 1,
        "model": size,
    }
    threads = torch.get_num_threads()
    try:
        train(TrainConfig(steps=1, out_dir=str(tmp_path / "base"), log_dir=str(tmp_path / "logs"), **common))
        long = TrainConfig(
            steps=2, context_frames=12, eval_windows=(6, 12), init=str(tmp_path / "base"),
            out_dir=str(tmp_path / "long"), log_dir=str(tmp_path / "logs"), log_name="long", **common,
        )  # fmt: skip
        result = train(long)
        other = {**common, "model": ModelSize()}
        with pytest.raises(ValueError, match="vision depth"):
            train(TrainConfig(steps=1, init=str(tmp_path / "base"), out_dir=str(tmp_path / "x"),
                              log_dir=str(tmp_path / "logs"), **other))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert set(result["test_by_window"]) == {"6", "12"}
    assert result["test_by_window"]["6"]["n_single"] == result["test"]["n_single"] == 12
    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    tuned = load_file(str(tmp_path / "long" / "model.safetensors"))
    assert base.keys() == tuned.keys()
    assert not all(torch.equal(base[k], tuned[k]) for k in base)
    assert (tmp_path / "logs" / "long_metrics.json").is_file()
    readme = (tmp_path / "long" / "README.md").read_text()
    assert "--context-frames 12" in readme
    assert "| 12 |" in readme
    with pytest.raises(ValueError, match="other episodes of a batch"):
        TrainConfig(batch_size=2, context_frames=7)
    with pytest.raises(ValueError, match="hold an episode"):
        TrainConfig(eval_windows=(4,))
    with pytest.raises(ValueError, match="labels go up to 99"):
        TrainConfig(batch_size=32, context_frames=120)
    assert TrainConfig(n_val=0).context_frames == 0  # no validation set: fine without context
    from tools.world.train import main

    with pytest.raises(SystemExit):
        main(["--eval-windows", "6,x"])
    with pytest.raises(SystemExit):
        main(["--context-frames", "200"])


def test_both_world_checkpoints_are_named_and_read_in_their_labelled_layout() -> None:
    from argparse import Namespace

    from agent.adapters.loading import WORLD_VL, WORLD_VL_LONG, resolve
    from demos.video_session import layout_of
    from tools.world import WORLD_VL_LONG_DIR

    assert resolve(WORLD_VL) == WORLD_VL_DIR
    assert resolve(WORLD_VL_LONG) == WORLD_VL_LONG_DIR
    for model in (None, WORLD_VL, WORLD_VL_LONG, str(WORLD_VL_DIR), str(WORLD_VL_LONG_DIR)):
        assert layout_of(Namespace(layout="auto", model=model)) == "labelled", model
    assert layout_of(Namespace(layout="auto", model="tiny")) == "chat"
    assert layout_of(Namespace(layout="chat", model=WORLD_VL_LONG)) == "chat"


@pytest.mark.skipif(
    not (WORLD_VL_DIR.parent / "world_vl_long" / "model.safetensors").is_file()
    or not (WORLD_VL_DIR / "model.safetensors").is_file(),
    reason="world_vl or world_vl_long checkpoint not present",
)
def test_long_window_checkpoint_reads_32_frames_where_the_six_frame_one_cannot() -> None:
    """Test episodes each shown after 26 frames of the episodes before them (a 32-frame prompt):
    the long-window checkpoint answers most single-hop questions, the six-frame one few."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tools.world import WORLD_VL_LONG_DIR
    from tools.world.model import build_processor
    from tools.world.train import accuracy_by_window

    processor = build_processor(WorldConfig())
    episodes = make_split("test", 8)
    single = {}
    for name, folder in (("short", WORLD_VL_DIR), ("long", WORLD_VL_LONG_DIR)):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
        single[name] = accuracy_by_window(model, processor, episodes, (32,))[32].single
    assert single["long"] >= 0.75, single
    assert single["short"] <= 0.5, single
