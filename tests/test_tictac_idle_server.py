"""tictac on several parameter servers: a server the transport gave no tensor says so in
its row (it ordered nothing), and a warm-up fit the sizes do not explain (a shard of many
tiny tensors) is refused rather than labelled measured."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelopt_plugins.tictac import oracle
from accelopt_plugins.tictac.config import TictacConfig
from accelopt_plugins.tictac.plugin import TictacPlugin, TictacPriority
from omegaconf import OmegaConf
from test_tictac_cluster import make_cfg, server_plugin

from accelopt import ClusterInfo, RunInfo
from accelopt.job import Job
from accelopt.job.params import shard_by_bytes

pytestmark = pytest.mark.timeout(120)


def _server_of_many(tmp_path, rank: int, servers: int | None = None, **config):
    """The plugin as server ``rank`` of a ps run with ``servers`` servers (default: one
    more than the model's tensors, so the last server holds none) and 1 worker."""
    cfg = make_cfg(workers=1)
    job = Job(OmegaConf.to_object(cfg.workload.jobs[0]), job_id="tiny",
              device=torch.device("cpu"))
    servers = servers or len(job.info.parameters) + 1
    cfg.cluster.servers = servers
    cluster = ClusterInfo(mode="ps", workers=1, servers=servers, backend="gloo")
    run = RunInfo(str(tmp_path), "cpu", ("tictac",), (job.info,), 0, rank=rank,
                  role="server", world_size=servers + 1, leader=rank == 0, cluster=cluster,
                  job=job.info)
    conf = TictacConfig(oracle_runs=1, **config)
    plugin = (TictacPriority if conf.heuristic == "priority" else TictacPlugin)(conf)
    plugin.accelopt_configure(conf, cfg)
    plugin.accelopt_job_built(run=run, job=job.built())
    plugin.accelopt_run_start(run=run)
    return plugin, job, servers


@pytest.mark.parametrize("config", [dict(heuristic="tic", force=True), dict(heuristic="tic"),
                                    dict(heuristic="priority")])
def test_a_server_holding_no_tensor_says_so(tmp_path, config):
    """More servers than tensors: the last held none (the core warns so), yet its row read
    "enforced tic: ... its order is the default order (3 tensors)" (enforced 1, inert 0:
    with nothing sent, the row compared the whole model), "stayed out of the way ... (3
    tensors)" without force, and "no transfer was ordered (no iteration ran)" under
    priority, where every iteration ran."""
    cfg_job = Job(OmegaConf.to_object(make_cfg().workload.jobs[0]), job_id="tiny",
                  device=torch.device("cpu"))
    idle = len(cfg_job.info.parameters)  # the last of len + 1 servers
    plugin, job, servers = _server_of_many(tmp_path, rank=idle, **config)
    assert shard_by_bytes(job.info.parameters, servers)[idle] == []  # the transport's placing
    assert plugin.plan is None  # nothing to order: no plan made
    if config["heuristic"] == "priority":  # every iteration ran, timed
        for i in range(4):
            plugin.tuner.record(i, 0.01)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert row.summary.startswith(f"server rank {idle}: held no tensors of this job")
    assert f"({servers} servers for its {idle} parameter tensors)" in row.summary
    assert "ordered nothing" in row.summary
    for wrong in ("enforced", "default order (", "stayed out", "no iteration ran"):
        assert wrong not in row.summary
    assert row.metrics["inert"] == 1 and row.metrics["tensors"] == 0
    assert row.metrics["enforced"] == 0


def test_a_server_holding_a_shard_compares_its_shard_before_any_transfer(tmp_path):
    """Server 0 of several holds a shard: its row counts that shard's tensors, not the
    whole model's, even where its order hook has not been called yet."""
    plugin, job, servers = _server_of_many(tmp_path, rank=0, servers=2, heuristic="tic",
                                           force=True)
    shard = shard_by_bytes(job.info.parameters, servers)[0]
    (row,) = plugin.accelopt_report_rows(run=None)
    assert row.metrics["tensors"] == len(shard) < len(job.info.parameters)
    assert "of this server's shard" in row.summary


def _tiny_shard(large_gap: float) -> list[tuple[float, float, int]]:
    """Arrivals of a shard of 32-byte tensors ~50 us apart, with two 128-byte ones whose
    gaps (``large_gap``) are CPU noise, not their size's transfer time."""
    samples, t = [], 0.0
    for k in range(22):
        nbytes, gap = (128, large_gap) if k in (7, 15) else (32, 50e-6 + 1e-6 * (k % 3))
        samples.append((t, t + gap, nbytes))
        t += gap
    return samples


def test_fit_refuses_a_rate_the_sizes_do_not_explain():
    """Two slow gaps among tiny tensors gave a line of ~100 kB/s, where the arrivals moved
    their bytes three times faster than that: the fit read 262 B/s in a real run and
    predicted 46 s makespans for a 0.23 s run, labelled measured."""
    slow = _tiny_shard(1e-3)
    why = oracle.fit_link_or_why(slow)
    assert isinstance(why, str) and "below half of" in why
    assert oracle.fit_link(slow) is None
    fast = _tiny_shard(10e-6)  # the larger tensors arrive sooner: slope < 0
    why = oracle.fit_link_or_why(fast)
    assert isinstance(why, str) and "slope" in why and "<= 0" in why
    assert oracle.fit_link(fast) is None


def test_fit_keeps_a_line_the_sizes_explain():
    """A clean link (1 MB/s + 3 ms a message) still fits."""
    samples, t = [], 0.0
    for k in range(12):
        nbytes = 1000 * (1 + k % 4)
        start, t = t, t + 0.003 + nbytes / 1e6
        samples.append((start, t, nbytes))
    alpha, bw = oracle.fit_link_or_why(samples)
    assert alpha == pytest.approx(0.003, rel=1e-6) and bw == pytest.approx(1e6, rel=1e-6)


def test_a_refused_fit_keeps_the_assumed_link_and_the_row_says_why(tmp_path, monkeypatch):
    """The warm-up's arrivals give a line with a negative slope: the plan keeps the assumed
    rate and the row names the refusal, instead of "measured from the transport"."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="tac", force=True)
    before = plugin.plan.bytes_per_s
    small = min(r.nbytes for r in records)
    for iteration in (0, 1):
        plugin.accelopt_transfer_order(
            transfers=[dataclasses.replace(r, iteration=iteration) for r in records],
            destination=1)
        t = 10.0 * iteration
        for r in records:  # the smallest tensors arrive slowest: no rate in that
            end = t + (5e-3 if r.nbytes == small else 1e-3)
            plugin.accelopt_transfer_done(record=dataclasses.replace(r, iteration=iteration),
                                          start_s=t, end_s=end)
            t = end
    plugin.accelopt_transfer_order(
        transfers=[dataclasses.replace(r, iteration=2) for r in records], destination=1)
    assert plugin.replanned and plugin.link is None
    assert plugin.plan.bytes_per_s == before
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "measured from the transport" not in row.summary
    assert "nothing measured: the fit over" in row.summary and "was refused" in row.summary
