"""A resumed run's clock: every job's arrival moves onto it, so a job that had arrived when
the run was stopped (queued without a checkpoint, or checkpointed) is there from the start
and its JCT, queueing delay and the makespan line up with the old run's clock, across any
number of resumes. Checkpoints are made directly and the executor runs on a fake clock (one
second per iteration): no signal timing, no sleeps."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from accelopt import PluginSpec, hookimpl
from accelopt.config import JobConfig
from accelopt.drivers.local import Executor
from accelopt.host import PluginHost
from accelopt.job import Job, build_jobs
from accelopt.job.checkpoint import CHECKPOINT_DIR, Checkpointer, restore
from accelopt.records import JobResult, RunInfo, RunRecord
from accelopt.report.metrics import run_metrics

FIRST, QUEUED = "00-first", "01-queued"


def _specs() -> list[JobConfig]:
    """``first`` arrives at 0 and runs 3 iterations; ``queued`` arrives at 3 and runs 2."""
    return [JobConfig(name="first", model="mlp", width=4, batch_size=4, iterations=3, seed=0),
            JobConfig(name="queued", model="mlp", width=4, batch_size=4, iterations=2, seed=1,
                      arrival_s=3.0)]


def _ticking() -> tuple[PluginHost, list[float]]:
    """A host whose only plugin moves a fake clock one second at each iteration's end."""
    clock = [0.0]

    class Tick:
        @hookimpl
        def accelopt_iteration_end(self, context, result) -> None:
            clock[0] += 1.0

    return PluginHost([(PluginSpec(name="tick", factory=lambda c: Tick()), Tick())]), clock


def _jobs(host: PluginHost | None = None) -> list[Job]:
    return build_jobs(_specs(), torch.device("cpu"), host)


def _first_checkpointed_at(old: Path, clock_s: float) -> None:
    """The old run stopped at ``clock_s`` on its clock: ``first`` (started at 0) has a
    checkpoint written then, ``queued`` (arrived at 3) none: it was still waiting."""
    first = _jobs()[0]
    before = Checkpointer(old, every=1, save_weights=False)
    before.clock = lambda: clock_s
    before.save(first, JobResult(first.info, status="running", first_start_s=0.0))


def _resume(old: Path, new: Path) -> tuple[dict[str, JobResult], dict[str, float]]:
    """Restore ``old`` into fresh jobs and run them on the fake clock; the results and the
    run's summary (JCT, queueing delay, makespan)."""
    host, _clock = _ticking()
    jobs = _jobs(host)
    checkpointer = Checkpointer(new, every=0, save_weights=False)
    restored = restore(old, jobs, checkpointer)
    executor = Executor(host, jobs, capacity_bytes=None, device="cpu", profiler=None,
                        clock=lambda: _clock[0], results=restored)
    results = executor.run()
    summary = run_metrics(RunRecord(info=RunInfo("new", "cpu", (), (), 0), jobs=results))
    return {r.job.job_id: r for r in results}, summary


def test_a_job_queued_at_the_stop_is_there_from_the_resumed_runs_start(tmp_path):
    """Stopped at 8 s with ``queued`` waiting since 3 s: it arrived again at 3 s on the
    resumed clock (admitted at 3, absent from scheduling until then), and its JCT, queueing
    delay and the makespan lost those 3 s (JCT 9 for 12, queueing 7 for 10, makespan 13
    though it ran after ``first``, which ended at 8 + 5 = 13 on the old clock)."""
    old = tmp_path / "old"
    _first_checkpointed_at(old, 8.0)
    jobs, summary = _resume(old, tmp_path / "new")
    first, queued = jobs[FIRST], jobs[QUEUED]
    # FIFO: first (arrived earlier) runs 0 -> 3, queued 3 -> 5 on the resumed clock
    assert first.end_s == pytest.approx(3.0) and queued.first_start_s == pytest.approx(3.0)
    assert first.jct_s == pytest.approx(8.0 + 3.0)  # 0 -> 11 on the old clock
    assert queued.jct_s == pytest.approx(8.0 + 5.0 - 3.0)  # 3 -> 13 on the old clock
    assert queued.queueing_s == pytest.approx(8.0 + 3.0 - 3.0)
    assert summary["makespan_s"] == pytest.approx(13.0)
    assert queued.admitted_s == pytest.approx(0.0)  # there from the start
    assert first.job.arrival_s == pytest.approx(-8.0)  # on the resumed clock: 8 s before it
    assert queued.job.arrival_s == pytest.approx(-5.0)
    for result in (first, queued):  # one clock: a row's own times give its figures
        assert result.end_s - result.job.arrival_s == pytest.approx(result.jct_s)
    assert summary["makespan_s"] == pytest.approx(
        max(r.end_s for r in jobs.values()) - min(r.job.arrival_s for r in jobs.values()))


