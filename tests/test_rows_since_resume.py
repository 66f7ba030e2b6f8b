"""A resumed run's plugin rows: a plugin that keeps no state in checkpoints (no
``accelopt_state_save``) starts its counters at zero in the resumed process, so its row
covers the resumed part only while the job's row covers the whole job; the row says so
(``drivers/lifecycle.py``). A plugin that keeps its state says nothing more."""

from __future__ import annotations

import pytest
from clirun import run_in_process

pytestmark = pytest.mark.timeout(120)


def test_a_plugin_keeping_no_state_says_its_row_counts_from_the_resume(tmp_path):
    first = tmp_path / "first"
    run_in_process("workload=tiny", "cluster.mode=none", "run.compare=none",
                   "run.progress=false", "run.checkpoint_every=2", "+plugins=[offload,noop]",
                   run_dir=first)
    resumed = run_in_process(f"run.resume={first}", "run.resume_finished=true",
                             "run.progress=false", run_dir=tmp_path / "resumed")
    offload = [r for r in resumed.plugin_rows if r.plugin == "offload"]
    assert offload and all("[since the resume (at iteration " in r.summary for r in offload)
    assert all("offload keeps no state in checkpoints" in r.summary for r in offload)
    assert all(r.metrics["since_resume_at"] > 0 for r in offload)
    noop = [r for r in resumed.plugin_rows if r.plugin == "noop"]  # it saves its state
    assert noop and not any("since the resume" in r.summary for r in noop)
