"""Cluster pieces that need no processes: metrics on hand-made spans, settings, sharding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig
from accelopt.drivers.cluster import metrics as cm
from accelopt.drivers.cluster.settings import (
    choose_backend,
    parse_duration,
    parse_rate,
    settings_from,
    unused_settings,
)
from accelopt.errors import ConfigError
from accelopt.job.params import buckets_by_bytes, param_table, shard_by_bytes, shard_rows
from accelopt.records import Span
from accelopt.types import JobInfo, RunInfo

pytestmark = pytest.mark.timeout(30)


def test_union_length_counts_overlaps_once():
    assert cm.union_length([]) == 0
    assert cm.union_length([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)


def test_overlap_metrics_by_hand():
    # comm [0,4] and [6,7] -> Mc 5; compute [3,6] -> Pc 3; U = 7 - 0 = 7
    m = cm.overlap_metrics([(0, 4), (6, 7)], [(3, 6)])
    assert m["mc_s"] == pytest.approx(5)
    assert m["pc_s"] == pytest.approx(3)
    assert m["iteration_makespan_s"] == pytest.approx(7)
    # E = (Mc+Pc-U)/(Mc+Pc-max) = (8-7)/(8-5) = 1/3; a = 5/3
    assert m["efficiency_e"] == pytest.approx(1 / 3)
    assert m["ratio_a"] == pytest.approx(5 / 3)
    # TicTac's speed-up potential S = (Mc+Pc-max)/max = min(a, 1/a): a ratio, not seconds
    assert m["speedup_potential"] == pytest.approx(3 / 5)
    # no overlap at all -> E = 0; perfect overlap -> E = 1
    assert cm.overlap_metrics([(0, 1)], [(1, 3)])["efficiency_e"] == pytest.approx(0)
    assert cm.overlap_metrics([(0, 2)], [(0, 3)])["efficiency_e"] == pytest.approx(1)


def _span(process, track, start, end, category, **args):
    return Span(name="s", track=track, start_s=start, end_s=end, category=category,
                process=process, args=args)


def _ps_worker(pull, compute, push, iteration, n=4, period=10):
    """Worker 1's timeline over ``n`` iterations ``period`` apart: the server's parameters
    (``pull``), its compute, its gradients to the server (``push``) and its iteration span,
    each an interval relative to the iteration's start."""
    spans = []
    for it in range(n):
        base = period * it
        for process, track, (start, end), category, ends in (
            ("rank 1 (worker)", "link 0->1", pull, "comm", {"source": 0, "destination": 1}),
            ("rank 1 (worker)", "compute", compute, "compute", {}),
            ("rank 0 (server)", "link 1->0", push, "comm", {"source": 1, "destination": 0}),
            ("rank 1 (worker)", "iteration", iteration, "iteration", {}),
        ):
            extra = {**ends, "bytes": 100} if ends else {}
            spans.append(_span(process, track, base + start, base + end, category,
                               iteration=it, **extra))
    return spans


def test_per_worker_iteration_and_summary_from_spans():
    spans = _ps_worker(pull=(0, 2), compute=(1, 4), push=(3, 5), iteration=(0, 5))
    rows = cm.per_worker_iteration(spans, [1])
    assert len(rows) == 4
    # Mc = [0,2]+[3,5] = 4, Pc = 3, U = 5 -> E = (7-5)/(7-4) = 2/3
    assert rows[0]["mc_s"] == pytest.approx(4)
    assert rows[0]["pc_s"] == pytest.approx(3)
    assert rows[0]["efficiency_e"] == pytest.approx(2 / 3)
    assert rows[0]["bytes"] == 200
    summary = cm.summarize(rows, [5.0] * 4, cm.link_bandwidth(spans))
    assert summary["warmup_iterations"] == 2
    assert summary["efficiency_e"] == pytest.approx(2 / 3)
    assert summary["iterations_per_s"] == pytest.approx(0.2)
    # 200 bytes over 4 s of link busy time
    assert summary["achieved_bandwidth_bps"] == pytest.approx(8 * 200 / 4)


