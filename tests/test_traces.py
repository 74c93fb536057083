from __future__ import annotations

import itertools
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.adapters.loading import load_adapter
from agent.adapters.tiny import VOCAB
from bench.methods import kl_divergence
from bench.traces import main
from bench.traces_consistency import (
    MODES,
    Piece,
    consistency_turn,
    plan_pieces,
    run_method,
    sample_turns,
    truncate,
)
from bench.traces_data import data_root, session_from_trajectory
from bench.traces_policies import get_policy
from bench.traces_replay import RequestStat, replay_session, summarize
from bench.traces_report import BYTES_PER_TOKEN, policy_fields, timing_fields
from bench.traces_tokens import MessageTokenizer, TemplateTokenizer, Tokenized, message_parts
from cache.cdc import CDCConfig
from cache.patch import PatchConfig
from cache.planner import PlannerConfig

CFG = PlannerConfig(cdc=CDCConfig(min_size=4, avg_size=16, max_size=64, window=8))


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def fake_encode(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 40_000 for w in text.split()]


def conversation(turns: int = 5) -> list[dict[str, object]]:
    msgs: list[dict[str, object]] = [
        {"role": "system", "content": words("sys", 60)},
        {"role": "user", "content": words("task", 20)},
    ]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": words(f"a{t}x", 10 + 3 * t)})
        msgs.append({"role": "tool", "content": words(f"o{t}x", 30 + 5 * t)})
    msgs.append({"role": "assistant", "content": "done"})
    return msgs


def test_hit_rates_and_store_bytes_on_a_handcrafted_session() -> None:
    tok = MessageTokenizer(fake_encode)
    s = session_from_trajectory("x", conversation())
    stats = replay_session(s, get_policy("append"), tok, CFG)
    lengths = [len(tok(r).ids) for r in s.requests]
    # append: each request reuses the previous prompt, and the new messages' role headers and end
    # markers by content (one token each here); the store holds each distinct chunk of the last
    # prompt once: every body, and one copy of each header and end marker
    assert [r.prefix for r in stats] == [0, *lengths[:-1]]
    assert [r.content - r.prefix for r in stats] == [0, 2, 4, 4, 4, 4]
    rec = policy_fields(summarize("append", stats))
    assert rec["prompt_tokens"] == sum(lengths)
    assert rec["prefix_hit_rate"] == pytest.approx(sum(lengths[:-1]) / sum(lengths))
    parts = {t for m in s.requests[-1] for t in message_parts(m)}
    distinct = sum(len(fake_encode(t)) for t in parts)
    n = len(s.requests[-1])
    assert distinct == lengths[-1] - (n - 4) - (n - 1)  # 4 role headers, 1 end marker
    assert rec["store_tokens"] == distinct
    assert rec["store_bytes_gqa"] == distinct * 30 * 3 * 64 * 2 * 2
    assert rec["store_bytes_mla"] == distinct * 60 * 576 * 2
    assert rec["store_bytes_mla"] < rec["store_bytes_mla_expanded"]  # type: ignore[operator]

    win = summarize("window-2", replay_session(s, get_policy("window-2"), tok, CFG))
    assert win.content_hit_rate > win.prefix_hit_rate
    want = (win.content_hit_rate - win.prefix_hit_rate) / (win.oracle_hit_rate - win.prefix_hit_rate)
    assert win.recovered_of_oracle == pytest.approx(want)
    assert win.store_tokens <= win.prompt_tokens


def test_truncate_keeps_the_system_head_and_the_tail() -> None:
    # messages at 0, 30, 50, 80; bodies start 3 tokens in and end 2 tokens before the next
    tok = Tokenized(np.arange(100), (0, 30, 50, 80), (0, 3, 28, 30, 33, 48, 50, 53, 78, 80, 83, 98))
    out = truncate(tok, 40)
    assert out.ids.tolist() == [*range(20), *range(80, 100)]
    assert out.message_starts == (0, 20)
    assert out.boundaries == (0, 3, 20, 23, 38)
    out = truncate(tok, 70)
    assert out.ids.tolist() == [*range(30), *range(60, 100)]
    assert out.message_starts == (0, 30, 50)
    assert out.boundaries == (0, 3, 28, 30, 48, 50, 53, 68)
    assert truncate(tok, 100) is tok


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["llama-gqa", "deepseek-mla"])
def test_all_misses_chunk_by_chunk_equal_full_prefill(name: str) -> None:
    adapter = load_adapter(f"tiny:{name}")
    ids = _ids(60, 1)
    full = adapter.prefill(adapter.text(ids), adapter.empty_cache(), 0)
    ref = adapter.generate(adapter.text(ids), full.cache, 0, 8, first_logits=full.logits[-1])
    pieces = [Piece(s, e, "miss", None, None) for s, e in [(0, 17), (17, 30), (30, 59), (59, 60)]]
    for mode in MODES:
        logits, cache, last = run_method(adapter, ids, pieces, {}, full.kv, mode, 16, PatchConfig())
        assert kl_divergence(full.logits[-1], logits) < 1e-8
        gen = adapter.generate(adapter.text(ids[last.start :]), cache, last.start, 8, first_logits=logits)
        assert gen.tokens == ref.tokens


