"""Benchmark inputs are a function of their seed: the same seed gives the same inputs, in another
process and under another ``PYTHONHASHSEED``; the ttft session always has chunks left for its
appends; the bench modules import one another in one direction only."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.adapters.base import ChunkInput, TextInput
from bench import ttft
from bench.traces_policies import get_policy

REPO = Path(__file__).resolve().parents[1]


class ByteTokenizer:
    """Text to its UTF-8 bytes (ids 0..255): periodic text gives periodic ids."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}


class TextOnly:
    """What the ttft input builder needs of an adapter, without model weights: a tokenizer, text
    chunks and a content key (the token ids, as the real key is a digest of them)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, ids: Any) -> TextInput:
        return TextInput(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))

    def chunk_key(self, chunk: ChunkInput) -> str:
        return hashlib.sha256(chunk.ids.numpy().tobytes()).hexdigest()


@pytest.fixture
def no_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KAMERA_DATA", str(tmp_path / "absent"))


# --- ttft: the first fill and the chunks left for the appends ----------------------------------


def test_plan_fill_takes_chunks_while_the_question_fits_and_keeps_the_rest() -> None:
    chunks = [(f"c{i}", 100) for i in range(8)]
    fill, rest = ttft.plan_fill(chunks, prefix_tokens=20, question_tokens=10, budget=500)
    assert fill == ["c0", "c1", "c2", "c3"]  # 20 + 400 + 10 <= 500 < 20 + 500 + 10
    assert rest == ["c4", "c5", "c6", "c7"]


def test_plan_fill_refuses_a_pool_with_too_few_chunks_for_the_appends() -> None:
    chunks = [(f"c{i}", 100) for i in range(5)]
    with pytest.raises(ValueError, match="leaving 1 for the session's 2 appends"):
        ttft.plan_fill(chunks, prefix_tokens=20, question_tokens=10, budget=500)
    with pytest.raises(ValueError, match="distinct"):
        ttft.plan_fill([("a", 10), ("a", 10), ("b", 10)], 0, 0, 100)


def test_fallback_text_never_repeats_a_chunk(no_data: None) -> None:
    """The three fallback paragraphs cycled as they are make a periodic token stream, whose
    chunks repeat; the session keeps one of each, so a large window took every distinct chunk
    and the first append popped an empty list. Numbered, no chunk repeats."""
    adapter = TextOnly(ByteTokenizer())
    assert ttft.text_source(None) is None
    period = sum(len((p + "\n").encode()) for p in ttft.FALLBACK_PARAGRAPHS)
    for tokens in (period, period // 2, 256):  # chunks one period long were all the same
        pool = ttft.text_pool(adapter, 60, tokens, None)  # type: ignore[arg-type]
        assert len(pool) == 60
        assert len({adapter.chunk_key(c) for c in pool}) == 60


def test_missing_data_file_is_an_error_not_a_silent_fallback(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        ttft.text_pool(TextOnly(ByteTokenizer()), 4, 256, str(tmp_path / "nope.json"))  # type: ignore[arg-type]


def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from agent.adapters.loading import ModelNotFoundError, embedded_text_model_dir

    try:
        return AutoTokenizer.from_pretrained(embedded_text_model_dir())
    except ModelNotFoundError as e:
        pytest.skip(f"embedded SmolLM2 unavailable: {e}")


@pytest.fixture(scope="module")
def smol_text() -> TextOnly:
    return TextOnly(smollm2_tokenizer())


@pytest.mark.parametrize("data", ["shared", "absent"])
def test_ttft_text_sessions_have_chunks_for_every_append(
    data: str, smol_text: TextOnly, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``kamera bench ttft --sizes 2048,8192``, with the shared data and without it."""
    if data == "absent":
        monkeypatch.setenv("KAMERA_DATA", str(tmp_path / "absent"))
    elif ttft.text_source(None) is None:
        pytest.skip("no shared data folder")
    prefix, question = ttft.text_frame(smol_text)
    for size in (1024, 2048, 8192):
        pool = ttft.text_pool(smol_text, size // 256 + 4, 256, None)  # type: ignore[arg-type]
        inputs, fill, rest = ttft.session_inputs(smol_text, pool, prefix, question, size)  # type: ignore[arg-type]
        assert len(inputs) == len(pool)
        assert len(rest) >= ttft.APPENDS, (size, len(fill), len(rest))
        assert prefix.n_tokens + sum(inputs[i].n_tokens for i in fill) + question.n_tokens <= size


def test_ttft_image_session_has_images_for_every_append() -> None:
    """``--vl-sizes 1024`` on the random-weight Qwen2.5-VL, as ``main`` sizes its pool."""
    from agent.adapters.loading import load_adapter

    vl = load_adapter("tiny:qwen2.5-vl")
    prefix, question = vl.text(torch.arange(5, 25)), vl.text(torch.arange(40, 56))
    per_image = ttft.image_pool(vl, 1, 224)[0].n_tokens
    pool = ttft.image_pool(vl, 1024 // per_image + 4, 224)
    inputs, _, rest = ttft.session_inputs(vl, pool, prefix, question, 1024)
    assert len(inputs) == len(pool)
    assert len(rest) >= ttft.APPENDS
    again = ttft.image_pool(vl, 3, 224, seed=0)
    other = ttft.image_pool(vl, 3, 224, seed=1)
    assert [vl.chunk_key(c) for c in again] == [vl.chunk_key(c) for c in pool[:3]]
    assert [vl.chunk_key(c) for c in other] != [vl.chunk_key(c) for c in again]


# --- the same seed, the same inputs ------------------------------------------------------------


def trace_session() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You book flights."}]
    for i in range(6):
        msgs.append({"role": "user" if i == 0 else "tool", "content": f"observation {i}: seat {i}A"})
        msgs.append({"role": "assistant", "content": f"step {i}"})
    return msgs


def test_rerank_draws_from_its_seed_and_the_other_policies_take_none() -> None:
    msgs = trace_session()
    assert get_policy("rerank", 3)(msgs, 4) == get_policy("rerank", 3)(msgs, 4)
    orders = {json.dumps(get_policy("rerank", s)(msgs, 4)) for s in range(6)}
    assert len(orders) > 1
    assert get_policy("window-3", 7)(msgs, 2) == get_policy("window-3")(msgs, 2)


INPUTS_SCRIPT = r"""
import hashlib, json, sys

import torch

from bench import ttft
from bench.traces_data import data_root, load_sessions
from bench.traces_policies import get_policy
from bench.video_multihop_layout import shuffled_order
from tools.world.render import make_episode

seed = int(sys.argv[1])
out = {}


class Bytes:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


class TextOnly:
    tokenizer = Bytes()

    def text(self, ids):
        return ttft.TextInput(torch.as_tensor(ids, dtype=torch.int64))


def digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


out["ttft_text"] = digest([c.ids.tolist() for c in ttft.text_pool(TextOnly(), 24, 256, None)])
from agent.adapters.loading import load_adapter

vl = load_adapter("tiny:qwen2.5-vl")
out["ttft_images"] = digest([vl.chunk_key(c) for c in ttft.image_pool(vl, 4, 112, seed)])
policies = ["append", "window-6", "dynamic-system", "mask-observations-3", "rerank"]
session = [{"role": "system", "content": "s"}] + [
    {"role": r, "content": f"{r} {i}"} for i in range(5) for r in ("user", "tool", "assistant")
]
out["policies"] = digest([get_policy(p, seed)(session, k) for p in policies for k in range(4)])
if data_root() is not None:
    tau = load_sessions("tau_bench", "dev")[:3]
    out["traces"] = digest(
        [[get_policy(p, seed)(r, k) for k, r in enumerate(s.requests[:6])] for s in tau for p in policies]
    )
episode = make_episode("kamera-world/test/0")
out["video_reorder"] = digest(shuffled_order(episode, seed))
print(json.dumps(out))
"""


def inputs_in_process(seed: int, hash_seed: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", INPUTS_SCRIPT, str(seed)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_the_same_seed_gives_the_same_inputs_under_any_string_hashing() -> None:
    first = inputs_in_process(0, "1")
    second = inputs_in_process(0, "2")
    assert first == second
    other = inputs_in_process(5, "1")
    assert other["ttft_text"] == first["ttft_text"]  # the text is the data's, not drawn
    for key in ("ttft_images", "policies", "video_reorder"):
        assert other[key] != first[key], key


def bench_modules() -> Iterator[tuple[str, Path]]:
    for path in sorted((REPO / "bench").glob("*.py")):
        yield path.stem, path


@pytest.mark.parametrize(
    "module", ["relocation", "ttft", "traces", "video_multihop", "consistency", "replicas"]
)
def test_benchmarks_that_draw_take_a_seed(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    main = importlib.import_module(f"bench.{module}").main
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--seed" in capsys.readouterr().out


def test_bench_modules_import_one_another_in_one_direction() -> None:
    """No import circle among the bench modules, counting imports inside functions."""
    graph: dict[str, set[str]] = {}
    for name, path in bench_modules():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
                deps.add(str(node.module).split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
        graph[name] = deps
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
    assert "consistency" not in graph["peer_llama"]