def test_an_iteration_counts_what_happens_inside_it_when_transfers_cross_into_the_next():
    """A free-running PS worker: iteration i's gradient push ends inside iteration i+1.
    Grouped by the iteration each transfer belongs to, U would run past the period (16 s
    against 10) and E read 0.2 on a worker that is never idle; clipped to the iteration's
    own span, the worker is busy all of it and E is 0.8."""
    spans = _ps_worker(pull=(0, 3), compute=(3, 8), push=(7, 16), iteration=(0, 10))
    rows = cm.per_worker_iteration(spans, [1])
    steady = rows[1]
    # inside [10, 20]: the previous push [10, 16], the pull [10, 13], this push [17, 20]
    assert steady["mc_s"] == pytest.approx(9)
    assert steady["pc_s"] == pytest.approx(5)
    assert steady["iteration_makespan_s"] == pytest.approx(10)
    assert steady["efficiency_e"] == pytest.approx(0.8)
    assert steady["bytes"] == 200  # the iteration's own transfers, wherever they end
    # the first iteration has no earlier push: Mc [0, 3] + [7, 10], idle nowhere either
    assert rows[0]["mc_s"] == pytest.approx(6)
    assert rows[0]["efficiency_e"] == pytest.approx((6 + 5 - 10) / (6 + 5 - 6))
    # without iteration spans, the transfers are grouped by the iteration they belong to
    grouped = cm.per_worker_iteration([s for s in spans if s.category != "iteration"], [1])
    assert grouped[1]["iteration_makespan_s"] == pytest.approx(16)
    assert grouped[1]["efficiency_e"] == pytest.approx(0.2)


def _cluster(**kw):
    cfg = OmegaConf.structured(ClusterConfig)
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_settings_validate_with_one_line_errors():
    s = settings_from(_cluster(mode="ps", workers=3, servers=2))
    assert s.world_size == 5 and s.server_ranks() == [0, 1] and s.worker_ranks() == [2, 3, 4]
    assert settings_from(_cluster(mode="allreduce", workers=2)).world_size == 2
    for bad, words in (
        (dict(mode="ring"), "cluster.mode"),
        (dict(mode="ps", workers=0), "cluster.workers"),
        (dict(mode="ps", servers=0), "cluster.servers"),
        (dict(mode="ps", **{"network.bandwidth": "fast"}), "1gbit"),
        (dict(mode="ps", **{"network.topology": "mesh"}), "shared .* or hosts"),
        (dict(mode="ps", **{"network.links": {"worker1": "1mbit"}}), "topology=hosts"),
        (dict(mode="ps", **{"network.topology": "hosts", "network.links": {"worker2": "1mbit"}}),
         "server0, worker0, worker1"),
        (dict(mode="ps", **{"network.topology": "hosts", "network.links": {"worker1": "x"}}),
         "cluster.network.links.worker1"),
        (dict(mode="ps", **{"network.topology": "hosts", "network.links": "worker1"}),
         "not a mapping"),
    ):
        with pytest.raises(ConfigError, match=words) as info:
            settings_from(_cluster(**bad))
        assert "\n" not in str(info.value)
    assert parse_rate("1gbit") == 10**9 and parse_rate("100 mbit") == 10**8
    hosts = settings_from(_cluster(mode="ps", **{"network.topology": "hosts",
                                                 "network.bandwidth": "100mbit",
                                                 "network.links": {"worker1": "25mbit", "1": "50mbit"}}))
    assert hosts.network == "hosts" and hosts.shaped
    assert [s.bandwidth_bps for s in hosts.links()] == [100 * 10**6, 50 * 10**6, 25 * 10**6]
    assert hosts.info("gloo").link_bandwidth_bps == (100 * 10**6, 50 * 10**6, 25 * 10**6)
    assert settings_from(_cluster(mode="ps")).network == "none"
    assert settings_from(_cluster(mode="ps", **{"network.bandwidth": "1gbit"})).network == "shared"
    assert parse_duration("1ms") == pytest.approx(1e-3)


def test_settings_a_mode_does_not_read_are_named_not_dropped():
    """A one-process run asked for a shaped link used to run unshaped and say nothing."""
    assert unused_settings(_cluster(mode="none")) is None
    assert unused_settings(_cluster(mode="none", bucket_mb=4)) is None  # a job's buckets
    line = unused_settings(_cluster(mode="none", workers=4, **{"network.bandwidth": "100mbit"}))
    assert line == ("cluster.workers=4, cluster.network.bandwidth=100mbit have no effect: "
                    "cluster.mode=none runs one process (no ranks, no process group, no "
                    "links); set cluster.mode=ps or cluster.mode=allreduce to use them")
    line = unused_settings(_cluster(mode="allreduce", servers=3, workers=4))
    assert line is not None and line.startswith("cluster.servers=3 has no effect: ")
    assert "set cluster.mode=ps to use it" in line
    assert unused_settings(_cluster(mode="ps", servers=3, **{"network.latency": "1ms"})) is None


