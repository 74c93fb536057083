"""Items for the fidelity benchmark: a question over an ordered list of text chunks.

Readers (all give :class:`QAItem`):

- JSONL, one item a line: ``{"id": str, "chunks": [str, ...], "question": str, "answer": str | null}``
  (``"answers": [str, ...]`` is also read);
- the multi-hop QA sets of ``shared/data/multihop_qa`` (each a JSON list):
  ``cacheblend_musique_s_*.json`` (``{question, answers, ctxs: [{title, text}]}``, retrieval
  order), ``hipporag_musique_*.json`` (``paragraphs`` with ``is_supporting``) and
  ``hipporag_hotpotqa_*.json`` (``context: [[title, [sentences]]]``, ``supporting_facts``).
  For the two HippoRAG sets ``max_chunks`` keeps every supporting paragraph and fills up with
  distractors, in the set's own order; CacheBlend's set keeps the first ``max_chunks`` passages.
- a folder: every ``*.json`` / ``*.jsonl`` in it, sorted by name.

Splits follow ``shared/data/README.md``: dev = even indices, test = odd indices, ``all`` keeps
both (a JSONL file's lines are indexed the same way).

Not here: tokenising or truncating chunks (the benchmark does it with the model's tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Split = Literal["dev", "test", "all"]


@dataclass(frozen=True)
class QAItem:
    """One question over ordered chunks; ``answers`` empty when no gold answer is given."""

    id: str
    chunks: tuple[str, ...]
    question: str
    answers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError(f"item {self.id!r} has no chunks")


def in_split(index: int, split: Split) -> bool:
    if split not in ("dev", "test", "all"):
        raise ValueError(f"split must be 'dev', 'test' or 'all', got {split!r}")
    return split == "all" or (index % 2 == 0) == (split == "dev")


def _answers(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    return tuple(str(a) for a in raw)


def _keep(texts: list[str], supporting: list[bool], max_chunks: int | None) -> tuple[str, ...]:
    """All supporting texts plus the first distractors up to ``max_chunks``, in order."""
    if max_chunks is None or len(texts) <= max_chunks:
        return tuple(texts)
    room = max(0, max_chunks - sum(supporting))
    kept = []
    for text, gold in zip(texts, supporting, strict=True):
        if gold:
            kept.append(text)
        elif room:
            kept.append(text)
            room -= 1
    return tuple(kept[:max_chunks]) if len(kept) > max_chunks else tuple(kept)


def _cacheblend(raw: dict[str, Any], index: int, max_chunks: int | None) -> QAItem:
    ctxs = raw["ctxs"][:max_chunks] if max_chunks else raw["ctxs"]
    texts = [f"{c['title']}\n{c['text']}" if c.get("title") else c["text"] for c in ctxs]
    return QAItem(f"cacheblend-{index}", tuple(texts), raw["question"], _answers(raw["answers"]))


def _hipporag_musique(raw: dict[str, Any], index: int, max_chunks: int | None) -> QAItem:
    paragraphs = raw["paragraphs"]
    texts = [f"{p['title']}\n{p['paragraph_text']}" for p in paragraphs]
    gold = [bool(p.get("is_supporting")) for p in paragraphs]
    answers = (raw["answer"], *raw.get("answer_aliases", []))
    return QAItem(str(raw.get("id", index)), _keep(texts, gold, max_chunks), raw["question"], answers)


def _hipporag_hotpotqa(raw: dict[str, Any], index: int, max_chunks: int | None) -> QAItem:
    titles = {t for t, _ in raw.get("supporting_facts", [])}
    texts = [f"{title}\n{''.join(sentences)}" for title, sentences in raw["context"]]
    gold = [title in titles for title, _ in raw["context"]]
    return QAItem(
        str(raw.get("_id", index)), _keep(texts, gold, max_chunks), raw["question"], _answers(raw["answer"])
    )


def _jsonl(raw: dict[str, Any], index: int, max_chunks: int | None) -> QAItem:
    chunks = list(raw["chunks"])[:max_chunks] if max_chunks else list(raw["chunks"])
    answers = _answers(raw["answers"]) if "answers" in raw else _answers(raw.get("answer"))
    return QAItem(str(raw.get("id", index)), tuple(chunks), raw["question"], answers)


def _reader(raw: dict[str, Any]) -> Any:
    if "ctxs" in raw:
        return _cacheblend
    if "paragraphs" in raw:
        return _hipporag_musique
    if "context" in raw and "supporting_facts" in raw:
        return _hipporag_hotpotqa
    if "chunks" in raw:
        return _jsonl
    raise ValueError(f"unrecognised item with keys {sorted(raw)}")


def _records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of items")
    return data


def load_items(
    path: str | Path, split: Split = "all", max_chunks: int | None = None, limit: int | None = None
) -> list[QAItem]:
    """Items of a JSONL file, a multi-hop JSON list, or every such file in a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no data at {path}")
    items: list[QAItem] = []
    for file in files:
        for item in _iter_file(file, split, max_chunks):
            items.append(item)
            if limit is not None and len(items) >= limit:
                return items
    return items


def _iter_file(path: Path, split: Split, max_chunks: int | None) -> Iterator[QAItem]:
    for index, raw in enumerate(_records(path)):
        if in_split(index, split):
            yield _reader(raw)(raw, index, max_chunks)
