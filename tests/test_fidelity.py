"""The fidelity harness on tiny random models: reference, exact limits of every method, loaders, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.loading import load_adapter
from agent.byte_tokenizer import ByteTokenizer
from bench.answers import Codec, exact_match, token_f1
from bench.fidelity import main
from bench.fidelity_data import QAItem, in_split, load_items
from bench.fidelity_item import (
    FidelityConfig,
    MethodRecord,
    build_prompt,
    evaluate_item,
    kv_in_other_orders,
    other_orderings,
    reference_pass,
    run_tail,
)
from bench.fidelity_report import predictor_fields
from bench.methods import full_prefill

ITEM = QAItem(
    "x",
    ("The Rhine rises in the Alps.", "It flows to the North Sea.", "Rotterdam lies at its mouth."),
    "Where does the Rhine end?",
    ("the North Sea",),
)


@pytest.fixture(scope="module")
def llama() -> ModelAdapter:
    return load_adapter("tiny:llama-gqa", tokenizer=ByteTokenizer())


def test_reference_equals_direct_prefill(llama: ModelAdapter) -> None:
    codec = Codec(None)
    prompt = build_prompt(codec, ITEM, FidelityConfig(max_chunk_tokens=20))
    ref = reference_pass(llama, prompt)
    direct = llama.prefill(llama.text(prompt.context), llama.empty_cache(), 0)
    k = torch.stack([lay.keys[0] for lay in direct.cache.layers])
    v = torch.stack([lay.values[0] for lay in direct.cache.layers])
    torch.testing.assert_close(ref.k, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.v, v, atol=1e-5, rtol=1e-5)
    n = int(prompt.context.numel())
    logits, _ = run_tail(llama, ref.k, ref.v, prompt, [], 0)
    tail = llama.prefill(llama.text(prompt.tail), direct.cache, n).logits
    torch.testing.assert_close(logits, tail, atol=1e-4, rtol=1e-4)


def test_exact_limits_of_every_method(llama: ModelAdapter) -> None:
    config = FidelityConfig(
        ranks=(1000,),
        budgets=(200.0,),
        cacheblend=(100.0,),
        epic=(1000,),
        oracle_select=(100.0,),
        canonical=("after-prefix", "alone"),
        max_chunk_tokens=20,
        max_new_tokens=3,
    )
    result = evaluate_item(llama, Codec(None), ITEM, config)
    for mode in ("after-prefix", "alone"):
        recs = result.methods[mode]
        assert max(recs["prefix"].kl) < 1e-9
        assert max(recs["blind"].kl) > 1e-6
        for name in ("patch-r1000", "patch-budget-200", "patch-budget-r1000", "cacheblend-100"):
            assert max(recs[name].kl) < 1e-5, (mode, name, max(recs[name].kl))
            assert min(recs[name].top1) == 1.0
        assert recs["cacheblend-100"].recompute == 1.0
        assert max(recs["oracle-select-100"].kl) < 1e-5
        assert recs["oracle-select-100"].oracle
        assert not recs["cacheblend-100"].oracle
    # EPIC leaves the first chunk as reused: exact when that chunk was encoded after the prefix
    assert max(result.methods["after-prefix"]["epic-1000"].kl) < 1e-5
    assert max(result.methods["after-prefix"]["blind"].k_err[1:]) > 0.0
    # after the prefix, the first chunk's canonical KV is its conditioned KV: Δ is zero there
    assert len(result.deficit["alone"]) == llama.info.n_layers


def test_guarded_repair_rows(llama: ModelAdapter) -> None:
    """The server's guard on CacheBlend's KV: a margin no step clears sends every answer to the
    exact KV (the reference's answer, paid as a prefill of the later chunks); one every step
    clears leaves the unguarded answer and cost."""
    base = {"ranks": (), "budgets": (), "cacheblend": (10.0,), "epic": (), "max_chunk_tokens": 20}
    lengths = [int(c.numel()) for c in build_prompt(Codec(None), ITEM, FidelityConfig(**base)).chunks]
    later = sum(lengths[1:]) / sum(lengths)
    always = evaluate_item(llama, Codec(None), ITEM, FidelityConfig(**base, guard_margin=1e9, guard_cap=0.0))
    for recs in always.methods.values():
        plain, guarded = recs["cacheblend-10"], recs["cacheblend-10+guard"]
        assert guarded.fallback == 1.0
        assert guarded.answer == always.reference_answer
        assert guarded.agree == 1.0
        assert guarded.recompute == pytest.approx(plain.recompute + later)
        assert guarded.kl == plain.kl  # scored on the repaired KV the guard watched
    # beyond the cap the repair is given up as the server does: exact KV, its recompute not spent
    given_up = evaluate_item(llama, Codec(None), ITEM, FidelityConfig(**base, guard_margin=1e9))
    for recs in given_up.methods.values():
        guarded = recs["cacheblend-10+guard"]
        assert (guarded.fallback, guarded.agree) == (1.0, 1.0)
        assert guarded.recompute == pytest.approx(later)
    never = evaluate_item(llama, Codec(None), ITEM, FidelityConfig(**base, guard_margin=1e-12))
    for recs in never.methods.values():
        plain, guarded = recs["cacheblend-10"], recs["cacheblend-10+guard"]
        assert guarded.fallback == 0.0
        assert (guarded.answer, guarded.recompute) == (plain.answer, plain.recompute)
    off = evaluate_item(llama, Codec(None), ITEM, FidelityConfig(**base, guard_margin=0.0))
    assert not any(n.endswith("+guard") for recs in off.methods.values() for n in recs)
    with pytest.raises(ValueError, match="guard_margin"):
        FidelityConfig(guard_margin=-1.0)


def test_other_orderings_never_the_served_one() -> None:
    three = other_orderings(3, 4)
    assert len(three) == 4 == len(set(three))
    assert (0, 1, 2) not in three
    assert all(sorted(o) == [0, 1, 2] for o in three)
    assert three == other_orderings(3, 4)  # the same for every item of a size
    assert other_orderings(2, 4) == [(1, 0)]  # all there is
    assert other_orderings(1, 4) == []
    assert other_orderings(3, 0) == []


def test_orbit_deltas_are_each_chunks_kv_by_its_served_index(llama: ModelAdapter) -> None:
    item = QAItem("d", ("alpha beta", "gamma delta epsilon", "zeta"), ITEM.question, ITEM.answers)
    prompt = build_prompt(Codec(None), item, FidelityConfig(max_chunk_tokens=40))
    lengths = [int(c.numel()) for c in prompt.chunks]
    assert len(set(lengths)) == 3
    orders = [(2, 0, 1), (1, 2, 0)]
    kv = kv_in_other_orders(llama, prompt, orders)
    for o, order in enumerate(orders):
        assert [int(c.k.shape[2]) for c in kv[o]] == lengths
        # the chunk an order shows first sees only the prefix
        first = full_prefill(llama, llama.text(prompt.prefix), [llama.text(prompt.chunks[order[0]])])
        torch.testing.assert_close(kv[o][order[0]].k, first.conditioned[0].k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv[o][order[0]].v, first.conditioned[0].v, atol=1e-5, rtol=1e-5)


def test_orbit_rows(llama: ModelAdapter) -> None:
    """Orbit patches are deployable rows fitted on other orders of the set, with CacheBlend and the
    guard on top; where every order's prefill is the served one's (the same chunk three times) a
    full-rank orbit patch is exact, and a single chunk, with no other order, is blind reuse."""
    base = {"budgets": (), "epic": (), "cacheblend": (15.0,), "max_chunk_tokens": 20, "max_new_tokens": 3}
    result = evaluate_item(llama, Codec(None), ITEM, FidelityConfig(**base, ranks=(4,), orbit_orderings=2))
    for recs in result.methods.values():
        for name in ("orbit-r4", "orbit-r4+cacheblend-15", "orbit-r4+cacheblend-15+guard"):
            assert not recs[name].oracle
            assert recs[name].bytes_ratio > 0.0
        assert recs["orbit-r4"].kl != recs["blind"].kl
        assert recs["orbit-r4+cacheblend-15"].recompute == recs["cacheblend-15"].recompute
    same = QAItem("s", (ITEM.chunks[1],) * 3, ITEM.question, ITEM.answers)
    config = FidelityConfig(**base, ranks=(1000,), orbit_orderings=3, canonical=("after-prefix",))
    recs = evaluate_item(llama, Codec(None), same, config).methods["after-prefix"]
    assert max(recs["blind"].kl) > 1e-6
    assert max(recs["orbit-r1000"].kl) < 1e-5
    alone = QAItem("a", ITEM.chunks[:1], ITEM.question, ITEM.answers)
    recs = evaluate_item(llama, Codec(None), alone, config).methods["after-prefix"]
    assert recs["orbit-r1000"].kl == recs["blind"].kl
    assert recs["orbit-r1000"].bytes_ratio == 0.0
    with pytest.raises(ValueError, match="orbit_orderings"):
        FidelityConfig(orbit_orderings=-1)


def test_logit_error_and_its_predictors(llama: ModelAdapter) -> None:
    """A repaired row records the gap error the guard must cover and what a server could predict it
    from; recomputing every token leaves no error, and the spread of a predictor that is exactly
    proportional to the error is 1."""
    base = {"ranks": (), "budgets": (), "epic": (), "max_chunk_tokens": 20, "max_new_tokens": 3}
    config = FidelityConfig(**base, cacheblend=(10.0, 100.0), canonical=("after-prefix",))
    recs = evaluate_item(llama, Codec(None), ITEM, config).methods["after-prefix"]
    part, every = recs["cacheblend-10"], recs["cacheblend-100"]
    assert part.gap_error is not None
    assert part.repair_shift is not None
    assert part.repair_shift > 0.0
    assert every.gap_error < 1e-4
    assert part.probe_deviation is not None
    assert part.probe_deviation > 0.0
    assert every.probe_deviation == 0.0  # nothing left to probe
    assert recs["blind"].gap_error is None
    rows = [MethodRecord(gap_error=0.1 * i, repair_shift=0.05 * i, residual=1e-6 * i**3) for i in range(1, 6)]
    fields = predictor_fields(rows)
    assert fields["spread_repair_shift"] == pytest.approx(1.0)
    assert fields["spearman_repair_shift"] == pytest.approx(1.0)
    assert fields["spread_sqrt_residual"] > 1.5  # error ~ i, sqrt(residual) ~ i**1.5


def test_answer_scores() -> None:
    assert exact_match("The North Sea.", ["north sea"]) == 1.0
    assert token_f1("the north", ["North Sea"]) == pytest.approx(2 * 0.5 / 1.5)
    assert token_f1("", ["x"]) == 0.0


def test_jsonl_loader(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    rows = [
        {"id": "a", "chunks": ["one", "two"], "question": "q?", "answer": "one"},
        {"id": "b", "chunks": ["three"], "question": "r?", "answer": None},
        {"id": "c", "chunks": ["four"], "question": "s?", "answers": ["x", "y"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_items(path)
    assert [i.id for i in items] == ["a", "b", "c"]
    assert items[0].chunks == ("one", "two")
    assert items[0].answers == ("one",)
    assert items[1].answers == ()
    assert items[2].answers == ("x", "y")
    assert [i.id for i in load_items(path, "dev")] == ["a", "c"]
    assert [i.id for i in load_items(path, "test")] == ["b"]
    assert len(load_items(path, limit=1)) == 1
    assert in_split(4, "dev")
    assert in_split(5, "test")
    assert not in_split(5, "dev")


@pytest.mark.parametrize(
    "name",
    ["cacheblend_musique_s_150.json", "hipporag_musique_train_100.json", "hipporag_hotpotqa_train_100.json"],
)
def test_multihop_loaders(shared_data: Path, name: str) -> None:
    path = shared_data / "multihop_qa" / name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    raw = json.loads(path.read_text())
    dev, test = load_items(path, "dev", max_chunks=4), load_items(path, "test", max_chunks=4)
    assert len(dev) == (len(raw) + 1) // 2
    assert len(test) == len(raw) // 2
    for item in dev[:10] + test[:10]:
        assert 1 <= len(item.chunks) <= 4
        assert item.question
        assert item.answers
    if name.startswith("hipporag_musique"):
        # supporting paragraphs are always kept
        first = raw[0]
        gold = [p["paragraph_text"] for p in first["paragraphs"] if p["is_supporting"]]
        assert all(any(g in c for c in dev[0].chunks) for g in gold)
    assert load_items(path, "test", limit=1)[0].question == raw[1]["question"]


def test_cli_end_to_end(tmp_path: Path) -> None:
    data = tmp_path / "items.jsonl"
    rows = [
        {
            "id": str(i),
            "chunks": ["alpha beta gamma", "delta epsilon", "zeta eta"],
            "question": "q?",
            "answer": "x",
        }
        for i in range(3)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out, plots = tmp_path / "fid.json", tmp_path / "plots"
    argv = ["--model", "tiny:llama-gqa", "--data", str(data), "--split", "all", "--limit", "2"]
    argv += [
        "--ranks",
        "2,4",
        "--budgets",
        "6",
        "--max-new-tokens",
        "2",
        "--oracle-select",
        "20",
        "--orbit",
        "2",
        "--json",
        str(out),
        "--plots",
        str(plots),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["items"] == 2
    assert set(report["reference"]) == {"em", "f1"}
    names = {"blind", "prefix", "patch-r2", "patch-r4", "patch-budget-6", "cacheblend-15", "epic-16"}
    assert names <= set(report["methods"])
    keys = {
        "kl_median",
        "kl_mean",
        "top1",
        "answer_agreement",
        "em",
        "f1",
        "bytes_ratio",
        "apply_ms",
        "fit_ms",
    }
    for m in report["methods"].values():
        assert keys <= set(m)
    assert set(report["canonical"]) == {"after-prefix", "alone"}
    # patches fitted in, and tokens chosen from, the very context served are oracles, reported
    # apart from what deploys
    assert "oracle-select-20" in report["methods"]
    oracles = {n for n in report["methods"] if n.startswith(("patch-", "oracle-"))}
    assert set(report["oracle"]) == oracles
    assert {"prefix", "blind", "cacheblend-15", "epic-16", "orbit-r2", "orbit-r4+cacheblend-15"} <= set(
        report["deployable"]
    )
    assert set(report["deployable"]) | set(report["oracle"]) == set(report["methods"])
    assert all(m["oracle"] == (n in report["oracle"]) for n, m in report["methods"].items())
    assert (plots / "fidelity_pareto.png").is_file()
    assert (plots / "fidelity_deficit.png").is_file()