def test_a_job_not_arrived_at_the_stop_arrives_as_late_after_the_resume(tmp_path):
    """Stopped at 1 s, before ``queued`` arrived (3 s): it arrives 2 s into the resumed run;
    on the old clock it arrived at 3 and ended 1 + 5 = 6 after the resume's start."""
    old = tmp_path / "old"
    _first_checkpointed_at(old, 1.0)
    jobs, summary = _resume(old, tmp_path / "new")
    queued = jobs[QUEUED]
    assert queued.job.arrival_s == pytest.approx(2.0)
    assert queued.end_s == pytest.approx(5.0)
    assert queued.jct_s == pytest.approx(1.0 + 5.0 - 3.0)
    assert summary["makespan_s"] == pytest.approx(1.0 + 5.0)


def test_a_checkpointed_job_that_arrived_late_counts_from_its_arrival_on_the_old_clock(
        tmp_path):
    """``queued`` (arrived at 3) had a checkpoint at 6 s and the run stopped at 8 s: its
    arrival was replayed at 3 s on the resumed clock (it waited for it) and its JCT was its
    part here from that arrival plus 3 s carried, missing 3 s and the 2 s it had run after
    its checkpoint (work lost, done again)."""
    old = tmp_path / "old"
    _first_checkpointed_at(old, 8.0)
    queued = _jobs()[1]
    before = Checkpointer(old, every=1, save_weights=False)
    before.clock = lambda: 6.0
    before.save(queued, JobResult(queued.info, status="running", first_start_s=4.0))
    assert torch.load(old / CHECKPOINT_DIR / f"{QUEUED}.pt",
                      weights_only=False)["timing"]["elapsed_s"] == pytest.approx(3.0)
    jobs, summary = _resume(old, tmp_path / "new")
    result = jobs[QUEUED]
    assert result.admitted_s == pytest.approx(0.0)
    assert result.jct_s == pytest.approx(8.0 + 5.0 - 3.0)
    assert result.queueing_s == pytest.approx(1.0)  # as its checkpoint had it: 3 -> 4
    assert summary["makespan_s"] == pytest.approx(8.0 + 5.0)


def test_a_resumed_run_stopped_and_resumed_again_accumulates_on_the_first_clock(tmp_path):
    """Run 1 stops at 8 s (``queued`` waiting); run 2 starts ``queued`` at its 1 s and
    checkpoints it at its 2 s (10 s on run 1's clock), then stops; run 3 finishes both.
    Every figure is on run 1's clock: ``queued`` arrived at 3, first started at 9, and it
    ends in run 3 at 3 + 2 (after ``first``) = 15."""
    one, two = tmp_path / "one", tmp_path / "two"
    _first_checkpointed_at(one, 8.0)
    shutil.copytree(one / CHECKPOINT_DIR, two / CHECKPOINT_DIR)  # what a resume carries

    jobs = _jobs()
    during = Checkpointer(two, every=1, save_weights=False)
    restored = restore(one, jobs, during)
    assert during.clock_offset == pytest.approx(8.0)
    queued = restored.get(QUEUED) or JobResult(jobs[1].info)  # as the executor takes it
    queued.status, queued.first_start_s = "running", 1.0
    during.clock = lambda: 2.0
    during.save(jobs[1], queued)
    timing = torch.load(two / CHECKPOINT_DIR / f"{QUEUED}.pt", weights_only=False)["timing"]
    assert timing["clock_s"] == pytest.approx(10.0)
    assert timing["elapsed_s"] == pytest.approx(10.0 - 3.0)
    assert timing["queueing_s"] == pytest.approx(9.0 - 3.0)
    assert restored[FIRST].carried_s == 0.0  # its arrival on the clock counts its past

    results, summary = _resume(two, tmp_path / "three")
    first, queued = results[FIRST], results[QUEUED]
    assert first.job.arrival_s == pytest.approx(-10.0)
    assert first.jct_s == pytest.approx(10.0 + 3.0)
    assert queued.jct_s == pytest.approx(10.0 + 5.0 - 3.0)
    assert queued.queueing_s == pytest.approx(6.0)
    assert summary["makespan_s"] == pytest.approx(15.0)


