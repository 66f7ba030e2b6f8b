"""All-reduce bytes are what a rank sends on its links, not the buffer it hands the
collective. With 2 ranks the two are equal; with 3, a ring all-reduce sends 2(n-1)/n = 4/3
of the buffer and an all-gather sends each rank's part to n-1 = 2 peers, so the old counts
read a quarter (all-reduce) and half (gathered sparse buckets) short of the kernel's
counters, the bandwidth with them, and gradcomm's ratio compared a handed figure labelled
"wire" with the dense buffer (5.0x where the wire saved 3.3x)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.drivers.cluster.metrics import link_bandwidth
from accelopt.drivers.cluster.transport import allgather_wire_bytes, allreduce_wire_bytes
from accelopt.records import Span

sys.path.insert(0, str(Path(__file__).parent))
from test_cluster_netns import own_namespaces, still_there  # noqa: E402,F401

pytestmark = pytest.mark.timeout(120)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
    reason="shaped networks need root and iproute2 (ip, tc): run as root with iproute2 installed",
)


def make_cfg(workers: int = 3, iterations: int = 3, width: int = 32, **cluster):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="tiny", model="mlp", width=width, batch_size=12, iterations=iterations, seed=0))]
    cfg.cluster.mode = "allreduce"
    cfg.cluster.workers = workers
    cfg.cluster.timeout_s = 20
    for key, value in cluster.items():
        OmegaConf.update(cfg, f"cluster.{key}", value)
    return cfg


def test_ring_and_gather_wire_bytes_per_rank():
    assert [allreduce_wire_bytes(300, n) for n in (1, 2, 3, 4)] == [0, 300, 400, 450]
    assert [allgather_wire_bytes(300, n) for n in (1, 2, 3, 4)] == [0, 300, 600, 900]


def test_an_iteration_that_sent_nothing_has_no_bandwidth():
    """One rank alone sends nothing: 0 bit/s would read as a dead link."""
    span = Span(name="bucket0", track="link 0->all", start_s=0.0, end_s=1.0, category="comm",
                process="rank 0 (worker)", args={"iteration": 0, "bytes": 0})
    assert link_bandwidth([span]) == []


def test_three_rank_all_reduce_counts_what_goes_on_the_links(tmp_path):
    m = run_cluster(make_cfg(), run_dir=tmp_path).metrics
    handed = 3 * m["param_bytes"]  # every rank hands every gradient once per iteration
    assert m["collective_bytes_per_iteration"] == handed
    assert m["bytes_per_iteration"] == pytest.approx(handed * 4 / 3, abs=3 * 8)
    assert m["worker_bytes_per_iteration"] == m["bytes_per_iteration"]


def test_gradcomm_ratio_is_wire_against_wire_at_three_ranks(tmp_path):
    cfg = make_cfg()
    cfg.plugins = {"gradcomm": {"sparsify": "topk", "density": 0.1}}
    out = run_cluster(cfg, run_dir=tmp_path)
    rows = [r for r in out.plugin_rows if r.plugin == "gradcomm"]
    assert len(rows) == 3
    for row in rows:
        mx = row.metrics
        stats = out.ranks[int(mx["rank"])].stats
        handed = sum(stats.collective_bytes_by_iteration.values()) // 3
        # a gathered bucket's buffer goes to both other ranks
        assert mx["wire_bytes_per_iteration"] == 2 * handed
        assert mx["dense_wire_bytes_per_iteration"] == pytest.approx(
            mx["dense_bytes_per_iteration"] * 4 / 3, abs=8)
        ratio = mx["dense_wire_bytes_per_iteration"] / mx["wire_bytes_per_iteration"]
        assert mx["compression_ratio"] == pytest.approx(ratio, abs=1e-3)
        assert f"{ratio:.1f}x fewer bytes" in row.summary and "on its links" in row.summary


@pytest.mark.root
@needs_root
def test_three_rank_bytes_match_the_kernels_counters(tmp_path, own_namespaces):  # noqa: F811
    """On a shaped loopback the kernel counts what really left: the transport's figure is
    within a few percent of it, dense and gathered alike (TCP/IP headers and ACKs add; the
    kernel's count has read from 6.6% under the transport's, under a full test suite's
    load, to 1% over: the transport's is the algorithm's count, per iteration past the
    warm-up). Counting the buffers handed to gloo instead read 1.36 here (the ring sends 4/3
    of them), and 2.04 for the gathered run."""
    cfg = make_cfg(iterations=5, width=128, **{"network.bandwidth": "200mbit"})
    dense = run_cluster(cfg, run_dir=tmp_path / "dense").metrics
    cfg.plugins = {"gradcomm": {"sparsify": "topk", "density": 0.1}}
    sparse = run_cluster(cfg, run_dir=tmp_path / "sparse").metrics
    for m in (dense, sparse):
        ratio = m["wire_bytes_per_iteration"] / m["bytes_per_iteration"]
        assert 0.9 <= ratio < 1.1, ratio
    assert not still_there(own_namespaces)
