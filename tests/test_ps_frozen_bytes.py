"""A parameter-server iteration moves every parameter to each worker and the gradients of
the trainable ones back: a frozen parameter's gradient never goes (a header says it has
none). ``expected_bytes_per_iteration`` counted every parameter both ways, so the bound of a
partly frozen model (fine-tuning) stood above what its iterations could move."""

from __future__ import annotations

import os

import pytest
from test_cluster import ITERATIONS, TESTS, make_cfg
from test_stopped_cluster_figures import _info, _settings

from accelopt.drivers.cluster import run_cluster
from accelopt.drivers.cluster.outcome import stopped_outcome
from accelopt.drivers.cluster.rank import RankSoFar
from accelopt.records import JobResult


@pytest.mark.timeout(120)
def test_a_frozen_layers_gradients_are_no_part_of_a_ps_iterations_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = make_cfg("ps")
    cfg.workload.jobs[0].model = "byo_models:frozen"  # its first layer frozen, as fine-tuning
    cfg.workload.jobs[0].dataset = "synthetic_vectors"
    out = run_cluster(cfg, run_dir=tmp_path)
    m = out.metrics
    payload = sum(r.stats.payload_bytes for r in out.ranks) / ITERATIONS
    assert payload == m["expected_bytes_per_iteration"] < 2 * 2 * m["param_bytes"]


def test_a_stopped_ps_run_bounds_its_bytes_as_a_finished_one():
    """The figure a stopped run gives from what its ranks left before any iteration."""
    infos = [_info("a", 0)]
    left = [RankSoFar(0, {}, {infos[0].job_id: []}, [], backend="gloo",
                      param_bytes={infos[0].job_id: 80}, trainable_bytes={infos[0].job_id: 30})]
    metrics = stopped_outcome(left, [JobResult(i) for i in infos], _settings()).metrics
    assert metrics["expected_bytes_per_iteration"] == (80 + 30) * 1
