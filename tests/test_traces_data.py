from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from bench.traces_data import Session, data_root, load_jsonl, load_sessions, session_from_trajectory
from bench.traces_policies import get_policy, turn_starts
from bench.traces_replay import NgramOracle, evaluate, replay_session
from bench.traces_tokens import (
    MESSAGE_END,
    MessageTokenizer,
    body_cuts,
    message_body,
    message_header,
    message_parts,
    render_message,
    word_encode,
)
from cache.cdc import CDCConfig
from cache.planner import PlannerConfig


def words(tag: str, n: int) -> str:
    """n distinct words, none shared with another tag."""
    return " ".join(f"{tag}{i}" for i in range(n))


def conversation() -> list[dict[str, object]]:
    msgs: list[dict[str, object]] = [{"role": "system", "content": words("sys", 150)}]
    msgs.append({"role": "user", "content": words("task", 40)})
    for t in range(5):
        msgs.append({"role": "assistant", "content": words(f"a{t}x", 20 + 7 * t)})
        msgs.append({"role": "tool", "content": words(f"o{t}x", 60 + 11 * t)})
    msgs.append({"role": "assistant", "content": "done"})
    return msgs


def fake_encode(text: str) -> list[int]:
    """One id per whitespace-separated word (tokenizer-agnostic stand-in)."""
    return [zlib.crc32(w.encode()) % 40_000 for w in text.split()]


def test_tokenizer_reports_message_starts_and_body_bounds() -> None:
    tok = MessageTokenizer(fake_encode)
    msgs = conversation()[:3]
    out = tok(msgs)
    # header, body and end marker of each message, each tokenized on its own
    parts = [len(fake_encode(t)) for m in msgs for t in (message_header(m), message_body(m), MESSAGE_END)]
    assert parts[:3] == [1, 150, 1]
    bounds = np.cumsum([0, *parts]).tolist()
    assert out.message_starts == tuple(bounds[0:-1:3])
    assert out.boundaries == tuple(bounds[:-1])
    assert len(out.ids) == bounds[-1]
    empty = tok([{"role": "assistant", "content": ""}])
    assert empty.boundaries == (0, 1)  # an empty body: no chunk of zero tokens
    call = {"role": "assistant", "content": "a b", "tool_calls": [{"id": "c1", "type": "function"}]}
    out = tok([call])
    lengths = [len(fake_encode(t)) for t in message_parts(call)]
    assert out.boundaries == tuple(np.cumsum([0, *lengths[:-1]]).tolist())
    assert out.message_starts == (0,)
    assert render_message({"role": "assistant", "content": None, "tool_calls": [{"a": 1}]}) == (
        '<|im_start|>assistant\n\n<tool_call>[{"a": 1}]</tool_call><|im_end|>\n'
    )
    assert word_encode("ab, cd") == word_encode("ab, cd")
    assert len(word_encode("ab, cd")) == 4  # "ab" "," " " "cd"


def test_message_parts_cut_tool_calls_around_their_free_fields() -> None:
    args = json.dumps({"command": 'grep -n "x" a.py'})
    m = {
        "role": "assistant",
        "content": "Look.",
        "tool_calls": [{"function": {"arguments": args, "name": "bash"}, "id": "call_7", "type": "function"}],
    }
    body = message_body(m)
    parts = message_parts(m)
    assert "".join(parts) == render_message(m)
    assert parts[0] == "<|im_start|>assistant\n"
    assert parts[-1] == MESSAGE_END
    assert parts[1:-1] == [
        "Look.",
        '\n<tool_call>[{"function": {"arguments": "',
        json.dumps(args)[1:-1],  # the arguments string as it sits inside the JSON
        '", "name": "bash"}, "id": "',
        "call_7",
        '", "type": "function"}]</tool_call>',
    ]
    assert body_cuts(body) == sorted(body_cuts(body))
    assert body_cuts("plain text") == []
    # no content: the body starts with the tool calls, and no empty piece is made
    assert message_parts({**m, "content": None})[1].startswith("\n<tool_call>")
    # a quote inside the arguments never ends the field early
    assert json.dumps(args)[1:-1] in parts


