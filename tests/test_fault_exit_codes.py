"""The exit code and line of a cluster run whose ranks died without raising: a rank that
exited non-zero on its own (``os._exit``), and every rank dying with their forkserver. Both
leave the jobs unfinished, as a killed rank does, so both exit 3 (README: "a cluster run one
of whose rank processes died ... exits 3"); they exited 1. The watchdog's verdict is built
in this process from fake ended ranks; one real run checks the command's exit code."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from clirun import accelopt_in_process, the_error_line
from cluster_models import watchdog_verdict
from torch import nn

from accelopt.errors import JobsUnfinished, RankFailed


def _verdict(workdir: Path, codes: list[int], iteration: int | None,
             job: tuple[str, str]) -> RankFailed:
    """The watchdog's verdict on a PS run whose rank r ended with ``codes[r]`` and no
    failure note (it raised nothing), each rank last at ``iteration`` of ``job``."""
    return watchdog_verdict(workdir, codes, iteration=iteration, job=job)


def test_a_rank_that_exits_non_zero_without_raising_exits_3_and_does_not_claim_output(
        tmp_path):
    """os._exit(7) on rank 2: the line said "(its output above says why)" where nothing was
    printed (no Python error was raised to print), and the run exited 1 while its job was
    marked failed, which is exit 3."""
    error = _verdict(tmp_path, [0, 0, 7], 2, ("00-mlp", "mlp"))  # its peers: not a cause
    assert str(error) == (
        "rank 2 (worker, pid 102) exited with code 7 at iteration 2 of job 'mlp' without "
        "reporting a Python error (os._exit, or native code's exit(); what it wrote to "
        "stderr, if anything, is above); the cluster run was stopped")
    assert "says why" not in str(error)
    assert error.exit_code == JobsUnfinished.exit_code == 3
    assert error.job_id == "00-mlp" and error.rank == 2


def test_a_killed_forkserver_exits_3_and_names_the_job(tmp_path, monkeypatch):
    """Every rank dies with its forkserver (parent-death signal): the line exited 1, where a
    single killed rank exits 3, and named no job where a rank's own death names it."""
    from accelopt.drivers.cluster import faults

    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid is gone, as a killed forkserver's is
    monkeypatch.setattr(faults, "_forkserver_pid", lambda children: ended.pid)
    error = _verdict(tmp_path, [255, 255, 255], 18, ("00-mlp", "mlp"))
    assert str(error) == (
        f"the ranks' forkserver (their parent process, pid {ended.pid}) died at iteration 18 "
        "of job 'mlp', and every rank with it (killed? the OOM killer can pick it too); the "
        "cluster run was stopped")
    assert error.exit_code == JobsUnfinished.exit_code
    # before any rank's first iteration there is no job to name
    (tmp_path / "early").mkdir()
    error = _verdict(tmp_path / "early", [255, 255, 255], None, ("", ""))
    assert "died before its first iteration, and every rank" in str(error)
    assert error.exit_code == JobsUnfinished.exit_code


class ExitsOnRank(nn.Module):
    """Ends its process with ``os._exit(7)`` in the third forward on rank 1, raising
    nothing (as a native crash or a library's ``exit()`` would)."""

    def __init__(self, input_shape, num_classes: int) -> None:
        super().__init__()
        self.layer = nn.Linear(math.prod(input_shape), num_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3 and os.environ.get("RANK") == "1":
            os._exit(7)
        return self.layer(x.flatten(1))


def exits_on_rank(*, input_shape, num_classes) -> nn.Module:
    return ExitsOnRank(input_shape, num_classes)


@pytest.mark.timeout(120)
def test_the_command_exits_3_when_a_rank_exits_non_zero(tmp_path, capfd):
    """The real run: rank 1 exits with code 7 at iteration 2; the command exited 1."""
    result = accelopt_in_process(
        "run", "workload=single", "cluster.mode=ps", "cluster.timeout_s=20",
        "workload.jobs.0.model=test_fault_exit_codes:exits_on_rank",
        "workload.jobs.0.dataset=synthetic_vectors", "workload.jobs.0.iterations=10",
        "run.progress=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, capfd=capfd)
    line = the_error_line(result)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "exited with code 7 at iteration 2 of job 'mlp' without reporting a Python " \
        "error" in line, line
