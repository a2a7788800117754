"""Where a stream worker's Faust app keeps its local files."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.config import load_config
from streams.app import _data_dir


@pytest.mark.unit
def test_no_data_dir_left_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = Path(_data_dir(load_config(env={})))
    assert path.is_dir()
    assert tmp_path not in path.parents  # a temporary directory, removed at exit
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_configured_data_dir_is_used(tmp_path: Path) -> None:
    where = tmp_path / "faust"
    cfg = load_config(env={"FLEXPIPE_STREAMS__DATA_DIR": str(where)})
    assert _data_dir(cfg) == str(where)