def test_session_has_one_request_per_assistant_message() -> None:
    s = session_from_trajectory("x", conversation())
    assert len(s.requests) == 6
    assert [len(r) for r in s.requests] == [2, 4, 6, 8, 10, 12]
    assert turn_starts(s.requests[-1]) == [1, 2, 4, 6, 8, 10]


def test_policies() -> None:
    msgs = session_from_trajectory("x", conversation()).requests[-1]  # 12 messages
    win = get_policy("window-2")(msgs, 5)
    assert win == [msgs[0], *msgs[8:]]
    dyn = get_policy("dynamic-system")(msgs, 3)
    assert dyn[0]["content"].startswith("Current time: 2024-05-15 15:01:51. Step 3.\n\n")
    assert dyn[1:] == msgs[1:]
    assert get_policy("dynamic-system")([{"role": "user", "content": "hi"}], 0)[0]["role"] == "system"
    masked = get_policy("mask-observations-2")(msgs, 5)
    stubbed = [i for i, (a, b) in enumerate(zip(msgs, masked, strict=True)) if a != b]
    assert stubbed == [3, 5, 7]  # tool outputs of turns older than the last two
    assert masked[3]["content"] == "[output omitted: 1 lines]"
    r1, r2 = get_policy("rerank")(msgs, 1), get_policy("rerank")(msgs, 2)
    obs = [3, 5, 7, 9, 11]
    assert [m for i, m in enumerate(r1) if i not in obs] == [m for i, m in enumerate(msgs) if i not in obs]
    assert sorted(str(r1[i]["content"]) for i in obs) == sorted(str(msgs[i]["content"]) for i in obs)
    assert r1 != r2
    assert r1 == get_policy("rerank")(msgs, 1)
    assert get_policy("append")(msgs, 0) == msgs
    with pytest.raises(KeyError, match="unknown policy"):
        get_policy("shuffle-3")


def test_oracle_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 5, 300)
    b = np.concatenate([rng.integers(0, 5, 40), a[100:180], rng.integers(0, 5, 50), a[:20]])
    n = 16
    o = NgramOracle(n)
    assert o.covered(a) == 0
    o.add(a)
    seen = {tuple(a[i : i + n]) for i in range(len(a) - n + 1)}
    cov = np.zeros(len(b), bool)
    for i in range(len(b) - n + 1):
        if tuple(b[i : i + n]) in seen:
            cov[i : i + n] = True
    assert o.covered(b) == int(cov.sum())
    assert o.covered(a) == len(a)


CFG = PlannerConfig(cdc=CDCConfig(min_size=8, avg_size=32, max_size=128))


def seen_part_tokens(requests: list[list[dict[str, object]]]) -> list[int]:
    """Per request, tokens of the message headers, bodies and end markers seen in an earlier one."""
    seen: set[str] = set()
    out = []
    for msgs in requests:
        parts = [t for m in msgs for t in message_parts(m)]
        out.append(sum(len(fake_encode(t)) for t in parts if t in seen))
        seen |= set(parts)
    return out


def test_replay_append_reuses_the_previous_prompt_and_known_headers() -> None:
    tok = MessageTokenizer(fake_encode)
    s = session_from_trajectory("x", conversation())
    stats = replay_session(s, get_policy("append"), tok, CFG)
    lengths = [len(tok(r).ids) for r in s.requests]
    assert [r.n_tokens for r in stats] == lengths
    assert [r.prefix for r in stats] == [0, *lengths[:-1]]
    # new messages share no words, but their role headers and end markers are chunks of their
    # own, found by content when an earlier request held the same one
    assert [r.content for r in stats] == seen_part_tokens(list(s.requests))
    assert [r.content - r.prefix for r in stats] == [0, 2, 4, 4, 4, 4]
    assert all(r.oracle >= r.prefix for r in stats)


