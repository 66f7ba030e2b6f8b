"""gradcomm at its defaults (fp32, no sparsification, overlap) changes nothing a run without
it does: its row must say so (``INERT``), so that ``accelopt bench`` and ``run.compare`` call
a measured difference noise. Its row said "fp32 dense all-reduce (no compression)" without
the marker, and bench credited it with a 1.38x "gain" over identical bytes, loss and top-1.
Where it does change something (the order, a refused bucket, a codec) the row is not inert.
Also: its non-finite error says how it counts the iteration."""

from __future__ import annotations

import pytest
import torch
from accelopt_plugins.gradcomm.config import GradcommConfig
from accelopt_plugins.gradcomm.plugin import GradcommPlugin, NonFiniteGradient
from omegaconf import OmegaConf

from accelopt import TransferRecord
from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.runtime.compare import inert_plugins
from accelopt.types import INERT, ClusterInfo, JobInfo, RunInfo


def _cfg(plugins: dict) -> object:  # type: ignore[type-arg]
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="tiny", model="mlp", width=32, batch_size=16, iterations=4, seed=0, lr=0.05))]
    cfg.cluster.mode = "allreduce"
    cfg.cluster.workers = 2
    cfg.cluster.timeout_s = 20
    cfg.cluster.bucket_mb = 0.004  # ~4 KB: the mlp's layers fall in several buckets
    cfg.plugins = plugins
    return cfg


@pytest.mark.timeout(240)
def test_default_gradcomm_matches_a_run_without_it_and_says_it_is_inert(tmp_path):
    plain = run_cluster(_cfg({}), run_dir=tmp_path / "plain")
    default = run_cluster(_cfg({"gradcomm": {}}), run_dir=tmp_path / "default")
    # nothing measurable differs: bytes on the wire, losses, the trained weights
    for key in ("bytes_per_iteration", "worker_bytes_per_iteration"):
        assert default.metrics[key] == plain.metrics[key]
    assert default.results[0].losses == plain.results[0].losses
    assert default.state.keys() == plain.state.keys()
    for name, value in plain.state.items():
        assert torch.equal(default.state[name], value), name
    rows = [r for r in default.plugin_rows if r.plugin == "gradcomm"]
    assert rows and all(r.metrics.get(INERT) == 1 for r in rows)
    assert all("changed nothing" in r.summary and "dense all-reduce" in r.summary
               for r in rows)
    assert inert_plugins(["gradcomm"], default.plugin_rows) == ["gradcomm"]


def _plugin(**options) -> tuple[GradcommPlugin, RunInfo]:  # type: ignore[no-untyped-def]
    plugin = GradcommPlugin(GradcommConfig(**options))
    plugin.accelopt_configure(config=GradcommConfig(**options), run_config=OmegaConf.create(
        {"cluster": {"mode": "allreduce", "bucket_mb": 25}}))
    job = JobInfo(job_id="j", name="j", model="mlp", kind="train", arrival_s=0.0,
                  iterations=4, batch_size=2)
    run = RunInfo(run_dir=".", device="cpu", plugins=("gradcomm",), jobs=(job,), seed=0,
                  cluster=ClusterInfo(mode="allreduce", workers=2, bucket_bytes=25 * 2**20))
    plugin.accelopt_run_start(run=run)
    return plugin, run


def _record(iteration: int = 2) -> TransferRecord:
    return TransferRecord("j", iteration, 0, -1, "bucket0", 40, 0, "grad")


@pytest.mark.parametrize("options, inert", [
    ({}, True), ({"check_finite": False}, True), ({"overlap": False}, False),
    ({"dtype": "fp16"}, False), ({"dtype": "bf16"}, False),
    ({"sparsify": "topk", "density": 0.5}, False),
])
def test_only_a_run_that_changed_nothing_is_marked_inert(options, inert):
    plugin, run = _plugin(**options)
    payload = plugin.accelopt_transfer_encode(record=_record(), payload=torch.ones(10))
    assert (payload is None) is ("dtype" not in options and "sparsify" not in options)
    (row,) = plugin.accelopt_report_rows(run=run)
    assert bool(row.metrics.get(INERT)) is inert, row.summary
    if inert:
        assert ("for NaN/Inf: none found" in row.summary) is options.get("check_finite", True)


def test_a_refused_non_finite_bucket_is_not_inert_and_counts_its_iteration_from_0():
    plugin, run = _plugin()
    g = torch.zeros(10)
    g[4] = float("nan")
    with pytest.raises(NonFiniteGradient) as info:
        plugin.accelopt_transfer_encode(record=_record(2), payload=g)
    # the run's divergence line says "loss 3" for this NaN, its stop line "at iteration 2"
    assert "iteration 2 (counted from 0)" in str(info.value)
    (row,) = plugin.accelopt_report_rows(run=run)
    assert INERT not in row.metrics and "changed nothing" not in row.summary
