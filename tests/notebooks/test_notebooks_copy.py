"""``hpc-horovod notebooks copy``: where the notebooks go, and never over a user's file."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from hpc_horovod import cli
from hpc_horovod.notebooks_cli import copy_notebooks, shipped_notebooks

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"  # the single source
NAMES = ["data_parallel_keras.ipynb", "data_parallel_pytorch.ipynb"]


def test_both_notebooks_ship_and_are_valid():
    assert [nb.name for nb in shipped_notebooks()] == NAMES
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert not any(cell.get("outputs") for cell in nb.cells), f"{name} is stored executed"


def test_copy_to_explicit_destination_creates_it(tmp_path):
    dest = tmp_path / "a" / "b"
    written = copy_notebooks(dest)
    assert [p.name for p in written] == NAMES
    for name in NAMES:
        assert (dest / name).read_bytes() == (NOTEBOOKS / name).read_bytes()


def test_default_is_work(tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "cwd"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("WORK", str(work))
    monkeypatch.chdir(elsewhere)
    assert cli.main(["notebooks", "copy"]) == 0
    assert capsys.readouterr().out.split() == [str(work / name) for name in NAMES]
    assert sorted(p.name for p in work.iterdir()) == NAMES
    assert list(elsewhere.iterdir()) == []


def test_without_work_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WORK", raising=False)
    monkeypatch.chdir(tmp_path)
    copy_notebooks()
    assert sorted(p.name for p in tmp_path.iterdir()) == NAMES


def test_work_that_does_not_exist_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORK", str(tmp_path / "missing"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["notebooks", "copy"]) == 2
    err = capsys.readouterr().err
    assert f"WORK={tmp_path / 'missing'} is not a directory" in err
    assert "hpc-horovod notebooks copy DEST" in err
    assert list(tmp_path.iterdir()) == []


def test_existing_files_are_listed_and_nothing_is_written(tmp_path, capsys):
    mine = tmp_path / NAMES[1]
    mine.write_text("my edits")
    assert cli.main(["notebooks", "copy", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not overwriting" in err and str(mine) in err and "--force" in err
    assert str(tmp_path / NAMES[0]) not in err
    assert mine.read_text() == "my edits"
    assert not (tmp_path / NAMES[0]).exists()  # all or nothing


def test_force_replaces(tmp_path):
    for name in NAMES:
        (tmp_path / name).write_text("old")
    with pytest.raises(FileExistsError) as info:
        copy_notebooks(tmp_path)
    assert all(str(tmp_path / name) in str(info.value) for name in NAMES)
    assert cli.main(["notebooks", "copy", str(tmp_path), "--force"]) == 0
    for name in NAMES:
        assert (tmp_path / name).read_bytes() == (NOTEBOOKS / name).read_bytes()
