"""Tests of tools/data: which data folder is used, and what is said when there is none."""

from __future__ import annotations

from pathlib import Path

from tools.data import PACKAGE_ROOT, find_data_folder


def test_the_variable_wins_over_the_folders(tmp_path: Path) -> None:
    (tmp_path / "shared" / "data").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    found = find_data_folder({"KAMERA_DATA": str(mine)}, cwd=tmp_path / "work")
    assert found.path == mine
    assert found.source == "KAMERA_DATA"
    assert found.describe() == f"data folder: {mine} (from KAMERA_DATA)"


def test_a_missing_variable_folder_is_not_replaced_by_another(tmp_path: Path) -> None:
    (tmp_path / "shared" / "data").mkdir(parents=True)
    found = find_data_folder({"KAMERA_DATA": str(tmp_path / "absent")}, cwd=tmp_path / "work")
    assert found.path is None
    assert "KAMERA_DATA" in found.describe()
    assert str(tmp_path / "absent") in found.describe()


def test_beside_the_working_directory_before_the_package(tmp_path: Path) -> None:
    data = tmp_path / "shared" / "data"
    data.mkdir(parents=True)
    (tmp_path / "work").mkdir()
    found = find_data_folder({}, cwd=tmp_path / "work")
    assert found.path == data
    assert found.source == "working directory"


def test_beside_the_package_when_the_working_directory_has_none(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    found = find_data_folder({}, cwd=tmp_path / "work")
    beside_package = PACKAGE_ROOT.parent / "shared" / "data"
    assert found.tried == (tmp_path / "shared" / "data", beside_package)
    if beside_package.is_dir():
        assert (found.path, found.source) == (beside_package, "package")
    else:
        assert (found.path, found.source) == (None, "none")
        assert "looked at" in found.describe()