@pytest.mark.parametrize("mode, warned", [("none", False), ("ps", True), ("allreduce", True)])
def test_a_memory_capacity_a_cluster_run_cannot_enforce_is_named(mode, warned):
    from accelopt.config import AccelConfig
    from accelopt.runtime.run import setting_warnings

    cfg = OmegaConf.structured(AccelConfig)
    cfg.cluster.mode = mode
    assert setting_warnings(cfg) == []  # the default capacity, auto
    cfg.run.memory_capacity = "1MiB"
    lines = setting_warnings(cfg)
    assert bool(lines) == warned
    if warned:
        assert lines == [f"run.memory_capacity=1MiB has no effect: cluster.mode={mode} does not "
                         "profile jobs' memory (every rank keeps every job resident), so "
                         "nothing is admitted or rejected by it; cluster.mode=none enforces it"]


@pytest.mark.parametrize("mode", ["none", "ps", "allreduce"])
def test_telemetry_and_progress_a_cluster_run_does_not_read_are_named(mode):
    """run.telemetry_interval_s and run.progress=true were ignored by a cluster run without a
    word (no samples, no bars), while run.memory_capacity already said so."""
    from accelopt.config import AccelConfig
    from accelopt.runtime.run import setting_warnings

    cfg = OmegaConf.structured(AccelConfig)
    cfg.cluster.mode = mode
    assert setting_warnings(cfg, ["run.progress=false"]) == []  # defaults, or no bars asked
    cfg.run.telemetry_interval_s = 0.1
    lines = setting_warnings(cfg, ["run.progress=true"])
    if mode == "none":
        assert lines == []
        return
    assert lines == [
        f"run.telemetry_interval_s=0.1 has no effect: cluster.mode={mode} takes no telemetry "
        "samples (each rank's timeline is in trace.json); cluster.mode=none samples the device",
        f"run.progress=true has no effect: cluster.mode={mode} shows no progress bars (its "
        "ranks train in their own processes; the jobs table follows the run); "
        "cluster.mode=none shows them"]
    assert len(setting_warnings(cfg)) == 1  # the default progress, not asked for: no line


def test_more_threads_than_cores_is_named(monkeypatch):
    from accelopt.config import AccelConfig
    from accelopt.runtime import run

    monkeypatch.setattr(run, "usable_cores", lambda: 2)
    cfg = OmegaConf.structured(AccelConfig)
    for threads in (0, 1, 2):
        cfg.run.threads = threads
        assert run.setting_warnings(cfg) == []
    cfg.run.threads = 3
    assert run.setting_warnings(cfg) == [
        "run.threads=3 is more than the 2 cores this process may use: its threads take turns "
        "on them, so every op is slower and the times measure that; run.threads=2 or less "
        "(0: torch's default)"]


