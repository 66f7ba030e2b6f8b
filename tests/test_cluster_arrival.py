"""A cluster job's arrival in ``metrics.json`` means what it means in one process.

``arrival_s`` is the configured arrival, counted from when training could start (every rank
had built every job), and a job's admission, first start and end are on that same training
clock, so JCT, queueing delay and the makespan keep their meaning and exclude process
start-up. A resumed job that had arrived before the stop is at a negative arrival whatever
either run's start-up took: the checkpoints' clock counts from the training start too.
No processes: the outcome is built from hand-made rank results, on a fake clock.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig, JobConfig
from accelopt.drivers.cluster.checkpoints import RankCheckpointer
from accelopt.drivers.cluster.driver import on_training_clock
from accelopt.drivers.cluster.outcome import build_outcome
from accelopt.drivers.cluster.rank import JobPart, RankResult
from accelopt.drivers.cluster.settings import settings_from
from accelopt.job.checkpoint import arrive_on_resumed_clock, resumed_clock
from accelopt.records import JobResult
from accelopt.report.metrics import job_metrics
from accelopt.types import JobInfo

pytestmark = pytest.mark.timeout(30)


def _info(job_id: str, arrival_s: float) -> JobInfo:
    return JobInfo(job_id=job_id, name=job_id[3:], model="mlp", kind="train",
                   arrival_s=arrival_s, iterations=2, batch_size=4)


def _outcome(infos: list[JobInfo], train_t0: float, starts: dict[str, float]):
    """A PS run's outcome (rank 0 a server, rank 1 the worker) whose leader reached
    ``train_t0`` on the ranks' clock; each job's two iterations start at ``starts[id]`` (the
    ranks' clock) and take 0.25 s each."""
    cluster = OmegaConf.structured(ClusterConfig)
    cluster.mode, cluster.workers = "ps", 1
    ranks = []
    for rank, role in enumerate(("server", "worker")):
        parts = {}
        for info in infos:
            t = starts[info.job_id]
            own = [{"iteration": i, "start_s": t + 0.25 * i, "end_s": t + 0.25 * (i + 1),
                    "loss": 1.0, "samples": 4} for i in range(2)] if role == "worker" else []
            parts[info.job_id] = JobPart(rank=rank, role=role, job=info, iterations=own)
        ranks.append(RankResult(
            rank=rank, role=role, pid=rank, parts=parts,
            train_t0=train_t0 if rank == 0 else None,
            statuses={i.job_id: ("done", "") for i in infos} if rank == 0 else {}))
    return build_outcome(ranks, settings_from(cluster))


def test_a_cluster_jobs_arrival_is_the_configured_one_not_the_start_up():
    """``accelopt run cluster.mode=ps`` reported arrival_s 1.896 for a job configured at 0
    (``cluster.mode=none``: 0.0): the arrival went on the ranks' clock, which starts with
    the launcher. Its first start, end, JCT and queueing delay are on the training clock
    with it."""
    infos = [_info("00-a", 0.0), _info("01-b", 0.4)]
    outcome = _outcome(infos, train_t0=1.9, starts={"00-a": 2.0, "01-b": 2.5})
    a, b = (job_metrics(r) for r in outcome.results)
    assert (a["arrival_s"], b["arrival_s"]) == (0.0, pytest.approx(0.4))
    assert a["admitted_s"] == 0.0 and b["admitted_s"] == pytest.approx(0.4)
    assert a["first_start_s"] == pytest.approx(0.1) and a["end_s"] == pytest.approx(0.6)
    assert b["first_start_s"] == pytest.approx(0.6) and b["end_s"] == pytest.approx(1.1)
    assert a["jct_s"] == pytest.approx(0.6) and a["queueing_s"] == pytest.approx(0.1)
    assert b["jct_s"] == pytest.approx(0.7) and b["queueing_s"] == pytest.approx(0.2)


def test_the_training_clock_moves_a_jobs_times_not_its_arrival():
    """The one conversion a finished run's outcome and a stopped run's ended record share:
    the measured times move ``train_t0`` earlier, the arrival stays, the JCT and queueing
    delay do not change; without a training clock nothing moves."""
    result = JobResult(_info("00-a", 0.5), status="done", admitted_s=3.0, first_start_s=3.25,
                       end_s=4.0)
    jct, queueing = 4.0 - 0.5, 3.25 - 0.5
    assert on_training_clock(result, 2.5) is result
    assert (result.job.arrival_s, result.admitted_s, result.first_start_s, result.end_s) == (
        0.5, pytest.approx(0.5), pytest.approx(0.75), pytest.approx(1.5))
    assert result.jct_s == pytest.approx(jct - 2.5)
    assert result.queueing_s == pytest.approx(queueing - 2.5)
    pending = JobResult(_info("01-b", 1.0))
    assert on_training_clock(pending, None).first_start_s is None
    assert on_training_clock(pending, 2.0).end_s is None


def _stopped_run(run_dir, train_t0: float, now: float) -> None:
    """The stopped run: job ``a``'s checkpoint after its iteration 2, written by rank 0 at
    ``now`` on the ranks' clock, whose training started at ``train_t0``."""
    spec = JobConfig(name="a", model="mlp", width=4, batch_size=4, iterations=4, seed=0)
    job = SimpleNamespace(info=_info("00-a", 0.0), iteration=2, done=False, spec=spec,
                          state_dict=lambda: {})
    part = SimpleNamespace(job=job, iterations=[], elapsed_s=lambda: now - train_t0,
                           service_s=lambda: 1.0, queueing_s=lambda: 0.0, now=lambda: now,
                           train_t0=train_t0)
    RankCheckpointer(run_dir, every=2, rank=0, world=2).after_step(part)


@pytest.mark.parametrize("resumed_t0", [0.2, 3.0])
@pytest.mark.parametrize("stopped_t0", [0.5, 4.0])
def test_a_resumed_job_that_had_arrived_is_at_a_negative_arrival_whatever_the_start_up(
        tmp_path, stopped_t0, resumed_t0):
    """A PS run stopped 1.5 s into training and resumed: the job that had arrived (at 0)
    read arrival_s +0.6 where the docs say negative, because its arrival on the resumed
    clock (-1.5 s, the checkpoints' clock counts from the training start) was reported
    ``train_t0`` later, and the resumed run took longer than that to start. Its arrival is
    -1.5 s whatever either run's start-up, and one that had not arrived (at 2 s) arrives
    0.5 s into the resumed training."""
    _stopped_run(tmp_path, stopped_t0, stopped_t0 + 1.5)
    clock = resumed_clock(tmp_path)
    assert clock == pytest.approx(1.5)
    arrived = SimpleNamespace(info=_info("00-a", 0.0))
    later = SimpleNamespace(info=_info("01-b", 2.0))
    for job in (arrived, later):
        arrive_on_resumed_clock(job, clock)
    outcome = _outcome([arrived.info, later.info], train_t0=resumed_t0,
                       starts={"00-a": resumed_t0 + 0.1, "01-b": resumed_t0 + 0.6})
    a, b = (job_metrics(r) for r in outcome.results)
    assert a["arrival_s"] == pytest.approx(-1.5) and b["arrival_s"] == pytest.approx(0.5)
    assert a["first_start_s"] == pytest.approx(0.1) and b["first_start_s"] == pytest.approx(0.6)
    assert a["jct_s"] == pytest.approx(1.5 + 0.6)  # the time before the resume counts
    assert b["queueing_s"] == pytest.approx(0.1)
