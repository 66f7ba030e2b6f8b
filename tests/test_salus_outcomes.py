"""What salus's runs and service report about jobs that did not run to their end: the
makespan over the jobs that ran, a killed service's job with unknown progress, a custom
policy's bad ``max_lanes``, and a workload submitted to the service arriving together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accelopt_plugins.salus.service import ServeOptions
from clirun import accelopt, the_error_line

from accelopt import ConfigError, UserError
from accelopt.records import JobResult, RunInfo, RunRecord
from accelopt.report import run_metrics
from accelopt.types import JobInfo

pytestmark = pytest.mark.timeout(120)
TINY = {"model": "mlp", "iterations": 8, "width": 16, "batch_size": 8}


def _info(job_id: str, arrival: float) -> JobInfo:
    return JobInfo(job_id=job_id, name=job_id, model="mlp", kind="train", arrival_s=arrival,
                   iterations=5, batch_size=16)


def test_a_job_that_failed_while_profiled_does_not_stretch_the_makespan() -> None:
    """salus rejected a job at 0 s, another failed while its memory was profiled (arrived at
    0.1 s, no first start, no end, no iteration) and the one job that ran arrived at 0.5 s
    and ended at 0.539 s: the makespan read 0.439 (from the failed job's arrival)."""
    rejected = JobResult(_info("e", 0.0), "rejected", error="does not fit", end_s=0.0)
    failed = JobResult(_info("pf", 0.1), "failed", error="a step measuring its memory, "
                       "before training, raised RuntimeError: boom")
    ran = JobResult(_info("ok", 0.5), "done", first_start_s=0.5, end_s=0.539,
                    iterations_done=5)
    record = RunRecord(info=RunInfo("r", "cpu", ("salus",), tuple(j.job for j in
                                                                 (rejected, failed, ran)), 0),
                       jobs=[rejected, failed, ran])
    assert run_metrics(record)["makespan_s"] == pytest.approx(0.039)
    # a job that failed in its first iteration ran: it started, and its arrival counts
    failed.first_start_s, failed.end_s = 0.2, 0.25
    assert run_metrics(record)["makespan_s"] == pytest.approx(0.439)
    # a stopped run with a job that never ended: unknown, as before
    failed.first_start_s, failed.end_s = None, None
    record.metrics = {"error": "interrupted (Ctrl-C)"}
    assert run_metrics(record)["makespan_s"] is None


def _service(tmp_path: Path):
    from accelopt_plugins.salus.service import Service

    return Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                capacity="256MiB", threads=1))


def test_a_job_a_killed_service_left_has_unknown_progress_not_zero(tmp_path, monkeypatch,
                                                                   capsys):
    """A job that had run ~200 of its 8000 iterations when its service was killed (kill -9)
    was marked failed by the next service with ``iterations: 0``: the service kept no
    record of its progress, so 0 was a false figure. It is ``null`` (unknown) in its
    job.json and ``status``, and ``accelopt status`` shows ``?/8000``."""
    from accelopt_plugins.salus import cli
    from accelopt_plugins.salus.service import INTERRUPTED

    job_dir = tmp_path / "root" / "jobs" / "001-victim"
    job_dir.mkdir(parents=True)
    (job_dir / "config.json").write_text(json.dumps({**TINY, "name": "victim",
                                                     "iterations": 8000}))
    service = _service(tmp_path)
    try:
        assert service.recover() == ["001-victim"]
        reply = service.status()
    finally:
        service.executor.close()
        service.finish_outputs()
    doc = json.loads((job_dir / "job.json").read_text())["job"]
    assert (doc["status"], doc["error"]) == ("failed", INTERRUPTED)
    assert doc["iterations"] is None and doc["samples"] is None and doc["jct_s"] is None
    (row,) = reply["jobs"]
    assert row["done"] is None and row["iterations"] == 8000
    monkeypatch.setattr(cli, "_ask", lambda opts, message: {**reply, "ok": True})
    assert cli.status_cmd([]) == 0
    shown = capsys.readouterr().out
    assert "?/8000" in shown and "None/8000" not in shown


class TwoLanes:
    """A policy whose ``max_lanes`` is no count (a user's class, not a salus ``Policy``)."""

    max_lanes = "two"

    def select(self, lane, ready, now_s):
        return ready[0].job.job_id


