"""A resumed job's first start, and a resume's cluster mode: both are the resumed run's.

A job that had started before the run was stopped first started then: on the resumed
clock its first start is its arrival plus the queueing delay its checkpoint carried (before
the resume's 0), in one process and in a cluster alike, so ``first_start_s - arrival_s`` is
its queueing delay (docs/distributed.md). And ``accelopt.run`` decides whether a resume is a
cluster run by the saved run's config, not by the default one its overrides compose.
Checkpoints are made directly and the executor runs on a fake clock: no signals, no sleeps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig, JobConfig
from accelopt.drivers.local import Executor
from accelopt.host import PluginHost
from accelopt.job import Job, build_jobs
from accelopt.job.checkpoint import CHECKPOINT_DIR, Checkpointer, restore
from accelopt.records import JobResult

pytestmark = pytest.mark.timeout(120)
FIRST, LATER = "00-first", "01-later"


def _jobs() -> list[Job]:
    """``first`` arrives at 0 (3 iterations), ``later`` at 3 (2 iterations)."""
    specs = [JobConfig(name="first", model="mlp", width=4, batch_size=4, iterations=3, seed=0),
             JobConfig(name="later", model="mlp", width=4, batch_size=4, iterations=2, seed=1,
                       arrival_s=3.0)]
    return build_jobs(specs, torch.device("cpu"), None)


def _stopped_at_8(old: Path) -> None:
    """The old run stopped at 8 s on its clock: ``first`` had first started at 0.5 (checkpoint
    at 8 s), ``later`` at 4 (checkpoint at 6 s): queueing delays 0.5 and 1."""
    first, later = _jobs()
    for job, start, clock in ((first, 0.5, 8.0), (later, 4.0, 6.0)):
        checkpointer = Checkpointer(old, every=1, save_weights=False)
        checkpointer.clock = lambda c=clock: c
        checkpointer.save(job, JobResult(job.info, status="running", first_start_s=start))


def test_a_job_started_before_the_resume_first_started_then(tmp_path):
    """It was the resumed run's first iteration (0 and 3 here: after the resume), which
    disagreed with the queueing delay carried beside it (0.5 and 1)."""
    old = tmp_path / "old"
    _stopped_at_8(old)
    jobs = _jobs()
    restored = restore(old, jobs, Checkpointer(tmp_path / "new", every=0, save_weights=False))
    tick = [0.0]
    results = Executor(PluginHost([]), jobs, capacity_bytes=None, device="cpu", profiler=None,
                       clock=lambda: tick.__setitem__(0, tick[0] + 0.25) or tick[0],
                       results=restored).run()
    by_id = {r.job.job_id: r for r in results}
    first, later = by_id[FIRST], by_id[LATER]
    assert first.job.arrival_s == pytest.approx(-8.0) and later.job.arrival_s == pytest.approx(-5.0)
    assert first.first_start_s == pytest.approx(-7.5)  # 0.5 on the old clock
    assert later.first_start_s == pytest.approx(-4.0)  # 4 on the old clock
    for result, queueing in ((first, 0.5), (later, 1.0)):
        assert result.queueing_s == pytest.approx(queueing)
        assert result.first_start_s - result.job.arrival_s == pytest.approx(result.queueing_s)
        assert result.first_start_s < 0 < result.end_s


def test_a_first_start_carried_across_two_resumes_stays_on_the_first_clock(tmp_path):
    """Resumed (clock 8) and checkpointed again at the resumed run's 2 s (10 s): the next
    resume's first start is still 0.5 on the first run's clock, 9.5 s before its 0."""
    one, two = tmp_path / "one", tmp_path / "two"
    _stopped_at_8(one)
    shutil.copytree(one / CHECKPOINT_DIR, two / CHECKPOINT_DIR)
    jobs = _jobs()
    during = Checkpointer(two, every=1, save_weights=False)
    restored = restore(one, jobs, during)
    during.clock = lambda: 2.0
    during.save(jobs[0], restored[FIRST])
    again = restore(two, _jobs())
    assert again[FIRST].job.arrival_s == pytest.approx(-10.0)
    assert again[FIRST].first_start_s == pytest.approx(-9.5)
    assert again[FIRST].queueing_s == pytest.approx(0.5)


def test_a_cluster_jobs_first_start_is_carried_as_its_queueing_delay(tmp_path):
    """A cluster run's outcome (ps, and allreduce alike): a job whose workers carried a
    queueing delay first started that long after its arrival, not at its first iteration
    measured after the resume."""
    from accelopt.drivers.cluster.outcome import build_outcome
    from accelopt.drivers.cluster.rank import JobPart, RankResult
    from accelopt.drivers.cluster.settings import settings_from
    from accelopt.types import JobInfo

    for mode, roles in (("ps", ("server", "worker")), ("allreduce", ("worker", "worker"))):
        cluster = OmegaConf.structured(ClusterConfig)
        cluster.mode, cluster.workers = mode, (1 if mode == "ps" else 2)
        info = JobInfo(job_id="00-mlp", name="mlp", model="mlp", kind="train",
                       arrival_s=-8.0, iterations=4, batch_size=4)
        carried = [{"iteration": i, "start_s": 0.0, "end_s": 0.0, "loss": 1.0, "samples": 4,
                    "carried": True} for i in range(2)]
        own = [{"iteration": 2 + i, "start_s": 1.0 + i, "end_s": 1.5 + i, "loss": 0.5,
                "samples": 4} for i in range(2)]
        ranks = []
        for rank, role in enumerate(roles):
            part = JobPart(rank=rank, role=role, job=info,
                           iterations=[*carried, *own] if role == "worker" else [])
            part.carried_queueing_s = 0.75 if role == "worker" else None
            ranks.append(RankResult(rank=rank, role=role, pid=rank, parts={"00-mlp": part},
                                    train_t0=0.25 if rank == 0 else None,
                                    statuses={"00-mlp": ("done", "")} if rank == 0 else {}))
        (result,) = build_outcome(ranks, settings_from(cluster)).results
        assert result.job.arrival_s == pytest.approx(-8.0), mode
        assert result.first_start_s == pytest.approx(-7.25), mode
        assert result.queueing_s == pytest.approx(0.75), mode
        assert result.first_start_s - result.job.arrival_s == pytest.approx(result.queueing_s)


def test_a_one_process_run_resumed_at_a_scripts_top_level_is_not_refused(tmp_path,
                                                                        monkeypatch):
    """The overrides ``run.resume=B`` compose the default workload (a ps cluster), which
    refused the resume of a one-process run as a cluster run called outside the main guard;
    the resume runs with the saved config, one process."""
    import accelopt
    from accelopt.drivers import processes

    old = tmp_path / "old"
    accelopt.run(["workload=tiny", "cluster.mode=none", "run.compare=none",
                  "run.progress=false", "workload.jobs.0.iterations=3",
                  "workload.jobs.1.iterations=3"], run_dir=old)
    asked: list[set[str]] = []

    def refused() -> None:
        raise AssertionError("checked as a cluster run")

    started_early = processes.rank_server_started_early
    monkeypatch.setattr(processes, "refuse_unguarded_main", refused)
    monkeypatch.setattr(processes, "rank_server_started_early",
                        lambda modes: asked.append(set(modes)) or started_early(modes))
    record = accelopt.run([f"run.resume={old}", "run.resume_finished=true",
                           "run.progress=false"], run_dir=tmp_path / "again")
    assert [j.status for j in record.jobs] == ["done", "done"]
    assert asked == [{"none"}]
