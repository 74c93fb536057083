"""Typed window operations: validated when built, parsed from a step request, applied with match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import ValidationError

from agent.server.schemas import StepRequest
from agent.window_ops import Recall, Reorder, Slide, apply


class Recorder:
    """A window that records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def slide(self, n_chunks: int = 1) -> None:
        self.calls.append(("slide", n_chunks))

    def reorder(self, order: Sequence[str]) -> None:
        self.calls.append(("reorder", list(order)))

    def recall(self, chunk_id: str, at: int | None = None) -> None:
        self.calls.append(("recall", chunk_id, at))


def test_each_operation_reaches_its_method_in_order() -> None:
    window = Recorder()
    for op in (Slide(2), Reorder(("b", "a")), Recall("c"), Recall("d", 1), Slide(0)):
        apply(window, op)
    assert window.calls == [
        ("slide", 2),
        ("reorder", ["b", "a"]),
        ("recall", "c", None),
        ("recall", "d", 1),
        ("slide", 0),
    ]


def test_anything_else_is_refused() -> None:
    window = Recorder()
    with pytest.raises(TypeError, match="not a window operation"):
        apply(window, ("slide", 1))  # type: ignore[arg-type]
    assert window.calls == []


@pytest.mark.parametrize(
    "build",
    [
        lambda: Slide(-1),
        lambda: Slide(True),
        lambda: Recall(""),
        lambda: Recall("x", 0),
        lambda: Reorder((1,)),  # type: ignore[arg-type]
    ],
    ids=["negative slide", "boolean slide", "empty chunk id", "recall onto the prefix", "non-string id"],
)
def test_invalid_operations_fail_on_construction(build: Any) -> None:
    with pytest.raises(ValueError, match=r"slide|recall|reorder"):
        build()


def test_operations_are_frozen_values() -> None:
    op = Reorder(["a", "b"])  # type: ignore[arg-type]
    assert op.order == ("a", "b")
    assert op == Reorder(("a", "b"))
    with pytest.raises(AttributeError):
        op.order = ("c",)  # type: ignore[misc]


def test_a_step_request_parses_into_typed_operations() -> None:
    body = StepRequest.model_validate(
        {
            "instruction": "go",
            "operations": [
                {"op": "slide"},
                {"op": "slide", "n": 3},
                {"op": "reorder", "order": ["b", "a"]},
                {"op": "recall", "chunk_id": "c", "at": 2},
                {"op": "recall", "chunk_id": "d"},
            ],
        }
    )
    assert [op.typed() for op in body.operations] == [
        Slide(1),
        Slide(3),
        Reorder(("b", "a")),
        Recall("c", 2),
        Recall("d", None),
    ]


@pytest.mark.parametrize(
    "op",
    [
        {"op": "slide", "n": -1},
        {"op": "recall", "chunk_id": "c", "at": 0},
        {"op": "shuffle"},
        {"op": "slide", "n": "2"},
    ],
)
def test_a_bad_operation_is_a_validation_error(op: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        StepRequest.model_validate({"instruction": "go", "operations": [op]})
