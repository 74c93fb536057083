"""Where the real data folder is: ``$KAMERA_DATA``, then ``../shared/data`` beside the working
directory, then ``../shared/data`` beside the installed package.

The first place that is set (the variable) or exists (the folders) wins, and the answer says
which it was, so a benchmark can print where its inputs came from. A ``KAMERA_DATA`` that names a
missing folder is not skipped in favour of another: the user asked for that folder, so the
answer is "no data folder", with the reason.

Not here: reading any data set (``bench/traces_data.py``, ``bench/fidelity_data.py``) or the
data's dev/test halves (the folder's own README).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

ENV_VAR = "KAMERA_DATA"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


class DataFolder(NamedTuple):
    """The data folder that was found, or the reason none was."""

    path: Path | None  # None when no candidate holds a folder
    source: str  # "KAMERA_DATA", "working directory", "package", or "none"
    tried: tuple[Path, ...]  # every candidate looked at, in order

    def describe(self) -> str:
        if self.path is not None:
            return f"data folder: {self.path} (from {self.source})"
        where = ", ".join(str(p) for p in self.tried)
        return f"no data folder: set {ENV_VAR} or place it at ../shared/data (looked at {where})"


def find_data_folder(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> DataFolder:
    """Resolve the data folder; ``env`` and ``cwd`` default to the process's own."""
    env = os.environ if env is None else env
    if env.get(ENV_VAR):
        path = Path(env[ENV_VAR]).expanduser()
        return DataFolder(path if path.is_dir() else None, ENV_VAR if path.is_dir() else "none", (path,))
    candidates = (
        ("working directory", (cwd or Path.cwd()).resolve().parent / "shared" / "data"),
        ("package", PACKAGE_ROOT.parent / "shared" / "data"),
    )
    tried: list[Path] = []
    for source, path in candidates:
        if path in tried:
            continue
        tried.append(path)
        if path.is_dir():
            return DataFolder(path, source, tuple(tried))
    return DataFolder(None, "none", tuple(tried))