def test_a_finished_job_keeps_its_times_on_the_resumed_clock(tmp_path):
    """A job that had finished before the resume: its end and first start are its arrival
    on the resumed clock plus its JCT and queueing delay (both before the resume's 0)."""
    old = tmp_path / "old"
    first = _jobs()[0]
    before = Checkpointer(old, every=1, save_weights=False)
    before.clock = lambda: 4.0
    before.save(first, JobResult(first.info, status="done", first_start_s=0.5, end_s=4.0))
    _first, queued = _jobs()
    later = Checkpointer(old, every=1, save_weights=False)
    later.clock = lambda: 6.0
    later.save(queued, JobResult(queued.info, status="running", first_start_s=4.0))
    restored = restore(old, _jobs())
    done = restored[FIRST]
    assert done.job.arrival_s == pytest.approx(-6.0)
    assert done.end_s == pytest.approx(-2.0) and done.jct_s == pytest.approx(4.0)
    assert done.first_start_s == pytest.approx(-5.5) and done.queueing_s == pytest.approx(0.5)


def test_a_cluster_rank_moves_its_jobs_onto_the_resumed_clock(tmp_path):
    """A rank's part of a job: a queued one (no checkpoint) and one with a checkpoint both
    arrive on the resumed clock and carry nothing; a finished one carries its JCT."""
    from accelopt.drivers.cluster.checkpoints import RankCheckpointer, restore_part

    old = tmp_path / "old"
    first, queued = _jobs()
    directory = old / CHECKPOINT_DIR / first.info.job_id
    directory.mkdir(parents=True)
    state = {"job": first.state_dict(), "iterations": [], "elapsed_s": 7.0, "service_s": 6.0,
             "queueing_s": 0.0, "spec": asdict(first.spec), "clock_s": 8.0}
    torch.save(state, directory / "rank0.it00000000.pt")

    def part(job: Job) -> SimpleNamespace:
        return SimpleNamespace(job=job, carried_s=0.0, carried_queueing_s=None,
                               carried_service_s=0.0, iterations=[],
                               checkpointer=RankCheckpointer(tmp_path / "new", 5, 0, 1))

    waiting, running = part(queued), part(first)
    assert restore_part(old, waiting, rank=0, world=1) is False
    assert waiting.job.info.arrival_s == pytest.approx(3.0 - 8.0)
    assert waiting.carried_s == 0.0 and waiting.checkpointer.clock_offset == pytest.approx(8.0)
    assert restore_part(old, running, rank=0, world=1) is True
    assert running.job.info.arrival_s == pytest.approx(-8.0)
    assert running.carried_s == 0.0 and running.carried_queueing_s == 0.0

    first.iteration = first.info.iterations  # its last checkpoint: the job had finished
    state["job"] = first.state_dict()
    torch.save(state, directory / "rank0.it00000000.pt")
    finished = part(_jobs()[0])
    assert restore_part(old, finished, rank=0, world=1) is True
    assert finished.carried_s == pytest.approx(7.0)
