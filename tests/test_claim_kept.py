"""A run that started and ended with a user-visible failure (exit 3: a diverged job) keeps
its claim on its directory (``.accelopt-run``), as a finished or stopped run does: the
command's cleanup for runs refused before they started removed it too."""

from __future__ import annotations

import pytest
from clirun import accelopt_in_process

from accelopt.runtime.run_dir import CLAIM_FILE

pytestmark = pytest.mark.timeout(120)


def test_a_diverged_run_keeps_its_claim_and_a_refused_one_leaves_nothing(tmp_path, capfd):
    ran = accelopt_in_process("run", "workload=tiny", "cluster.mode=none", "run.compare=none",
                              "run.progress=false", "workload.jobs.0.lr=1e30",
                              "hydra.run.dir=diverged", cwd=tmp_path, capfd=capfd)
    assert ran.returncode == 3, ran.stderr
    assert (tmp_path / "diverged" / "metrics.json").is_file()
    assert (tmp_path / "diverged" / CLAIM_FILE).is_file()
    refused = accelopt_in_process("run", "workload=tiny", "run.seed=abc",
                                  "hydra.run.dir=refused", cwd=tmp_path, capfd=capfd)
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