@pytest.mark.parametrize("name", ["llama-gqa", "deepseek-mla"])
def test_blind_relocation_of_an_unconditioned_first_chunk_equals_full_prefill(name: str) -> None:
    adapter = load_adapter(f"tiny:{name}")
    a, junk, rest = _ids(24, 2), _ids(10, 3), _ids(20, 4)
    # the source request holds A at 0, before anything: its KV is KV(A|∅)
    source = adapter.prefill(adapter.text(torch.cat([a, junk])), adapter.empty_cache(), 0).kv
    ids = torch.cat([a, rest])
    full = adapter.prefill(adapter.text(ids), adapter.empty_cache(), 0)
    pieces = [Piece(0, 24, "relocated", 0, 0), Piece(24, 44, "miss", None, None)]
    ref = adapter.generate(adapter.text(ids), full.cache, 0, 8, first_logits=full.logits[-1])
    for mode in MODES:
        logits, cache, last = run_method(adapter, ids, pieces, {0: source}, full.kv, mode, 16, PatchConfig())
        assert kl_divergence(full.logits[-1], logits) < 1e-8
        gen = adapter.generate(adapter.text(ids[last.start :]), cache, last.start, 8, first_logits=logits)
        assert gen.tokens == ref.tokens


def _dynamic_prompts(step_headers: list[int]) -> list[Tokenized]:
    """Requests whose first message changes each time while the messages after it repeat."""
    tok = MessageTokenizer(fake_encode)
    msgs = conversation(3)
    out = []
    for i, h in enumerate(step_headers):
        head = {"role": "system", "content": f"time {h} " + words("sys", 60)}
        out.append(tok([head, *msgs[1 : 3 + 2 * i]]))
    return out


def test_plan_pieces_relocates_and_ends_on_a_miss() -> None:
    prompts = _dynamic_prompts([1, 2, 3])
    pieces, used = plan_pieces(prompts, CFG)
    n = len(prompts[-1].ids)
    assert pieces[0].start == 0
    assert pieces[-1].kind == "miss"
    assert pieces[-1].end == n
    assert all(p.end == q.start for p, q in itertools.pairwise(pieces))
    assert any(p.kind == "relocated" for p in pieces)
    assert used <= {0, 1}


def test_mla_latent_is_reused_byte_for_byte_and_only_k_rope_rotates() -> None:
    adapter = load_adapter("tiny:deepseek-mla")
    r = consistency_turn(adapter, _dynamic_prompts([1, 22, 333]), CFG, VOCAB, max_new_tokens=4)
    assert r.reused["relocated"] > 0
    assert r.latent_identical is True
    assert r.krope_rotated is True
    assert set(r.kl) == set(MODES)
    assert r.kl["patched"] <= r.kl["blind"] + 1e-9
    # a stored MLA entry holds the latent and k_rope, nothing expanded per head
    kv = adapter.encode(adapter.text(_ids(10, 5)))
    cfg = adapter.model.config  # type: ignore[attr-defined]
    per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert kv.nbytes == 10 * per_token
    assert BYTES_PER_TOKEN["mla"] == 60 * (512 + 64) * 2


def _jsonl(tmp_path: Path) -> Path:
    s = session_from_trajectory("s1", conversation(4))
    p = tmp_path / "tiny.jsonl"
    p.write_text(json.dumps({"id": "s1", "turns": list(s.requests)}) + "\n")
    return p


