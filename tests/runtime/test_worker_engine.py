"""The runtime worker's engine choice: ``runtime.engine`` / ``--engine`` and the ledger directory,
validated at start-up with errors naming the key at fault."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from flexpipe.config import load_config
from flexpipe.errors import ConfigError
from runtime.engines import ledger_path, worker_engines
from runtime.flags import add_arguments, with_flags

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_sim_engine_is_the_default_and_needs_no_ledger() -> None:
    cfg = with_flags(load_config(env={}), _args())
    assert cfg.runtime.engine == "sim" and cfg.runtime.ledger_dir is None
    assert worker_engines(cfg.runtime, ["d"]).factories is None


def test_flags_set_the_runtime_keys(tmp_path: Path) -> None:
    cfg = with_flags(load_config(env={}), _args("--engine", "torch", "--ledger-dir", str(tmp_path)))
    assert cfg.runtime.engine == "torch" and cfg.runtime.ledger_dir == tmp_path


@pytest.mark.parametrize(
    ("argv", "env", "key"),
    [
        (["--engine", "torch"], {}, "runtime.ledger_dir: required with engine torch"),
        (["--ledger-dir", "/tmp/l"], {}, "runtime.ledger_dir: only engine torch"),
        ([], {"FLEXPIPE_RUNTIME__ENGINE": "gpu"}, "runtime.engine: Input should be"),
        ([], {"FLEXPIPE_RUNTIME__ENGINE": "torch"}, "runtime.ledger_dir: required"),
    ],
)
def test_a_bad_engine_setting_names_its_key(argv: list[str], env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key {key}"):
        with_flags(load_config(env=env), _args(*argv))


def test_an_error_from_flags_names_the_flags_given() -> None:
    with pytest.raises(ConfigError, match=r"\(flags given: --engine\)$"):
        with_flags(load_config(env={}), _args("--engine", "torch"))


def test_an_unwritable_ledger_dir_is_refused_at_start_up(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = with_flags(load_config(env={}), _args("--engine", "torch", "--ledger-dir", str(blocker)))
    with pytest.raises(ConfigError, match=r"config key runtime\.ledger_dir: .*file"):
        worker_engines(cfg.runtime, ["d"])


def test_one_ledger_file_per_deployment_whatever_its_name(tmp_path: Path) -> None:
    assert ledger_path(tmp_path, "chat-7b") == tmp_path / "chat-7b.ledger"
    assert ledger_path(tmp_path, "a/b").parent == tmp_path


def test_flexpipe_runtime_takes_the_engine_flags(tmp_path: Path) -> None:
    from flexpipe.cli import build_parser

    args = build_parser().parse_args(
        ["runtime", "--engine", "torch", "--ledger-dir", str(tmp_path)]
    )
    cfg = with_flags(load_config(env={}), args)
    assert cfg.runtime.engine == "torch" and cfg.runtime.ledger_dir is not None