def test_a_policy_whose_max_lanes_is_no_count_is_one_line_naming_it() -> None:
    """``max_lanes = "two"`` stopped the plugin's creation with ``ValueError: invalid
    literal for int()``, naming neither the policy nor the values it may take."""
    from accelopt_plugins.salus.policies import Policy, make_policy

    with pytest.raises(ConfigError, match=r"test_salus_outcomes:TwoLanes\.max_lanes is 'two'; "
                       r"it must be a whole number >= 0"):
        make_policy("test_salus_outcomes:TwoLanes")

    class Negative(Policy):
        max_lanes = -2

        def select(self, lane, ready, now_s):
            return ready[0].job.job_id

    from accelopt_plugins.salus.policies import as_policy

    for bad in (-2, 1.5, True, None):
        Negative.max_lanes = bad  # type: ignore[assignment]
        with pytest.raises(ConfigError, match=r"Negative\.max_lanes is "):
            as_policy(Negative, "x:Negative")
    for good in (0, 1, 3):
        Negative.max_lanes = good
        assert as_policy(Negative, "x:Negative").max_lanes == good


def test_a_policy_whose_max_lanes_is_no_count_is_said_by_the_run(tmp_path) -> None:
    """The run's own error line, as the user met it (``plugin 'salus' could not be created:
    ValueError: invalid literal for int() with base 10: 'two'``)."""
    (tmp_path / "mypol.py").write_text(
        "class Lanes:\n    max_lanes = 'two'\n\n"
        "    def select(self, lane, ready, now_s):\n        return ready[0].job.job_id\n")
    result = accelopt("run", "+plugins=[salus]", "plugins.salus.policy=mypol:Lanes",
                      "workload=tiny", "run.compare=none", f"hydra.run.dir={tmp_path / 'run'}",
                      cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    line = the_error_line(result)
    assert "mypol:Lanes.max_lanes is 'two'" in line and "whole number >= 0" in line
    assert "invalid literal" not in line


def test_a_workloads_jobs_arrive_together_after_all_were_profiled(tmp_path) -> None:
    """``accelopt submit --workload salus_mix`` profiled each job and handed it to the
    executor before profiling the next: the jobs arrived at 156.26, 156.72, 156.92 and
    157.84 s and one had ended before the last arrived. Every job is profiled first; all
    arrive after the last profiling, under one executor lock (none starts before the last
    arrived)."""
    service = _service(tmp_path)
    profile = service.executor.profiler
    profiled_at: list[float] = []

    def timed(job):  # when each profiling ended, on the executor's clock
        measured = profile(job)
        profiled_at.append(service.executor.now())
        return measured

    service.executor.profiler = timed
    try:
        ids = service.handle({"op": "submit", "workload": "tiny"})["submitted"]
        arrivals = {info.job_id: info.arrival_s for info, _, _ in service.executor.snapshot()}
    finally:
        service.executor.close()
        service.finish_outputs()
    assert ids == ["001-tiny-mlp", "002-tiny-cnn"] and len(profiled_at) == 2
    assert min(arrivals.values()) >= max(profiled_at)
    for job_id in ids:  # config.json says the arrival the executor gave it
        config = json.loads((tmp_path / "root" / "jobs" / job_id / "config.json").read_text())
        assert config["arrival_s"] == arrivals[job_id]


def test_one_refused_job_refuses_the_whole_workload(tmp_path) -> None:
    """A workload's job refused at submit (its model raises while profiled) left the jobs
    before it taken while the submit answered an error: nothing is taken, no number, no
    files."""
    service = _service(tmp_path)
    profile = service.executor.profiler

    def raises_for_the_cnn(job):
        if job.info.name == "tiny-cnn":
            raise RuntimeError("boom")
        return profile(job)

    service.executor.profiler = raises_for_the_cnn
    try:
        with pytest.raises(UserError, match="job 'tiny-cnn' refused: .*boom.*; no job of this "
                           "submit was taken"):
            service.handle({"op": "submit", "workload": "tiny"})
        assert service.executor.snapshot() == []
        service.executor.profiler = profile
        (job_id,) = service.handle({"op": "submit", "job": {**TINY, "name": "z"}})["submitted"]
    finally:
        service.executor.close()
        service.finish_outputs()
    assert job_id == "001-z"
    assert [p.name for p in (tmp_path / "root" / "jobs").iterdir()] == ["001-z"]
