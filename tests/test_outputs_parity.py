"""A run's outputs mean the same in one process and in a cluster, finished or stopped.

Service time (so samples/s) is the job's own iterations added up in both modes; a stopped
cluster run keeps the running job's first start and service time; a stopped cluster run's
summary has a finished one's keys; every summary says its ``cluster_mode``; and trace.json
names a job's iteration spans one way whichever mode made them. No processes: the records
are built by hand.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig
from accelopt.drivers.cluster.driver import ClusterDriver
from accelopt.drivers.cluster.outcome import build_outcome, stopped_outcome
from accelopt.drivers.cluster.rank import JobPart, RankJob, RankResult, RankSoFar
from accelopt.drivers.cluster.settings import ClusterSettings, settings_from
from accelopt.records import JobResult, RunRecord, Span
from accelopt.report.chrome_trace import chrome_trace
from accelopt.report.metrics import run_metrics
from accelopt.runtime.run import _ended_before
from accelopt.types import JobInfo, RunInfo

pytestmark = pytest.mark.timeout(30)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _info(job_id: str, iterations: int = 2) -> JobInfo:
    return JobInfo(job_id=job_id, name=job_id[3:], model="mlp", kind="train", arrival_s=0.0,
                   iterations=iterations, batch_size=4)


def _settings(mode: str = "ps") -> ClusterSettings:
    cluster = OmegaConf.structured(ClusterConfig)
    cluster.mode, cluster.workers = mode, 1 if mode == "ps" else 2
    return settings_from(cluster)


def _records(starts: list[float], length: float = 0.25) -> list[dict]:
    return [{"iteration": i, "start_s": t, "end_s": t + length, "loss": 1.0, "samples": 4}
            for i, t in enumerate(starts)]


def _finished(infos: list[JobInfo], starts: dict[str, list[float]],
              settings: ClusterSettings):
    """A finished run of ``infos`` (ps: rank 0 the server, rank 1 the worker; all-reduce:
    two workers), each job's iterations starting at ``starts[job_id]`` and taking 0.25 s."""
    ranks = []
    for rank in range(settings.world_size):
        role = settings.role(rank)
        parts = {i.job_id: JobPart(rank=rank, role=role, job=i,
                                   iterations=_records(starts[i.job_id])
                                   if role == "worker" else [])
                 for i in infos}
        ranks.append(RankResult(rank=rank, role=role, pid=rank, parts=parts,
                                train_t0=0.0 if rank == 0 else None,
                                statuses={i.job_id: ("done", "") for i in infos}
                                if rank == 0 else {}))
    return build_outcome(ranks, settings)


def test_a_cluster_jobs_service_time_is_its_own_iterations_not_its_first_start_to_end():
    """Two jobs taking turns: job a's iterations at 0 s and 10 s (job b ran between) served
    it 0.5 s, as one process adds up its iterations' spans; its first start to its last end
    (10.25 s) counted job b's time, and read 40x fewer samples/s than one process."""
    a, b = _info("00-a"), _info("01-b")
    out = _finished([a, b], {"00-a": [0.0, 10.0], "01-b": [1.0, 1.25]}, _settings())
    got = {r.job.job_id: r for r in out.results}
    assert got["00-a"].service_s == pytest.approx(0.5)
    assert got["00-a"].throughput == pytest.approx(8 / 0.5)
    assert got["01-b"].service_s == pytest.approx(0.5)
    # the leader's record of a job (a stopped run's report) counts it alike
    part = RankJob.__new__(RankJob)
    part.iterations, part.carried_service_s = _records([0.0, 10.0]), 1.0
    assert part.service_s() == pytest.approx(1.5)


def test_a_stopped_cluster_runs_running_job_keeps_its_first_start_and_service_time():
    """The job a plugin stopped at iteration 3: its record has its queueing delay and
    service time, and the report gives it a first start and samples/s, as one process
    does (they were null in a cluster run only)."""
    info = _info("00-tiny-mlp", iterations=10)
    ended = {"00-tiny-mlp": {"status": "running", "current": True, "iterations": 0,
                             "queueing_s": 0.004, "service_s": 0.1,
                             "carried_service_s": 0.0}}
    got = _ended_before(JobResult(info), ended, reached=3, completed=3, service=0.3)
    assert got.iterations_done == 3
    assert got.admitted_s == pytest.approx(0.0)
    assert got.first_start_s == pytest.approx(0.004)
    assert got.queueing_s == pytest.approx(0.004)
    assert got.service_s == pytest.approx(0.3)
    assert got.throughput == pytest.approx(12 / 0.3)
    # no worker's records: what the leader recorded
    got = _ended_before(JobResult(info), ended, reached=3)
    assert got.service_s == pytest.approx(0.1) and got.first_start_s == pytest.approx(0.004)