@pytest.mark.parametrize("backend,device,ranks,gpus,chosen,noted", [
    ("auto", "auto", 3, 0, "gloo", False),     # no GPU
    ("auto", "cpu", 3, 8, "gloo", False),      # asked for CPU
    ("gloo", "auto", 2, 8, "gloo", False),     # asked for gloo
    ("auto", "auto", 3, 4, "nccl", False),     # a GPU per rank
    ("auto", "auto", 1, 1, "nccl", False),
    ("auto", "auto", 3, 1, "gloo", True),      # ranks would share a GPU: CPU, said so
    ("nccl", "auto", 2, 2, "nccl", False),
    ("nccl", "cuda", 2, 2, "nccl", False),
])
def test_backend_choice_gives_each_nccl_rank_a_gpu(backend, device, ranks, gpus, chosen, noted):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): auto never picks it
    for more ranks than GPUs, and says why the GPU goes unused."""
    ps = ranks > 1
    s = settings_from(_cluster(mode="ps" if ps else "allreduce", workers=ranks - ps,
                               servers=1, backend=backend))
    choice = choose_backend(s, device, local_ranks=ranks, cuda_devices=gpus)
    assert choice.backend == chosen
    assert (choice.note is not None) == noted
    if noted:
        assert "gloo" in choice.note and "cluster.workers + cluster.servers <= 1" in choice.note


@pytest.mark.parametrize("backend,device,ranks,gpus,words", [
    ("nccl", "auto", 3, 1, "3 ranks on this machine but 1 CUDA device.*cluster.backend=gloo"),
    ("nccl", "auto", 2, 0, "needs CUDA devices, and none is available"),
    ("nccl", "cpu", 2, 2, "run.device=cpu asks for none"),
    ("auto", "cuda", 3, 1, "run.device=cuda .*run.device=auto"),
    ("auto", "cuda:0", 2, 1, "run.device=cuda:0 "),
    ("gloo", "cuda", 2, 0, "run.device=cuda but no CUDA device"),
    ("gloo", "cuda", 2, 2, "gloo's ranks run on CPU"),
])
def test_backend_that_cannot_hold_is_refused_in_one_line(backend, device, ranks, gpus, words):
    s = settings_from(_cluster(mode="allreduce", workers=ranks, backend=backend))
    with pytest.raises(ConfigError, match=words) as info:
        choose_backend(s, device, local_ranks=ranks, cuda_devices=gpus)
    assert "\n" not in str(info.value)


def test_sharding_balances_bytes_and_buckets_follow_backward_order():
    from torch import nn

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(8, 2))
    table = param_table(model)
    assert [p.layer_index for p in table] == [0, 0, 1, 1, 2, 2]
    shards = shard_by_bytes(table, 2)
    loads = [sum(p.nbytes for p in s) for s in shards]
    assert sorted(p.index for s in shards for p in s) == list(range(6))
    assert max(loads) - min(loads) <= max(p.nbytes for p in table)
    buckets = buckets_by_bytes(table, 4 * 64 * 64)
    assert table[buckets[0][0]].name == "2.bias"  # last layer first (indices into the table)
    assert shard_rows(10, 3) == [(0, 4), (4, 7), (7, 10)]


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(st.tuples(st.sampled_from(["float32", "float64", "float16"]),
                                 st.integers(1, 40)), min_size=1, max_size=12),
       cap=st.integers(8, 600))
def test_buckets_are_the_ones_ddp_rebuilds_also_with_mixed_dtypes(layers, cap):
    """DDP's own assignment (``_compute_bucket_assignment_by_size``, gradients ready in
    reverse layer order) is the ground truth: each dtype fills buckets of its own. A
    float32 and a float64 layer in one logical bucket were sent as one float64 tensor."""
    import torch
    import torch.distributed as dist
    from torch import nn

    model = nn.Sequential(*[nn.Linear(width, 1).to(getattr(torch, dtype))
                            for dtype, width in layers])
    params = list(model.parameters())
    ready = list(reversed(range(len(params))))
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in ready], [cap], [False] * len(params), ready)
    ours = buckets_by_bytes(param_table(model), cap)
    assert sorted(ours) == sorted(tuple(b) for b in theirs)
    closed = [b for b in ours if sum(params[i].nbytes for i in b) >= cap]
    assert closed == [tuple(b) for b in theirs][:len(closed)]  # in the order they close


@settings(max_examples=40, deadline=None)
@given(layers=st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=10),
       cap=st.integers(8, 600))
def test_buckets_leave_frozen_parameters_out_as_ddp_does(layers, cap):
    """DDP buckets only the parameters that require grad; the logical buckets held the
    frozen ones too and the hook sent their slots as zeros (a frozen backbone under a
    trainable head sent 65x DDP's bytes)."""
    import torch.distributed as dist
    from torch import nn

    model = nn.Sequential(*[nn.Linear(width, 1) for width, _ in layers])
    for layer, (_, frozen) in zip(model, layers, strict=True):
        layer.requires_grad_(not frozen)
    params = list(model.parameters())
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    ready = list(reversed(range(len(trainable))))
    theirs, _ = (dist._compute_bucket_assignment_by_size(
        [params[trainable[i]] for i in ready], [cap], [False] * len(trainable), ready)
        if trainable else ([], None))
    ours = buckets_by_bytes(param_table(model), cap, model)
    assert sorted(ours) == sorted(tuple(trainable[i] for i in b) for b in theirs)
    assert buckets_by_bytes(param_table(model), cap) != ours or not any(f for _, f in layers)


def test_a_jobs_buckets_follow_what_trains_and_a_cluster_run_refuses_a_change():
    """``JobInfo.buckets`` (what all-reduce mode's hook sends) hold the parameters that
    require grad when the job is built; a plugin unfreezing one later gets it into the
    buckets of a one-process run, and is refused in one line in a cluster run, whose DDP
    (or PS worker) was made for the old set and would leave its gradient local."""
    import types

    import torch

    from accelopt import hookimpl
    from accelopt.config import JobConfig
    from accelopt.errors import UserError
    from accelopt.host import PluginHost
    from accelopt.job import Job
    from accelopt.plugin import PluginSpec

    class FreezeFirst:
        @hookimpl
        def accelopt_layer_build(self, layer):  # type: ignore[no-untyped-def]
            if layer.path == "":
                next(m for m in layer.module.modules()
                     if isinstance(m, torch.nn.Linear)).requires_grad_(False)

    host = PluginHost([(PluginSpec(name="freeze", factory=lambda c: None), FreezeFirst())])
    job = Job(JobConfig(name="j", model="mlp", width=4, batch_size=4, iterations=2),
              job_id="j", device=torch.device("cpu"), host=host)
    frozen = {p.index for p in job.info.parameters
              if not job.model.get_parameter(p.name).requires_grad}
    assert frozen and not frozen & {i for b in job.info.buckets for i in b}
    job.model.requires_grad_(True)
    job.rebuild_optimizer("unfrozen")
    assert sorted(i for b in job.info.buckets for i in b) == list(range(len(job.info.parameters)))
    job.model.get_parameter(job.info.parameters[0].name).requires_grad_(False)
    job.exchange = types.SimpleNamespace(role="worker")
    with pytest.raises(UserError, match="changed which parameters train") as info:
        job.rebuild_optimizer("frozen again", by="plugin 'freeze'")
    assert "\n" not in str(info.value) and "plugin 'freeze'" in str(info.value)


def test_a_rank_counts_the_ranks_on_its_own_machine(monkeypatch):
    """Under torchrun a rank's neighbours are LOCAL_WORLD_SIZE, not the whole world."""
    import torch

    from accelopt.drivers.cluster.rank import pick_backend

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = OmegaConf.create({"run": {"device": "auto"}})
    s = settings_from(_cluster(mode="allreduce", workers=2))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert pick_backend(s, cfg).backend == "gloo"  # a local run: both ranks here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert pick_backend(s, cfg).backend == "nccl"  # one rank per machine


def _outcome(starts: list[float], steady: tuple[float, float] | None):
    from accelopt.drivers.cluster.outcome import ClusterOutcome

    return ClusterOutcome(starts=starts, steady=steady)


def test_several_jobs_wall_throughput_counts_iterations_over_the_time_some_job_ran():
    """Two jobs run one after the other with an idle wait between them: the wall throughput
    is their steady iterations over the time they ran (not one over the median iteration,
    which is the faster job's rate), and a warm-up iteration of one job run inside the other's
    window counts (it took that time)."""
    from accelopt.drivers.cluster.outcome import wall_throughput

    fast = _outcome([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], (0.2, 0.6))  # 4 steady in 0.4 s
    slow = _outcome([2.0, 2.5, 3.0, 3.5, 4.0], (3.0, 4.5))  # 3 steady in 1.5 s, idle before
    assert wall_throughput([fast, slow]) == pytest.approx(7 / 1.9)
    assert wall_throughput([fast]) == pytest.approx(4 / 0.4)  # one job: its own figure
    late = _outcome([0.45, 0.9], (0.9, 1.0))  # its warm-up ran inside the first's window
    assert wall_throughput([fast, late]) == pytest.approx(6 / 0.5)
    assert wall_throughput([_outcome([0.0], None)]) is None


def test_the_summary_labels_one_over_the_median_iteration_as_such():
    from accelopt.records import RunRecord
    from accelopt.report.summary import _cluster_line
    from accelopt.types import RunInfo

    record = RunRecord(info=RunInfo(run_dir=".", device="cluster", plugins=(), jobs=(), seed=0))
    record.metrics = {"cluster_mode": "ps", "iterations_per_s": 100.0}
    assert "100.00 it/s (1/median iteration)" in _cluster_line(record)
    record.metrics["wall_iterations_per_s"] = 80.0
    assert "80.00 it/s (wall)" in _cluster_line(record)


def _leader(tmp_path, train_t0: float, iteration: int = 0):
    """A leader's driver with one job and no process group (what ``_ended`` and the switch
    records use)."""
    from types import SimpleNamespace

    from accelopt.drivers.cluster.driver import ClusterDriver
    from accelopt.types import JobInfo

    info = JobInfo(job_id="00-a", name="a", model="mlp", kind="train", arrival_s=0.0,
                   iterations=10, batch_size=8)
    part = SimpleNamespace(job=SimpleNamespace(info=info, iteration=iteration),
                           service_s=lambda: 0.3, carried_s=0.0, carried_service_s=0.0,
                           queueing_s=lambda: 0.5 if iteration else None)
    progress = SimpleNamespace(path=tmp_path / "progress-0")
    driver = ClusterDriver(OmegaConf.create({}), [part], None, rank=0, device=None,
                           progress=progress, clock=None)
    driver.train_t0 = train_t0
    return driver, part


def test_a_failed_runs_finished_job_is_recorded_as_a_successful_run_counts_it(tmp_path):
    """The leader's clock counts from the launcher's start, arrivals from ``train_t0``
    (every rank had built every job): the JCT and queueing delay recorded for a job that
    ended before a failure exclude the start-up (5 s here), its samples are counted, and
    its times are on the training clock, as a finished run's (``build_outcome``)."""
    from accelopt.drivers.cluster.faults import read_ended
    from accelopt.records import JobResult
    from accelopt.runtime.run import _ended_before

    driver, part = _leader(tmp_path, train_t0=5.0)
    result = JobResult(part.job.info, status="done", first_start_s=5.1, end_s=5.6,
                       iterations_done=10)
    driver._ended(part.job, result)
    ended = read_ended(tmp_path)
    assert ended["00-a"]["jct_s"] == pytest.approx(0.6)
    assert ended["00-a"]["queueing_s"] == pytest.approx(0.1)
    got = _ended_before(JobResult(part.job.info), ended)
    assert (got.status, got.iterations_done, got.samples) == ("done", 10, 80)
    assert got.jct_s == pytest.approx(0.6) and got.queueing_s == pytest.approx(0.1)
    assert got.throughput == pytest.approx(80 / 0.3)
    assert got.job.arrival_s == 0.0  # as configured
    assert (got.first_start_s, got.end_s) == (pytest.approx(0.1), pytest.approx(0.6))


def test_a_failed_runs_finished_job_is_on_a_finished_runs_clock():
    """A failed cluster run's metrics.json put a finished job at 0.93-1.19 s while a
    finished run put the same iterations at 2.83-3.09 s: the leader's times count from
    train_t0, which a finished run added (build_outcome) and a stopped one did not. Both are
    on the training clock: arrivals as configured, a job's first start and end its arrival
    plus its queueing delay and JCT. And its makespan ignored the job still running when
    the rank was killed: unknown, so null."""
    from accelopt.records import JobResult, RunRecord
    from accelopt.report import run_metrics
    from accelopt.runtime.run import _ended_before

    info = JobInfo(job_id="00-a", name="a", model="mlp", kind="train", arrival_s=0.5,
                   iterations=10, batch_size=8)
    late = JobInfo(job_id="01-b", name="b", model="mlp", kind="train", arrival_s=0.0,
                   iterations=10, batch_size=8)
    ended = {"00-a": {"status": "done", "iterations": 10, "jct_s": 0.6, "queueing_s": 0.1,
                      "service_s": 0.5, "samples": 80},
             "01-b": {"status": "running", "current": True, "iterations": 3}}
    got = _ended_before(JobResult(info), ended)
    assert got.job.arrival_s == 0.5
    assert got.first_start_s == pytest.approx(0.6) and got.end_s == pytest.approx(1.1)
    assert got.jct_s == pytest.approx(0.6) and got.queueing_s == pytest.approx(0.1)
    running = _ended_before(JobResult(late), ended, reached=4)
    record = RunRecord(info=RunInfo("r", "cluster", (), (info, late), 0),
                       jobs=[got, running], metrics={"error": "rank 2 was killed"})
    running.status = "failed"  # as the evidence marks it
    assert run_metrics(record)["makespan_s"] is None
    assert running.job.arrival_s == 0.0  # every job on the one clock
    running.status, running.end_s = "done", 1.5  # had it finished: first arrival to last end
    assert run_metrics(record)["makespan_s"] == pytest.approx(1.5)


def test_a_failed_runs_unfinished_jobs_keep_the_iterations_they_had_run(tmp_path):
    """The leader records a job's iterations when it switches jobs; the job it was running
    when the run stopped gets the failing rank's iteration."""
    from accelopt.drivers.cluster.faults import read_ended
    from accelopt.records import JobResult
    from accelopt.runtime.run import _ended_before

    driver, part = _leader(tmp_path, train_t0=1.0, iteration=4)
    driver._switched("00-a")
    ended = read_ended(tmp_path)
    assert ended["00-a"] == {"status": "running", "current": True, "iterations": 4,
                             "queueing_s": 0.5, "service_s": 0.3, "carried_service_s": 0.0}
    got = _ended_before(JobResult(part.job.info), ended, reached=7)
    assert (got.iterations_done, got.samples) == (7, 56)
    assert _ended_before(JobResult(part.job.info), ended).iterations_done == 4
    ended["00-a"]["current"] = False  # left at a switch: the failing rank was elsewhere
    assert _ended_before(JobResult(part.job.info), ended, reached=7).iterations_done == 4


def test_a_jobs_training_settings_it_cannot_use_are_named():
    """A warm-up kept from a longer run's settings made a shortened job train in warm-up
    throughout (and a decay never start), and min_lr did nothing under a constant schedule,
    without a word."""
    from accelopt.config import AccelConfig, JobConfig
    from accelopt.runtime.run import setting_warnings

    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [JobConfig(name="a", iterations=200, warmup_iterations=199,
                                   lr_schedule="cosine", min_lr=0.01)]
    assert setting_warnings(cfg) == []  # the last step is past the warm-up: nothing to say
    cfg.workload.jobs[0].warmup_iterations = 500
    assert setting_warnings(cfg) == [
        "job 'a': warmup_iterations=500 is not fewer than its 200 iterations: the job is all "
        "warm-up (its last step at 40% of lr=0.05), and its cosine decay never starts; lower "
        "warmup_iterations"]
    cfg.workload.jobs[0].warmup_iterations = 0
    cfg.workload.jobs[0].lr_schedule = "constant"
    assert setting_warnings(cfg) == [
        "job 'a': min_lr=0.01 has no effect with lr_schedule=constant; lr_schedule=cosine or "
        "linear decays to it"]
    cfg.workload.jobs[0].kind = "infer"  # nothing is trained: nothing to warn about
    assert setting_warnings(cfg) == []


def test_a_stopped_runs_losses_are_combined_only_from_every_workers_records():
    """The records the ranks of a stopped run left give the job its losses as a finished
    run combines them (each worker's weighted by its rows); with a worker's records missing
    (a killed rank) a share would be weighed wrong, so none are given."""
    from accelopt.drivers.cluster.outcome import losses_so_far
    from accelopt.drivers.cluster.rank import RankSoFar

    settings = settings_from(_cluster(mode="ps", workers=2, servers=1))  # workers: ranks 1, 2

    def rows(*losses):
        return {"00-a": [{"loss": v} for v in losses]}

    server = RankSoFar(0, {}, {"00-a": []}, [])
    left = [server, RankSoFar(1, {}, rows(1.0, 2.0, 3.0), []),
            RankSoFar(2, {}, rows(3.0, 4.0), [])]
    # batch 3 over two workers: 2 rows and 1 row; the iterations both workers ran
    assert losses_so_far(left, "00-a", 3, settings) == pytest.approx([5 / 3, 8 / 3])
    assert losses_so_far(left[:2], "00-a", 3, settings) is None
    assert losses_so_far(left, "01-b", 3, settings) is None  # a job no rank had built


def test_a_stopped_run_makes_no_rows_for_a_worker_that_left_no_timeline():
    """A worker killed outright: per_iteration.json had rows for it built from the server's
    link spans alone (Pc 0, U = Mc), measurements nobody made; and a worker's loss of an
    iteration the run did not finish was the job's last."""
    from accelopt.config import JobConfig
    from accelopt.drivers.cluster.outcome import stopped_outcome
    from accelopt.drivers.cluster.rank import RankSoFar
    from accelopt.job.specs import job_info
    from accelopt.records import JobResult

    settings = settings_from(OmegaConf.structured(ClusterConfig(mode="ps", workers=2)))
    info = job_info(JobConfig(name="j", model="mlp", batch_size=4, iterations=9), "00-j")

    def link(dst: int, it: int) -> Span:
        return Span("w", f"link 0->{dst}", it, it + 0.5, category="comm",
                    process="rank 0 (server)",
                    args={"iteration": it, "source": 0, "destination": dst, "bytes": 8})

    def compute(rank: int, it: int) -> Span:
        return Span("fwd", "compute", it + 0.5, it + 0.9, category="compute",
                    process=f"rank {rank} (worker)", args={"iteration": it})

    records = [{"iteration": i, "start_s": float(i), "end_s": i + 1.0, "loss": 1.0 / (i + 1),
                "samples": 2} for i in range(3)]
    left = [RankSoFar(0, {"00-j": [link(d, i) for d in (1, 2) for i in range(3)]}, {}, []),
            RankSoFar(1, {"00-j": [compute(1, i) for i in range(3)]}, {"00-j": records}, [])]
    result = JobResult(info)
    stopped = stopped_outcome(left, [result], settings)
    assert {row["rank"] for row in stopped.per_iteration} == {1}  # rank 2 left nothing
    assert result.losses == []  # not every worker left its records: no combined loss
    left.append(RankSoFar(2, {"00-j": [compute(2, i) for i in range(3)]}, {"00-j": records},
                          []))
    result = JobResult(info)
    result.iterations_done = 2  # the run reached iteration 2: a third loss is not the job's
    stopped_outcome(left, [result], settings)
    assert len(result.losses) == 2 and result.final_loss == result.losses[-1]


def _renumbered(spans, first: int):
    """``spans`` with every iteration number moved up by ``first`` (a resumed run's)."""
    from dataclasses import replace

    return [replace(s, args={**s.args, "iteration": s.args["iteration"] + first})
            for s in spans]


def _resumed_worker(first: int):
    """Worker 1 of a run resumed at iteration ``first``: two slow warm-up iterations (Mc 6,
    7 s long) then two steady ones (Mc 4, 5 s long), each 10 s apart."""
    warm = _ps_worker(pull=(0, 3), compute=(3, 4), push=(4, 7), iteration=(0, 7), n=2)
    steady = [s for s in _ps_worker(pull=(0, 2), compute=(1, 4), push=(3, 5), iteration=(0, 5))
              if s.args["iteration"] >= 2]
    return _renumbered(warm + steady, first)


def test_a_resumed_runs_warm_up_counts_from_its_first_measured_iteration():
    """Resumed at iteration 1400, the summary compared absolute iteration numbers with the
    warm-up (2): every iteration counted as steady, so mc_s equalled mc_s_with_warmup."""
    rows = cm.per_worker_iteration(_resumed_worker(1400), [1])
    assert [r["iteration"] for r in rows] == [1400, 1401, 1402, 1403]
    summary = cm.summarize(rows, [7.0, 7.0, 5.0, 5.0])
    fresh = cm.summarize(cm.per_worker_iteration(_resumed_worker(0), [1]), [7.0, 7.0, 5.0, 5.0])
    assert summary == fresh
    assert summary["mc_s"] == pytest.approx(4)
    assert summary["mc_s_with_warmup"] == pytest.approx(5)
    assert summary["iteration_makespan_s"] == pytest.approx(5)
    assert summary["worker_bytes_per_iteration"] == 200


def test_a_resumed_runs_iteration_time_is_its_own_iterations_only():
    """The iterations carried from the checkpoint (another run's, 100 s each here) entered
    iteration_s: they were appended before the check that skips carried ones."""
    from accelopt.drivers.cluster.outcome import _job_outcome
    from accelopt.drivers.cluster.rank import JobPart

    settings_ = settings_from(_cluster(mode="ps", workers=1, servers=1))
    info = JobInfo(job_id="00-mlp", name="mlp", model="mlp", kind="train", arrival_s=0.0,
                   iterations=9, batch_size=4)
    carried = [{"iteration": i, "start_s": 100.0 * i, "end_s": 100.0 * (i + 1), "loss": 1.0,
                "samples": 4, "carried": True} for i in range(5)]
    own = [{"iteration": 5 + i, "start_s": 1000.0 + 10 * i,
            "end_s": 1000.0 + 10 * i + (7.0 if i < 2 else 5.0), "loss": 0.5, "samples": 4}
           for i in range(4)]
    spans = [_later(s, 1000.0) for s in _resumed_worker(5)]
    worker = JobPart(rank=1, role="worker", job=info, iterations=carried + own, spans=spans)
    server = JobPart(rank=0, role="server", job=info)
    metrics = _job_outcome([server, worker], settings_).metrics
    assert metrics["iteration_s"] == pytest.approx(5.0)
    assert metrics["iteration_s_with_warmup"] == pytest.approx(6.0)
    assert metrics["warmup_iterations"] == 2
    assert metrics["mc_s"] == pytest.approx(4)


def _later(span, shift: float):
    """``span`` moved ``shift`` seconds later."""
    from dataclasses import replace

    return replace(span, start_s=span.start_s + shift, end_s=span.end_s + shift)


def test_a_job_within_the_shapers_burst_is_said_to_be_unconstrained():
    """A tiny job on a 50 Mbit/s loopback read 147 Mbit/s achieved under "shaped loopback 50
    Mbit/s": its iterations fit in tbf's burst (36 KB), which leaves at the machine's speed,
    and nothing said the link never held it back."""
    import types

    from accelopt.drivers.cluster.outcome import unconstrained_link
    from accelopt.drivers.cluster.transport import TransportStats

    cluster = OmegaConf.structured(ClusterConfig)
    cluster.mode, cluster.workers = "allreduce", 2
    cluster.network.bandwidth = "50mbit"
    s = settings_from(cluster)

    def parts(per_rank: int) -> list:
        return [types.SimpleNamespace(stats=TransportStats(
            bytes_by_iteration=dict.fromkeys(range(5), per_rank))) for _ in range(2)]

    small = {"bytes_per_iteration": 9136.0, "achieved_bandwidth_bps": 147e6,
             "warmup_iterations": 2}
    (line,) = unconstrained_link("tiny", small, parts(4568), s)
    assert line.startswith("job 'tiny': the shaped network (50 Mbit/s) did not constrain it")
    assert "within tbf's burst" in line and "147.0 Mbit/s, above the rate" in line
    big = {"bytes_per_iteration": 2e6, "achieved_bandwidth_bps": 48e6, "warmup_iterations": 2}
    assert unconstrained_link("big", big, parts(10**6), s) == []
    fast = {**big, "achieved_bandwidth_bps": 90e6}  # over the rate, whatever the size
    assert "above the rate" in unconstrained_link("big", fast, parts(10**6), s)[0]
    cluster.network.topology = "hosts"
    (hosts,) = unconstrained_link("tiny", small, parts(4568), settings_from(cluster))
    assert "each rank sent at most 4.5 KiB per iteration" in hosts
    assert unconstrained_link("big", big, parts(10**6), settings_from(cluster)) == []
