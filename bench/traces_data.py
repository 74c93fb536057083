"""Real agent traffic for the reuse benchmark: the trace sets as sessions of requests.

A trajectory becomes a session of requests: request k is the full message list the agent sent
for its k-th model call. Readers for tau-bench airline, SWE-agent, mini-swe-agent (with the
provider's reported prefix-cache usage) and a plain JSONL of sessions.

Data live in the folder ``tools.data.find_data_folder`` resolves (``$KAMERA_DATA``, then
``../shared/data`` beside the working directory, then beside the package); the dev/test halves
follow that folder's README. This module never copies the data.

Not here: context policies (``traces_policies.py``), tokenizing (``traces_tokens.py``), the
replay (``traces_replay.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from tools.data import find_data_folder

Message = dict[str, Any]


Split = Literal["dev", "test", "all"]


def data_root() -> Path | None:
    """The data folder ``tools.data.find_data_folder`` resolves, None if there is none."""
    return find_data_folder().path


class Session(NamedTuple):
    id: str
    requests: tuple[list[Message], ...]  # each the full message list of one model call


def session_from_trajectory(session_id: str, messages: Sequence[Message]) -> Session:
    """One request per assistant message: the messages before it."""
    return Session(
        session_id, tuple(list(messages[:i]) for i, m in enumerate(messages) if m.get("role") == "assistant")
    )


def _in_split(split: Split, dev: bool) -> bool:
    if split not in ("dev", "test", "all"):
        raise ValueError(f"split must be dev, test or all, got {split!r}")
    return split == "all" or dev == (split == "dev")


def load_tau_bench(path: Path, split: Split = "all") -> list[Session]:
    """tau-bench airline trajectories; dev: ``task_id < 25``."""
    items = json.loads(path.read_text())
    return [
        session_from_trajectory(f"tau-{it['task_id']}-{it['trial']}", it["traj"])
        for it in items
        if _in_split(split, it["task_id"] < 25)
    ]


def _sorted_files(folder: Path, pattern: str, split: Split) -> list[Path]:
    return [p for i, p in enumerate(sorted(folder.glob(pattern))) if _in_split(split, i % 2 == 0)]


def load_swe_agent(folder: Path, split: Split = "all") -> list[Session]:
    """SWE-agent ``.traj`` histories; dev: files at even sorted positions.

    Old-format histories send observations as user messages after the first assistant one;
    those are marked ``observation: True`` so policies can find them.
    """
    out = []
    for p in _sorted_files(folder, "*.traj", split):
        history = [dict(m) for m in json.loads(p.read_text())["history"]]
        seen_assistant = False
        for m in history:
            if m.get("role") == "user" and seen_assistant:
                m["observation"] = True
            seen_assistant = seen_assistant or m.get("role") == "assistant"
        out.append(session_from_trajectory(f"swe-{p.stem}", history))
    return out


def load_mini_swe_agent(folder: Path, split: Split = "all") -> list[Session]:
    """mini-swe-agent runs; dev: files at even sorted positions. The final ``exit`` record is
    not a message sent to the model and is dropped."""
    out = []
    for p in _sorted_files(folder, "*.traj.json", split):
        msgs = [m for m in json.loads(p.read_text())["messages"] if m.get("role") != "exit"]
        out.append(session_from_trajectory(f"mini-{p.name.removesuffix('.traj.json')}", msgs))
    return out


def load_jsonl(path: Path) -> list[Session]:
    """Lines of ``{"id": str, "turns": [[message, ...], ...]}``, each turn a full prompt."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec.get("id"), str) or not isinstance(rec.get("turns"), list):
            raise ValueError(f"{path}:{n}: need an 'id' string and a 'turns' list")
        out.append(Session(rec["id"], tuple(list(t) for t in rec["turns"])))
    return out


def mini_swe_agent_usage(folder: Path, split: Split = "all") -> list[tuple[int, int]]:
    """``(prompt_tokens, cached_tokens)`` the provider reported for each model call of the
    mini-swe-agent runs (DeepSeek's own prefix cache), same files and split as the loader."""
    out = []
    for p in _sorted_files(folder, "*.traj.json", split):
        for m in json.loads(p.read_text())["messages"]:
            usage = (
                ((m.get("extra") or {}).get("response") or {}).get("usage")
                if m.get("role") == "assistant"
                else None
            )
            if usage and usage.get("prompt_tokens"):
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                out.append((int(usage["prompt_tokens"]), int(cached)))
    return out


SOURCES: dict[str, Callable[[Path, Split], list[Session]]] = {
    "tau_bench": lambda root, s: load_tau_bench(root / "agent_traces" / "tau_bench_gpt-4o-airline.json", s),
    "swe_agent": lambda root, s: load_swe_agent(root / "agent_traces" / "swe_agent", s),
    "mini_swe_agent": lambda root, s: load_mini_swe_agent(
        root / "agent_traces" / "mini_swe_agent_deepseek", s
    ),
}


def load_sessions(source: str, split: Split = "dev", root: Path | None = None) -> list[Session]:
    """Sessions of a named source (see ``SOURCES``) or of a ``.jsonl`` path."""
    if source.endswith(".jsonl"):
        return load_jsonl(Path(source))
    root = root or data_root()
    if root is None:
        raise FileNotFoundError(find_data_folder().describe())
    if source not in SOURCES:
        raise KeyError(f"unknown source {source!r}; known: {sorted(SOURCES)} or a .jsonl path")
    return SOURCES[source](root, split)