def test_the_leaders_record_of_a_running_job_carries_its_first_start_and_service():
    """The leader's switch to a job records it before its first iteration; once that
    iteration ran, the record gets its queueing delay and service time so far."""
    info = _info("00-j", iterations=10)
    part = SimpleNamespace(job=SimpleNamespace(iteration=0, info=info),
                           carried_service_s=0.0, queueing_s=lambda: None,
                           service_s=lambda: 0.0)
    driver = ClusterDriver.__new__(ClusterDriver)
    driver.jobs, driver.progress = {"00-j": part}, None
    driver._ended_jobs, driver._ended_lock, driver._service = {}, threading.Lock(), {}
    driver._switched("00-j")
    assert driver._ended_jobs["00-j"]["queueing_s"] is None
    part.job.iteration, part.queueing_s, part.service_s = 1, (lambda: 0.25), (lambda: 0.5)
    driver._started("00-j")
    record = driver._ended_jobs["00-j"]
    assert record["status"] == "running" and record["current"] is True
    assert (record["queueing_s"], record["service_s"], record["iterations"]) == (0.25, 0.5, 1)


def _stopped(infos: list[JobInfo], settings: ClusterSettings, with_records: bool):
    """A stopped run's outcome: every worker left two iterations of the first job (or
    nothing, ``with_records=False``)."""
    job_id = infos[0].job_id
    left = [] if 0 in settings.worker_ranks() else [RankSoFar(0, {}, {}, [])]
    for rank in settings.worker_ranks() if with_records else ():
        process = f"rank {rank} (worker)"
        spans = [Span("iteration", "iteration", float(i), i + 0.25, "iteration",
                      process=process, args={"iteration": i, "job": job_id})
                 for i in range(2)]
        spans += [Span("fwd", "compute", i + 0.05, i + 0.2, "compute", process=process,
                       args={"iteration": i}) for i in range(2)]
        left.append(RankSoFar(rank, {job_id: spans}, {job_id: _records([0.0, 1.0])}, []))
    return stopped_outcome(left, [JobResult(i) for i in infos], settings)


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
@pytest.mark.parametrize("n_jobs", [1, 2])
@pytest.mark.parametrize("with_records", [True, False])
def test_a_stopped_cluster_runs_summary_has_a_finished_runs_keys(mode, n_jobs, with_records):
    """A script reading ``summary["bytes_per_iteration"]`` got a KeyError from a failed
    cluster run only: it had ``worker_bytes_per_iteration`` and the warm-up figures where a
    finished run of several jobs has neither, and lacked ``bytes_per_iteration``,
    ``cluster_backend``, the transfer counts and ``job_switches``."""
    settings = _settings(mode)
    infos = [_info("00-a"), _info("01-b")][:n_jobs]
    finished = _finished(infos, {"00-a": [0.0, 1.0], "01-b": [2.0, 3.0]}, settings)
    stopped = _stopped(infos, settings, with_records)
    assert set(stopped.metrics) == set(finished.metrics)
    assert "bytes_per_iteration" in stopped.metrics
    assert stopped.metrics["cluster_mode"] == mode
    if n_jobs == 2:
        assert "job.b.bytes_per_iteration" in stopped.metrics
        assert "job.b.achieved_bandwidth_bps" in stopped.metrics
    if with_records and n_jobs == 1:  # what the ranks left is kept
        assert stopped.metrics["iteration_s"] == pytest.approx(0.25)


def test_a_one_process_runs_summary_says_its_cluster_mode():
    """A cluster run's summary has ``cluster_mode``; a one-process run's had no such key."""
    record = RunRecord(info=RunInfo("run", "cpu", (), (), 0))
    assert run_metrics(record)["cluster_mode"] == "none"


def _events(record: RunRecord) -> list[dict]:
    return [e for e in chrome_trace(record)["traceEvents"]
            if e["ph"] == "X" and e["cat"] == "iteration"]


def test_trace_names_a_jobs_iteration_spans_alike_in_one_process_and_a_cluster():
    """One process recorded ``args.job`` as the job's name and the span as the name; a
    cluster rank its id, and ``iteration 0`` (one job) or ``mlp-a iteration 0``: trace.json
    gives ``args.job`` the id (as per_iteration.json), ``args.name`` the name and
    ``<name> iteration <i>`` for each."""
    info = _info("00-mlp-a")
    local = RunRecord(info=RunInfo("run", "cpu", (), (info,), 0), jobs=[JobResult(info)],
                      spans=[Span("mlp-a", "lane default", 0.0, 1.0,
                                  args={"job": "mlp-a", "iteration": 0})])
    one = Span("iteration 0", "iteration", 0.0, 1.0, "iteration", process="rank 1 (worker)",
               args={"rank": 1, "job": "00-mlp-a", "iteration": 0})
    several = Span("mlp-a iteration 0", "iteration", 0.0, 1.0, "iteration",
                   process="rank 1 (worker)", args={"rank": 1, "job": "00-mlp-a",
                                                    "iteration": 0})
    for record in (local, RunRecord(info=local.info, jobs=local.jobs, spans=[one]),
                   RunRecord(info=local.info, jobs=local.jobs, spans=[several])):
        (event,) = _events(record)
        assert event["name"] == "mlp-a iteration 0"
        assert event["args"]["job"] == "00-mlp-a" and event["args"]["name"] == "mlp-a"
        assert event["args"]["iteration"] == 0


def test_the_docs_say_a_stopped_cluster_run_keeps_every_ranks_timeline():
    """docs/distributed.md said both that a failed cluster run's per-rank timelines are not
    kept and that trace.json holds them up to the stop (what the run does)."""
    text = " ".join((DOCS / "distributed.md").read_text().split())
    assert "timelines end with their processes and are not kept" not in text
    assert "every rank's timeline up to the stop" in text
