"""``sweep.json`` (``accelopt/cli/sweep_summary.py``) agrees with the sweep's exit code and
lines however the sweep ends: a packed execution that failed or was stopped, a disk that
filled up between two points; and a directory named with brackets is shown as it is."""

from __future__ import annotations

import errno
import json

import pytest
from clirun import accelopt_in_process, sweep_in_process

pytestmark = pytest.mark.timeout(180)
TINY = ["workload=tiny", "cluster.mode=none", "run.progress=false", "run.threads=1"]
PACKED = ["hydra/launcher=salus", "hydra.launcher.threads=1"]


def _summary(sweep_dir):
    return json.loads((sweep_dir / "sweep.json").read_text())


def test_a_packed_execution_that_fails_leaves_every_run_failed(tmp_path, capsys, monkeypatch):
    """It left no sweep.json: the file was written only where the execution ended."""
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:BOOM")
    code = sweep_in_process(["workload.jobs.0.lr=0.05,0.1", "+plugins=[boom]", *TINY],
                            tmp_path / "s", *PACKED)
    out = capsys.readouterr().out
    summary = _summary(tmp_path / "s")
    assert code == 1 and (summary["complete"], summary["exit_code"]) == (False, 1)
    assert [(p["point"], p["status"], p["exit_code"]) for p in summary["points"]] == [
        (0, "failed", 1), (1, "failed", 1)]
    assert all("boom" in p["error"] for p in summary["points"])
    assert out.strip().splitlines()[-1] == f"sweep summary: {tmp_path / 's' / 'sweep.json'}"


def test_a_packed_execution_stopped_leaves_every_run_interrupted(tmp_path, capsys,
                                                                 monkeypatch):
    import accelopt.runtime.run as run

    def execute(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "execute", execute)
    code = sweep_in_process(["workload.jobs.0.lr=0.05,0.1", *TINY], tmp_path / "s", *PACKED)
    summary = _summary(tmp_path / "s")
    assert code == 130 and (summary["complete"], summary["exit_code"]) == (False, 130)
    assert [p["status"] for p in summary["points"]] == ["interrupted", "interrupted"]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("sweep summary: ")


def test_a_disk_full_before_a_points_first_write_is_one_line(tmp_path, capfd, monkeypatch):
    """Hydra writes a point's .hydra/ files before the point's task begins: a full disk there
    was Hydra's traceback, and sweep.json said exit 0 of a command exiting 1."""
    from hydra.core import utils

    original, saved = utils._save_config, []

    def save_config(cfg, filename, output_dir):
        saved.append(output_dir)
        if len({str(d) for d in saved}) > 1:  # the second point's first write
            raise OSError(errno.ENOSPC, "No space left on device")
        original(cfg, filename, output_dir)

    monkeypatch.setattr(utils, "_save_config", save_config)
    sweep = tmp_path / "s"
    result = accelopt_in_process("run", "-m", "run.seed=1,2,3", *TINY,
                                 f"hydra.sweep.dir={sweep}", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot write {sweep / '1' / '.hydra' / 'config.yaml'}: "
                           "No space left on device"), line
    summary = _summary(sweep)
    assert (summary["complete"], summary["exit_code"], summary["points_run"]) == (False, 1, 1)
    assert result.stdout.strip().splitlines()[-1] == f"sweep summary: {sweep / 'sweep.json'}"


def test_a_run_directory_named_with_brackets_is_shown_as_it_is(tmp_path, capfd):
    """rich read ``[clip]`` as markup: ``run directory: out-``."""
    result = accelopt_in_process("run", *TINY, "hydra.run.dir='out-[clip]'", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "run directory: out-[clip]"
    assert (tmp_path / "out-[clip]" / "metrics.json").is_file()