def test_cli_writes_the_json_keys(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = [
        "--data", str(_jsonl(tmp_path)), "--tokenizer", "word", "--cdc", "2,8,32,4",
        "--policies", "append,window-2,dynamic-system,mask-observations-1,rerank",
        "--consistency-models", "llama-gqa,deepseek-mla", "--consistency-turns", "1",
        "--consistency-budget", "300", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(out.read_text())
    keys = {"prefix_hit_rate", "content_hit_rate", "oracle_hit_rate", "recovered_of_oracle", "lookup_ms_p50",
            "prompt_tokens", "store_bytes_gqa", "store_bytes_mla"}  # fmt: skip
    for name in ("append", "window-2", "dynamic-system", "mask-observations-1", "rerank"):
        assert keys <= set(r["policies"][name])
        assert keys <= set(r["sets"]["tiny"]["policies"][name])
    for model in ("llama-gqa", "deepseek-mla"):
        for mode in MODES:
            assert {"greedy_match", "kl_median"} <= set(r["consistency"][model][mode])
    assert r["consistency"]["deepseek-mla"]["mla_latent_identical"] is True
    assert "reference" in r
    assert r["timing"]["chunking_tokens_per_s"] > 0
    for name in ("append", "window-2", "dynamic-system", "mask-observations-1", "rerank"):
        t = r["timing"]["policies"][name]
        assert {
            "lookup_ms_p50",
            "plan_ms_mean",
            "saved_tokens_mean",
            "breakeven_prefill_tokens_per_s",
        } <= set(t)


def test_timing_fields_put_the_plan_beside_the_prefill_it_saves() -> None:
    stats = [RequestStat(3000, 1000, 2000, 2100, 1.5), RequestStat(500, 0, 0, 0, 0.5)]
    t = timing_fields(stats, prefill_s_per_token=1e-3)  # 1,000 tokens/s
    assert t["plan_ms_mean"] == pytest.approx(1.0)
    assert t["saved_tokens_mean"] == pytest.approx(500)  # (2000 - 1000 + 0) / 2 requests
    assert t["saved_prefill_ms_mean"] == pytest.approx(500)
    assert t["plan_over_saved_prefill"] == pytest.approx(2e-3 / 1.0)
    # 1% holds while 1,000 saved tokens take at least 100 x 2 ms to prefill: up to 5,000 tokens/s.
    assert t["breakeven_prefill_tokens_per_s"] == pytest.approx(5000)
    assert "plan_over_saved_prefill" not in timing_fields(stats, None)


def test_template_tokenizer_pieces_match_the_whole_text() -> None:
    from agent.adapters.loading import SMOLLM2, cache_dir

    folder = cache_dir() / "models" / SMOLLM2
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"converted SmolLM2 folder {folder} is absent")
    from transformers import AutoTokenizer

    tok = TemplateTokenizer(AutoTokenizer.from_pretrained(folder))
    msgs = conversation(2)[:-1]
    call = {"function": {"arguments": '{"path": "."}', "name": "ls"}, "id": "call_1"}
    msgs[2] = {"role": "assistant", "content": None, "tool_calls": [call]}
    out = tok(msgs)
    whole = tok.tokenizer(tok.render(msgs), add_special_tokens=False)["input_ids"]
    assert out.ids.tolist() == whole
    assert len(out.message_starts) == len(msgs) + 1  # the generation prompt is its own piece
    im_start = tok.tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(out.ids[s] == im_start for s in out.message_starts)
    # every message: its start, the token after its header line, its end marker; msgs[2] has
    # no content, so its body starts with its tool calls, whose free fields are cut out
    assert list(out.boundaries) == sorted(set(out.boundaries))
    inner = [b for b in out.boundaries if b not in out.message_starts]
    ends = [b for b in inner if out.ids[b] == im_end]
    assert len(ends) == len(msgs)
    bounds = [*out.boundaries, len(out.ids)]
    chunks = [tok.tokenizer.decode(out.ids[a:b]) for a, b in itertools.pairwise(bounds)]
    start = chunks.index("<|im_start|>assistant\n")
    assert chunks[start + 1].startswith("\n<tool_call>")
    assert "path" not in chunks[start + 1]
    assert any("path" in c and "name" not in c for c in chunks)
    assert any("call_1" in c and "type" not in c and "name" not in c for c in chunks)
    assert len(inner) > 2 * len(msgs)  # the generation prompt has no body


def test_real_traces_reference_share(tmp_path: Path) -> None:
    root = data_root()
    if root is None or not (root / "agent_traces").is_dir():
        pytest.skip("shared data folder absent (../shared/data or $KAMERA_DATA): real-trace test skipped")
    out = tmp_path / "r.json"
    argv = ["--sets", "mini", "--sessions", "1", "--tokenizer", "word", "--policies", "append,window-6",
            "--consistency-turns", "0", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert 0.9 < r["reference"]["mini_swe_agent_cached_share"] <= 1.0
    assert r["policies"]["window-6"]["content_hit_rate"] > r["policies"]["window-6"]["prefix_hit_rate"]


def test_sampled_consistency_turns_are_distinct() -> None:
    """Early in a session several policies render the same requests: such a turn counts once."""
    sessions = [session_from_trajectory(f"s{i}", conversation(6)) for i in range(3)]
    tokenize = MessageTokenizer(fake_encode)
    policies = ["window-2", "mask-observations-1", "rerank", "dynamic-system"]
    cfg = PlannerConfig(cdc=CDCConfig(min_size=2, avg_size=8, max_size=32, window=4))
    turns = sample_turns({"tiny": sessions}, policies, tokenize, cfg, 40, 2000, min_relocated=8)
    digests = {b"".join(p.ids.tobytes() + b"|" for p in prompts) for *_, prompts in turns}
    assert turns
    assert len(digests) == len(turns)