def test_replay_window_recovers_every_previously_seen_message() -> None:
    tok = MessageTokenizer(fake_encode)
    s = session_from_trajectory("x", conversation())
    policy = get_policy("window-2")
    stats = replay_session(s, policy, tok, CFG)
    want = seen_part_tokens([policy(req, step) for step, req in enumerate(s.requests)])
    assert [st.content for st in stats] == want
    res = evaluate([s], ["append", "window-2"], tok, CFG)
    assert [r.policy for r in res] == ["append", "window-2"]
    win = res[1]
    assert win.prompt_tokens == sum(r.n_tokens for r in stats)
    assert win.content_hit_rate == pytest.approx(sum(r.content for r in stats) / win.prompt_tokens)
    assert win.prefix_hit_rate < win.content_hit_rate
    assert win.recovered_of_oracle == pytest.approx(
        (win.content_hit_rate - win.prefix_hit_rate) / (win.oracle_hit_rate - win.prefix_hit_rate)
    )
    assert math.isnan(res[0].recovered_of_oracle) or res[0].recovered_of_oracle <= 1.0


def test_masked_observation_keeps_its_header_and_end_marker_reusable() -> None:
    tok = MessageTokenizer(fake_encode)
    s = session_from_trajectory("x", conversation())
    policy = get_policy("mask-observations-1")
    stats = replay_session(s, policy, tok, CFG)
    requests = [policy(req, step) for step, req in enumerate(s.requests)]
    assert [st.content for st in stats] == seen_part_tokens(requests)
    # reusing whole seen messages only (no cut inside a message) would miss the new stubs' and
    # new messages' headers and end markers
    seen: set[str] = set()
    whole = 0
    for msgs in requests:
        whole += sum(len(fake_encode(render_message(m))) for m in msgs if render_message(m) in seen)
        seen |= {render_message(m) for m in msgs}
    assert sum(st.content for st in stats) > whole


def test_jsonl_and_data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "t.jsonl"
    turns = [
        [{"role": "user", "content": "a"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    ]
    p.write_text(json.dumps({"id": "s1", "turns": turns}) + "\n\n")
    assert load_jsonl(p) == [Session("s1", tuple(turns))]
    assert load_sessions(str(p)) == load_jsonl(p)
    p.write_text(json.dumps({"turns": []}))
    with pytest.raises(ValueError, match="'id'"):
        load_jsonl(p)
    monkeypatch.setenv("KAMERA_DATA", str(tmp_path))
    assert data_root() == tmp_path
    monkeypatch.setenv("KAMERA_DATA", str(tmp_path / "absent"))
    assert data_root() is None
    with pytest.raises(FileNotFoundError, match="KAMERA_DATA"):
        load_sessions("tau_bench")


@pytest.fixture
def root() -> Path:
    r = data_root()
    if r is None or not (r / "agent_traces").is_dir():
        pytest.skip("shared data folder absent (../shared/data or $KAMERA_DATA): real-trace tests skipped")
    return r


def test_real_trace_splits(root: Path) -> None:
    dev, test = load_sessions("tau_bench", "dev", root), load_sessions("tau_bench", "test", root)
    assert (len(dev), len(test)) == (100, 100)
    assert all(int(s.id.split("-")[1]) < 25 for s in dev)
    assert all(int(s.id.split("-")[1]) >= 25 for s in test)
    first = dev[0].requests[0]
    assert first[0]["role"] == "system"
    assert first[-1]["role"] != "assistant"
    for source, n in [("swe_agent", 22), ("mini_swe_agent", 20)]:
        d, t = load_sessions(source, "dev", root), load_sessions(source, "test", root)
        assert (len(d), len(t)) == (n // 2, n // 2)
        assert not {s.id for s in d} & {s.id for s in t}
        assert len(load_sessions(source, "all", root)) == n
    swe = load_sessions("swe_agent", "all", root)
    assert any(m.get("observation") for s in swe for m in s.requests[-1])
    with pytest.raises(ValueError, match="split"):
        load_sessions("tau_bench", "train", root)  # type: ignore[arg-type]


def test_real_trace_content_beats_prefix_under_window(root: Path) -> None:
    s = load_sessions("tau_bench", "dev", root)[:2]
    res = {r.policy: r for r in evaluate(s, ["append", "window-4"], MessageTokenizer(word_encode), CFG)}
    assert res["append"].prefix_hit_rate > 0.8
    assert res["window-4"].content_hit_rate > res["window-4"].prefix_hit_rate + 0.1
    assert res["window-4"].content_hit_rate <= 1.0
