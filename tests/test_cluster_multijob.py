"""Several jobs on one parameter-server cluster (accelopt/cluster/multijob.py): real
processes on 127.0.0.1, tiny models, a few iterations each.

What must hold: every job is trained on every rank and ends bitwise equal to the same job
trained alone in PS mode, whatever the interleaving (FIFO without plugins; a random salus
policy that switches at arbitrary boundaries, with tictac enforcing per-job orders); jobs
arriving later wait for their arrival; config mistakes are one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from accelopt.cluster import run_cluster
from accelopt.config import AccelConfig, JobConfig
from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(150)
TESTS = str(Path(__file__).parent)
JOBS = [
    JobConfig(name="mlp", model="mlp", width=16, batch_size=8, iterations=4, seed=1),
    # transformer: MultiheadAttention reads out_proj's weight without calling its forward
    JobConfig(name="tfm", model="transformer", width=16, batch_size=8, iterations=3, seed=2,
              arrival_s=0.0, optimizer="adam", lr=1e-3),
    JobConfig(name="late", model="mlp", width=8, batch_size=4, iterations=2, seed=3,
              arrival_s=0.8),
]


def make_cfg(jobs=JOBS, plugins: dict | None = None, mode: str = "ps"):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(j) for j in jobs]
    cfg.cluster.mode = mode
    cfg.cluster.workers = 2
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 20
    if plugins:
        cfg.plugins = plugins
    return cfg


@pytest.fixture(scope="module")
def alone():
    """Each job trained alone in PS mode: its final parameters and buffers."""
    states = {}
    for spec in JOBS[:2]:
        out = run_cluster(make_cfg([spec]), run_dir=".")
        states[spec.name] = out.state
    return states


def assert_bitwise(state: dict, reference: dict) -> None:
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


def job_ids(out) -> dict[str, str]:
    return {r.job.name: r.job.job_id for r in out.results}


def test_fifo_without_plugins_trains_every_job_bitwise_equal_to_alone(alone, tmp_path):
    out = run_cluster(make_cfg(), run_dir=str(tmp_path))
    ids = job_ids(out)
    assert [r.status for r in out.results] == ["done"] * 3
    assert [r.iterations_done for r in out.results] == [4, 3, 2]
    # run to completion in arrival order: each job's iterations are contiguous
    order = [d["run"][0] for d in out.ranks[0].schedule]
    assert order == [ids["mlp"]] * 4 + [ids["tfm"]] * 3 + [ids["late"]] * 2
    assert out.metrics["job_switches"] == 2
    for name in ("mlp", "tfm"):
        assert_bitwise(out.state[ids[name]], alone[name])
    # the late job arrives 0.8 s after training starts: it never starts before that
    late = next(r for r in out.results if r.job.name == "late")
    assert late.first_start_s >= late.job.arrival_s
    assert late.queueing_s is not None and late.queueing_s >= 0
    # per-job E and a run-level median; every span and transfer names its job
    for name in ("mlp", "tfm", "late"):
        assert f"job.{name}.efficiency_e_with_warmup" in out.metrics
    assert "efficiency_e_with_warmup" in out.metrics
    assert {row["job"] for row in out.per_iteration} == set(ids.values())
    links = [s for s in out.spans if s.category == "comm"]
    assert links and all(s.args["job"] in ids.values() for s in links)


def test_random_interleaving_with_salus_and_tictac_is_bitwise_equal(alone, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plugins = {
        "salus": {"policy": "multijob_policies:RandomPolicy"},
        "tictac": {"heuristic": "tac", "force": True, "oracle_runs": 1},
    }
    out = run_cluster(make_cfg(plugins=plugins), run_dir=str(tmp_path))
    ids = job_ids(out)
    assert [r.status for r in out.results] == ["done"] * 3
    order = [d["run"][0] for d in out.ranks[0].schedule]
    assert sorted(order) == sorted([ids["mlp"]] * 4 + [ids["tfm"]] * 3 + [ids["late"]] * 2)
    # the random policy interleaved the first two jobs (seed 7): not run to completion
    first_two = [j for j in order if j != ids["late"]]
    assert first_two != sorted(first_two, key=[ids["mlp"], ids["tfm"]].index)
    assert out.metrics["job_switches"] >= 2
    for name in ("mlp", "tfm"):
        assert_bitwise(out.state[ids[name]], alone[name])
    # tictac planned and enforced each job's own order (keyed by job: its own tensors)
    assert out.metrics["transfers_ordered"] > 0 and out.metrics["out_of_order_fraction"] == 0
    orders = {}
    for name, job_id in ids.items():
        plan = json.loads((tmp_path / "jobs" / job_id / "tictac" / "plan-rank0.json").read_text())
        assert plan["enforced"] is True
        assert plan["order"] and set(plan["order"]) <= set(out.state[job_id])
        orders[name] = plan["order"]
    assert any("self_attn" in t for t in orders["tfm"])
    assert not any("self_attn" in t for t in orders["mlp"])
    rows = {r.plugin: r.summary for r in out.plugin_rows if r.plugin == "salus"}
    assert "9 decisions over 3 job(s)" in rows["salus"]


def test_config_mistakes_are_one_line():
    with pytest.raises(ConfigError, match="cluster.mode=allreduce trains one job"):
        run_cluster(make_cfg(mode="allreduce"), run_dir=".")
    small = [JOBS[0], JobConfig(name="tiny-batch", batch_size=1, iterations=1)]
    with pytest.raises(ConfigError, match="job 'tiny-batch': batch_size 1 is smaller"):
        run_cluster(make_cfg(small), run_dir=".")


def test_cli_error_for_a_job_list_that_cannot_run_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "accelopt.cli.main", "run", "cluster.mode=allreduce",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if ln.strip()]
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    assert "cluster.mode=allreduce trains one job, but the workload has 5" in proc.stderr


def test_run_compare_runs_the_baseline_in_the_same_invocation(run_tiny):
    from accelopt_plugins.noop import PLUGIN as NOOP

    record = run_tiny(NOOP, overrides=["run.compare=baseline"])
    assert "compare.baseline.avg_jct_s" in record.metrics
    gains = [r.summary for r in record.plugin_rows if r.plugin == "noop"
             and r.summary.startswith("measured gain")]
    assert len(gains) == 1 and "avg JCT s" in gains[0]
    baseline = Path(record.info.run_dir) / "compare" / "baseline" / "metrics.json"
    assert json.loads(baseline.read_text())["run"]["plugins"] == []


def test_run_compare_is_validated_in_one_line(run_tiny):
    from accelopt_plugins.noop import PLUGIN as NOOP

    with pytest.raises(ConfigError, match="run.compare: 'sometimes' is not one of"):
        run_tiny(NOOP, overrides=["run.compare=sometimes"])


def test_default_workload_is_multi_job_ps_with_comparison():
    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "workload" / "default.yaml")
    assert cfg.cluster.mode == "ps" and len(cfg.workload.jobs) >= 3
    assert cfg.run.compare in ("baseline", "each")


def _fake_rt(job_id: str, arrival: float, iterations: int):
    from types import SimpleNamespace

    from accelopt.types import JobInfo

    info = JobInfo(job_id=job_id, name=job_id, model="mlp", kind="train", arrival_s=arrival,
                   iterations=iterations, batch_size=8)
    return SimpleNamespace(job=SimpleNamespace(info=info))


def test_scheduler_fifo_waits_for_arrivals_and_stops():
    from accelopt.cluster.multijob import Scheduler
    from accelopt.host import PluginHost

    clock = [100.0]
    rts = [_fake_rt("a", 0.0, 2), _fake_rt("b", 0.0, 1), _fake_rt("c", 5.0, 1)]
    s = Scheduler(rts, PluginHost(), "rank 0 (server)", 100.0, lambda: clock[0], 0.0)
    assert s.decide() == {"run": ["a"]}
    s.observe("a", 0.1)
    assert s.decide() == {"run": ["a"]}  # run to completion, not round robin
    s.observe("a", 0.1)
    assert s.decide() == {"run": ["b"]}
    s.observe("b", 0.1)
    assert s.decide() == {"wait": 0.0}  # c has not arrived (max_wait_s=0: no real sleep)
    clock[0] = 105.0
    assert s.decide() == {"run": ["c"]}
    s.observe("c", 0.1)
    assert s.decide() == {"stop": True}


def test_merge_rows_collapses_what_every_job_says():
    from accelopt.cluster.multijob import merge_rows
    from accelopt.types import ReportRow

    same = "workers receive parameters in order"
    rows = [[ReportRow("t", same, {"job": "a"}), ReportRow("t", same, {"job": "b"}),
             ReportRow("t", "planned", {"job": "b", "x": 1}), ReportRow("s", "decided")],
            [ReportRow("t", same, {"job": "a"}), ReportRow("s", "decided")]]
    merged = merge_rows(rows, ["a", "b"])
    assert [(r.plugin, r.summary) for r in merged] == [
        ("t", f"all jobs: {same}"), ("t", "job b: planned"), ("s", "decided")]
    assert merged[1].metrics == {"x": 1}


def test_merge_rows_accepts_job_ids_from_run_level_plugins():
    # gpu_kernels and offload run once per rank (run level) and tag their rows with the
    # job's id; the merged row names the job, and an unknown tag does not break the report
    from accelopt.cluster.multijob import merge_rows
    from accelopt.types import ReportRow

    rows = [[ReportRow("g", "pruned", {"job": "01-b"}), ReportRow("g", "pruned", {"job": "00-a"}),
             ReportRow("o", "moved", {"job": "01-b"}), ReportRow("o", "odd", {"job": "zz"})]]
    merged = merge_rows(rows, ["a", "b"], ["00-a", "01-b"])
    assert [r.summary for r in merged] == ["all jobs: pruned", "job b: moved", "job zz: odd"]


def test_run_level_rows_come_from_one_worker_and_per_job_rows_from_every_rank():
    from accelopt.cluster.multijob import merge_rows, representative_rows, tagged_with
    from accelopt.types import ReportRow

    server = [ReportRow("g", "00-a: nothing to do", {"job": "00-a"}),
              ReportRow("s", "decided"), ReportRow("t", "planned", {"job": "a"})]
    worker1 = [ReportRow("g", "00-a: pruned; 1.2x", {"job": "00-a"}),
               ReportRow("t", "received in order", {"job": "a"})]
    worker2 = [ReportRow("g", "00-a: pruned; 1.1x", {"job": "00-a"})]
    kept = representative_rows([server, worker1, worker2], ["server", "worker", "worker"],
                               tagged_with(["a"]))
    merged = merge_rows(kept, ["a"], ["00-a"])
    assert [(r.plugin, r.summary) for r in merged] == [
        ("s", "decided"), ("t", "job a: planned"), ("g", "job a: pruned; 1.2x"),
        ("t", "job a: received in order")]


def test_per_job_plugins_are_the_ones_with_a_transfer_hook():
    """PluginHost.implementing: what both the multi-job split and the single-job report use
    to tell per-job plugins (every rank's rows kept) from run-level ones (one rank's)."""
    from accelopt.hookspecs import TRANSFER_HOOKS, hookimpl
    from accelopt.host import PluginHost
    from accelopt.plugin import PluginSpec

    class Sender:
        @hookimpl
        def accelopt_transfer_done(self, record, start_s, end_s):
            return None

    class Reporter:
        @hookimpl
        def accelopt_report_rows(self, run):
            return []

    host = PluginHost([(PluginSpec(name="reporter", factory=lambda c: None), Reporter()),
                       (PluginSpec(name="sender", factory=lambda c: None), Sender())])
    assert host.implementing(TRANSFER_HOOKS) == ["sender"]
    assert host.implementing(frozenset({"accelopt_report_rows"})) == ["reporter"]
    assert host.implementing(frozenset()) == []
