"""gradcomm in real all-reduce runs (2 gloo processes on 127.0.0.1): replicas stay bitwise
identical (checked every N iterations on every rank), fp16 halves the bytes the transport
moves, sparse buckets are gathered and still train, a diverging run stops naming the layer."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import RankFailed, run_cluster

pytestmark = pytest.mark.timeout(120)
CHECK_EVERY = 2


def make_cfg(iterations: int = 6, lr: float = 0.05, **gradcomm):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="tiny", model="mlp", width=32, batch_size=16, iterations=iterations, seed=0,
        lr=lr))]
    cfg.cluster.mode = "allreduce"
    cfg.cluster.workers = 2
    cfg.cluster.timeout_s = 20
    cfg.cluster.bucket_mb = 0.004  # ~4 KB: the mlp's layers fall in several buckets
    cfg.plugins = {"gradcomm": gradcomm}
    return cfg


def test_replicas_stay_identical_every_n_iterations(tmp_path, monkeypatch):
    """A test plugin digests the parameters after the optimizer step every CHECK_EVERY
    iterations on every rank (accelopt_after_step): the replicas agree at every check."""
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("ACCELOPT_PLUGINS", "cluster_plugins:DIGEST")
    cfg = make_cfg(iterations=6, sparsify="topk", density=0.05, dtype="fp16")
    cfg.plugins["digest"] = {}
    out = run_cluster(cfg, run_dir=tmp_path)
    rows = {r.metrics["rank"]: r.metrics["digests"].split(";")
            for r in out.plugin_rows if r.plugin == "digest"}
    assert sorted(rows) == [0, 1]
    assert len(rows[0]) == 6 // CHECK_EVERY
    assert rows[0] == rows[1]
    # and the replicas really moved: the parameter digests change between checks
    assert len(set(rows[0])) == len(rows[0])
    summaries = [r.summary for r in out.plugin_rows if r.plugin == "gradcomm"]
    assert summaries and all("error feedback" in line for line in summaries)
    # the job is SGD with momentum 0.9: DGC momentum correction is on by default
    assert all("momentum correction (m=0.9" in line for line in summaries)


def test_fp16_halves_the_bytes_and_sparse_buckets_train(tmp_path):
    plain = run_cluster(make_cfg(), run_dir=tmp_path)
    half = run_cluster(make_cfg(dtype="fp16", error_feedback=False), run_dir=tmp_path)
    sparse = run_cluster(make_cfg(sparsify="threshold", threshold=0.01), run_dir=tmp_path)
    payload = [sum(r.stats.payload_bytes for r in out.ranks) for out in (plain, half, sparse)]
    assert payload[1] * 2 == payload[0]
    # the few elements above the threshold as int32 index + fp32 value
    assert payload[2] < 0.5 * payload[0]
    # the per-worker figures and the link bandwidth count what crossed the link, compressed
    for out in (plain, half, sparse):
        m = out.metrics
        assert m["worker_bytes_per_iteration"] == m["bytes_per_iteration"]
    assert half.metrics["worker_bytes_per_iteration"] * 2 == \
        plain.metrics["worker_bytes_per_iteration"]
    losses = [out.results[0].losses for out in (plain, half, sparse)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)  # fp16 rounding only
    assert all(torch.isfinite(torch.tensor(ls)).all() for ls in losses)
    assert losses[2][-1] < losses[2][0]  # sparse still trains
    rows = [r.summary for r in sparse.plugin_rows if r.plugin == "gradcomm"]
    assert rows and "threshold 0.01" in rows[0]
    # in the unit that reads: a small model's bytes printed as "0.0xx MiB/iteration" (and
    # a smaller one's as 0.000); this one sends a few KiB
    assert re.search(r"of gradient elements, [\d.]+ (B|KiB)/iteration from rank", rows[0])
    # each rank sparsifies its own gradients: its row names it (two unlabelled rows per
    # job with different figures left a reader to guess which was "the" sent fraction)
    ranks = sorted(r.metrics["rank"] for r in sparse.plugin_rows if r.plugin == "gradcomm")
    assert ranks == [0, 1] and all(f"from rank {k}" in s for k, s in zip(
        ranks, sorted(rows, key=lambda s: "from rank 1" in s), strict=True))


def test_a_diverging_run_stops_naming_the_layer_instead_of_spreading_nan(tmp_path):
    cfg = make_cfg(iterations=6, lr=1e30, dtype="bf16")  # weights explode, gradients go NaN
    with pytest.raises(RankFailed) as info:
        run_cluster(cfg, run_dir=tmp_path)
    message = str(info.value)
    assert "NonFiniteGradient" in message and "in layer 'net." in message
    assert "not sent" in message and "\n" not in message
    print(message)


def test_momentum_correction_at_density_one_is_plain_momentum_sgd(tmp_path):
    """Sending every element with momentum correction (no masking) must train exactly like
    the plain all-reduce with the job's SGD momentum: the velocity moves into the codec and
    the decoder cancels the optimizer's own momentum, in the real runtime, over several
    buckets."""
    plain = run_cluster(make_cfg(), run_dir=tmp_path)
    corrected = run_cluster(make_cfg(sparsify="topk", density=1.0, momentum_correction=True,
                                     factor_masking=False), run_dir=tmp_path)
    assert plain.state.keys() == corrected.state.keys()
    for name, value in plain.state.items():
        torch.testing.assert_close(corrected.state[name], value, atol=1e-5, rtol=1e-4)
    rows = [r for r in corrected.plugin_rows if r.plugin == "gradcomm"]
    assert rows and "without factor masking" in rows[0].summary
    assert rows[0].metrics["buckets"] > 1
    # and with masking the same density-1 run is different training (sent entries lose
    # their momentum): the check above can tell them apart
    masked = run_cluster(make_cfg(sparsify="topk", density=1.0), run_dir=tmp_path)
    assert any(not torch.allclose(masked.state[n], v, atol=1e-5, rtol=1e-4)
               for n, v in plain.state.items())


@pytest.mark.timeout(120)
def test_a_threshold_above_every_gradient_says_nothing_was_sent(tmp_path):
    """It read 'sent 0.00% of gradient elements ... (infx fewer bytes than fp32)' and the
    run looked like a compression success."""
    out = run_cluster(make_cfg(iterations=2, sparsify="threshold", threshold=1e30),
                      run_dir=tmp_path)
    (row,) = {r.summary for r in out.plugin_rows if r.plugin == "gradcomm"}
    assert "sent NO gradient element in 2 iteration(s)" in row and "inf" not in row
