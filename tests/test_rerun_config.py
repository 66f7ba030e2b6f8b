"""Rerunning a run's saved ``config.yaml`` with Hydra's ``--config-dir RUN_DIR``: Hydra only
added the directory to its search path, after accelopt's own configs, whose primary config
is also named ``config``, so the packaged default ran instead, exit 0
(``accelopt.cli.main.primary_config_flags``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import accelopt_in_process

from accelopt.cli.main import hydra_overrides, primary_config_flags

RUN_DIR = "hydra.run.dir=runs/${now:%Y-%m-%d}/${now:%H-%M-%S-%f}"
SWEEP_DIR = "hydra.sweep.dir=runs/multirun/${now:%Y-%m-%d}/${now:%H-%M-%S-%f}"
JOB_NAME = "hydra.job.name=accelopt"


def _saved(directory: Path, name: str = "config.yaml", text: str = "run:\n  seed: 0\n") -> Path:
    """A directory holding a primary config as a run directory holds its config.yaml."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory


def test_a_config_dir_holding_the_primary_config_is_read_as_the_primary(tmp_path):
    run = _saved(tmp_path / "r_none")
    assert primary_config_flags(["--config-dir", str(run), "run.seed=1"]) == [
        "--config-path", str(run), "run.seed=1", RUN_DIR, JOB_NAME]
    # not added to the search path for the checks composed before Hydra
    assert hydra_overrides(primary_config_flags(["--config-dir", str(run)])) == [
        RUN_DIR, JOB_NAME]


@pytest.mark.parametrize("flags", [["-cd", "r_none"], ["--config-dir=r_none"],
                                   ["-cd", "r_none", "-cn", "config.yaml"]])
def test_each_spelling_of_the_flag_with_a_relative_directory(tmp_path, monkeypatch, flags):
    run = _saved(tmp_path / "r_none")
    monkeypatch.chdir(tmp_path)
    rewritten = primary_config_flags([*flags, "hydra.run.dir=out"])
    joined = "=" in flags[0]
    assert rewritten[:1 if joined else 2] == (
        [f"--config-path={run}"] if joined else ["--config-path", str(run)])
    assert rewritten[-2:] == ["hydra.run.dir=out", JOB_NAME]  # the line's run.dir kept


def test_a_config_name_of_its_own_in_the_directory(tmp_path):
    run = _saved(tmp_path / "mine", "exp.yaml")
    assert primary_config_flags(["--config-dir", str(run), "--config-name", "exp"])[:2] == [
        "--config-path", str(run)]
    # the directory holds no exp2.yaml: a search-path addition, as Hydra has it
    line = ["--config-dir", str(run), "--config-name", "exp2"]
    assert primary_config_flags(line) == line


def test_a_directory_of_config_groups_stays_a_search_path_addition(tmp_path):
    groups = _saved(tmp_path / "cfg" / "workload", "mine.yaml").parent
    line = ["--config-dir", str(groups), "workload=mine"]
    assert primary_config_flags(line) == line
    assert hydra_overrides(line)[-1] == f"hydra.searchpath=[file://{groups}]"


def test_a_config_path_given_keeps_the_config_dir_an_addition(tmp_path):
    primary = _saved(tmp_path / "p", text="hydra:\n  run:\n    dir: here\n")
    run = _saved(tmp_path / "r_none")
    line = ["--config-path", str(primary), "--config-dir", str(run)]
    assert primary_config_flags(line) == line  # its own hydra: section: nothing added


def test_a_relative_config_path_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    """Hydra took a relative --config-path from accelopt's package: "no such directory"."""
    run = _saved(tmp_path / "r_none")
    monkeypatch.chdir(tmp_path)
    assert primary_config_flags(["-m", "-cp", "r_none", "run.seed=0,1"]) == [
        "-m", "--config-path", str(run), "run.seed=0,1", SWEEP_DIR, JOB_NAME]
    assert primary_config_flags(["--config-path", "pkg://somewhere"]) == [
        "--config-path", "pkg://somewhere"]


def test_cfg_job_with_config_dir_prints_the_directorys_config(tmp_path, capfd):
    """The outside user's line: `--config-dir RUN_DIR` printed (and ran) the packaged
    default, cluster.mode ps and the default workload."""
    run = _saved(tmp_path / "r_none", text=(
        "cluster:\n  mode: none\nworkload:\n  name: rerun-me\n  jobs:\n"
        "  - {name: only, model: mlp, iterations: 2, batch_size: 8, width: 8}\n"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = accelopt_in_process("run", "--cfg", "job", "--config-dir", str(run),
                                 cwd=cwd, capfd=capfd)
    assert result.returncode == 0, result.stderr
    assert "mode: none" in result.stdout and "name: rerun-me" in result.stdout
    assert "mode: ps" not in result.stdout and "name: default" not in result.stdout
    assert list(cwd.iterdir()) == []  # printed, nothing run
