"""tictac's counts: ``tensors_updated_early`` counts only the tensors the server's early step
updated, and ``tune_block`` leaves every block an iteration to time."""

from __future__ import annotations

import pytest
from accelopt_plugins.tictac.tuning import OFF, Window, WindowTuner
from clirun import accelopt_in_process, the_error_line
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster

pytestmark = pytest.mark.timeout(120)


def test_tensors_without_a_gradient_are_not_counted_as_updated_early(tmp_path):
    """A frozen layer and a layer forward never calls get no gradient: the server's step
    skips them, so of ``byo_models:frozen_and_spare``'s six tensors only the head's two are
    updated early, each iteration (the count was every tensor of the shard)."""
    iterations = 2
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="m", model="byo_models:frozen_and_spare", dataset="synthetic_vectors", batch_size=4, iterations=iterations,
        seed=0))]
    cfg.cluster.mode, cfg.cluster.workers, cfg.cluster.timeout_s = "ps", 2, 20
    cfg.plugins = {"tictac": {"heuristic": "priority", "oracle_runs": 1, "credit_bytes": 0}}
    result = run_cluster(cfg, run_dir=tmp_path / "run")
    assert len(result.state) == 6
    assert result.metrics["tensors_updated_early"] == iterations * 2


def test_a_block_of_one_iteration_is_refused_as_it_leaves_nothing_untimed(tmp_path, capfd):
    """With ``tune_block=1`` every timed iteration was a block's first, which still carries
    its predecessor's mode: the README says it is not timed, yet the tuner timed it."""
    result = accelopt_in_process(
        "run", "+plugins=[tictac]", "plugins.tictac.heuristic=priority",
        "plugins.tictac.credit_bytes=-1", "plugins.tictac.tune_block=1",
        f"hydra.run.dir={tmp_path}", cwd=tmp_path, capfd=capfd)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert the_error_line(result) == (
        "error: plugins.tictac.tune_block=1 must be >= 2 (a block's first iteration still "
        "carries its predecessor's mode and is not timed)")
    tuner = WindowTuner((OFF, Window(0)), start=0, block=2, rounds=2)
    for i in range(tuner.end):
        tuner.record(i, float(i))
    # only each block's second iteration: 1 and 5 (off), 3 and 7 (credit 0)
    assert tuner.timed() == {OFF: [1.0, 5.0], Window(0): [3.0, 7.0]}
    assert tuner.candidate(tuner.end) is OFF  # decided: the fastest timed median
    assert "(median of 2 timed iterations each)" in tuner.describe()
