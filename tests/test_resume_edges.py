"""``run.resume`` at its edges: a job still waiting when the run was stopped, a directory
that is not a run, a damaged checkpoint, and a packed sweep's shared execution."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from clirun import accelopt, accelopt_in_process, run_files, run_in_process
from rich.console import Console

from accelopt.config import AccelConfig, JobConfig
from accelopt.errors import UserError
from accelopt.job import Job
from accelopt.job.checkpoint import Checkpointer, restore
from accelopt.records import JobResult, RunInfo, RunRecord
from accelopt.report.metrics import run_metrics


def _jobs() -> list[Job]:
    specs = [JobConfig(name="first", width=8, batch_size=8, iterations=20, seed=0),
             JobConfig(name="queued", width=8, batch_size=8, iterations=4, seed=1,
                       arrival_s=0.05),
             JobConfig(name="later", width=8, batch_size=8, iterations=4, seed=2,
                       arrival_s=9.0)]
    return [Job(s, job_id=f"{k:02d}-{s.name}", device=torch.device("cpu"))
            for k, s in enumerate(specs)]


def test_a_job_waiting_at_the_checkpoint_carries_its_wait_into_the_resume(tmp_path):
    """A job that had arrived but not started when the run was stopped (no checkpoint of
    its own) started at its arrival on the resumed run's clock: its queueing delay, JCT
    and the makespan lost the time it had waited (2.33 s of queueing read as 0.12 s). Every
    arrival now moves onto the resumed clock, 2 s (the old run's clock) earlier."""
    old = tmp_path / "old"
    first, queued, later = _jobs()
    before = Checkpointer(old, every=1, save_weights=False)
    before.clock = lambda: 2.0  # the old run's clock when the first job's checkpoint was written
    running = JobResult(first.info, status="running", first_start_s=0.0)
    before.save(first, running)

    jobs = _jobs()
    after = Checkpointer(tmp_path / "new", every=0, save_weights=False)
    restored = restore(old, jobs, after)
    assert [j.info.arrival_s for j in jobs] == pytest.approx([-2.0, -1.95, 7.0])
    assert restored["00-first"].carried_s == 0.0  # its arrival counts the time before
    assert set(restored) == {"00-first"}  # the others start from scratch
    assert after.clock_offset == pytest.approx(2.0)

    # the resumed run: the first job ends at 0.15, the queued one runs 0.15 -> 0.45
    done_first = restored["00-first"]
    done_first.status, done_first.end_s = "done", 0.15
    waited = JobResult(jobs[1].info, first_start_s=0.15)
    after.after_iteration(jobs[1], waited)
    waited.status, waited.end_s = "done", 0.45
    assert waited.queueing_s == pytest.approx(1.95 + 0.15)
    assert waited.jct_s == pytest.approx(1.95 + 0.45)
    record = RunRecord(info=RunInfo("new", "cpu", (), (), 0),
                       jobs=[done_first, waited])
    summary = run_metrics(record)
    assert summary["makespan_s"] == pytest.approx(2.0 + 0.45)
    assert summary["makespan_s"] >= max(j.job.arrival_s + j.jct_s for j in record.jobs)

    after.clock = lambda: 0.5  # its own checkpoints go on with the old run's clock
    after.save(jobs[1], waited)
    state = torch.load(tmp_path / "new" / "checkpoints" / "01-queued.pt", weights_only=False)
    assert state["timing"]["clock_s"] == pytest.approx(2.5)


def test_a_cluster_job_waiting_at_the_checkpoint_carries_its_wait(tmp_path):
    """The same in a cluster run: a rank's part of a job with no checkpoint of its own."""
    from accelopt.drivers.cluster.checkpoints import RankCheckpointer, restore_part

    old = tmp_path / "old"
    (old / "checkpoints" / "00-first").mkdir(parents=True)
    torch.save({"clock_s": 3.0}, old / "checkpoints" / "00-first" / "rank0.it00000010.pt")
    queued = _jobs()[1]
    part = SimpleNamespace(job=queued, carried_s=0.0, carried_queueing_s=None,
                           checkpointer=RankCheckpointer(tmp_path / "new", 5, 0, 1))
    assert restore_part(old, part, rank=0, world=1) is False  # starts from scratch
    assert part.job.info.arrival_s == pytest.approx(0.05 - 3.0)  # on the resumed clock
    assert part.carried_s == 0.0
    assert part.checkpointer.clock_offset == pytest.approx(3.0)


@pytest.mark.timeout(120)
def test_a_resumed_run_reports_the_wait_of_a_job_queued_when_it_stopped(tmp_path):
    """End to end: as if stopped at 5 s on its clock, the second job still queued (its
    checkpoint gone, the first job's saying 5 s): the resumed report counts the wait."""
    first, again = tmp_path / "first", tmp_path / "again"
    run_in_process("workload=tiny", "run.progress=false", "run.compare=none",
                   "run.checkpoint_every=2", run_dir=first)
    (first / "metrics.json").unlink()
    (first / "checkpoints" / "01-tiny-cnn.pt").unlink()
    path = first / "checkpoints" / "00-tiny-mlp.pt"
    state = torch.load(path, weights_only=False)
    state["timing"]["clock_s"] = 5.0
    torch.save(state, path)
    run_in_process(f"run.resume={first}", "run.progress=false", run_dir=again)
    metrics = json.loads((again / "metrics.json").read_text())
    cnn = next(j for j in metrics["jobs"] if j["name"] == "tiny-cnn")
    assert cnn["status"] == "done"
    assert cnn["arrival_s"] == pytest.approx(0.05 - 5.0)  # on the resumed run's clock
    assert cnn["queueing_s"] >= 5.0 - 0.05 and cnn["jct_s"] > cnn["queueing_s"]
    for job in metrics["jobs"]:  # one clock: each row's own times give its figures
        assert job["end_s"] - job["arrival_s"] == pytest.approx(job["jct_s"])
        assert job["first_start_s"] - job["arrival_s"] == pytest.approx(job["queueing_s"])
    assert metrics["summary"]["makespan_s"] == pytest.approx(
        max(j["end_s"] for j in metrics["jobs"]) - min(j["arrival_s"] for j in metrics["jobs"]))


@pytest.mark.parametrize("text", ["foo: 1\n", "", "workload:\n  name: x\n"],
                         ids=["other-keys", "empty", "no-jobs"])
def test_a_config_yaml_that_is_no_runs_is_refused_in_one_line(tmp_path, capfd, text):
    """A config.yaml of other keys ended in the schema merge's traceback after the new
    directory was made; an empty one was taken as a run that then had no jobs."""
    notrun = tmp_path / "notrun"
    notrun.mkdir()
    (notrun / "config.yaml").write_text(text)
    result = accelopt_in_process("run", f"run.resume={notrun}",
                                 f"hydra.run.dir={tmp_path / 'new'}", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not the config of a run that accelopt wrote" in lines[0]
    assert "resuming" not in result.stdout
    assert not (tmp_path / "new").exists()


@pytest.mark.timeout(120)
def test_a_damaged_checkpoint_is_refused_before_anything_is_written(tmp_path):
    """A truncated checkpoint was refused only once the new directory held the config, the
    log and a link to the damaged file; the hint asked to delete it in the directory a
    resume only reads."""
    first = tmp_path / "first"
    run_in_process("workload=single", "workload.jobs.0.iterations=4", "run.progress=false",
                   "run.checkpoint_every=2", run_dir=first)
    (first / "metrics.json").unlink()
    path = first / "checkpoints" / "00-mlp.pt"
    path.write_bytes(path.read_bytes()[:100])
    before = run_files(first)
    refused = accelopt("run", f"run.resume={first}", f"hydra.run.dir={tmp_path / 'again'}",
                       cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert f"cannot read checkpoint {path}" in line
    assert "copy the run directory, delete the file in the copy and resume the copy" in line
    assert not (tmp_path / "again").exists()
    assert run_files(first) == before


def test_a_damaged_rank_checkpoint_says_which_generation_is_used_without_it(tmp_path):
    from accelopt.drivers.cluster.checkpoints import refuse_unreadable

    directory = tmp_path / "checkpoints" / "00-job"
    directory.mkdir(parents=True)
    for rank in (0, 1):
        for iteration in (10, 20):
            torch.save({"clock_s": 1.0}, directory / f"rank{rank}.it{iteration:08d}.pt")
    (directory / "rank1.it00000020.pt").write_bytes(b"cut")
    with pytest.raises(UserError, match="resumes from iteration 10, the newest every rank "
                                        "still has") as info:
        refuse_unreadable(tmp_path)
    assert "\n" not in str(info.value)
    (directory / "rank1.it00000010.pt").unlink()
    with pytest.raises(UserError, match="its job restarts from scratch"):
        refuse_unreadable(tmp_path)


def test_a_resume_of_a_packed_sweeps_execution_says_it_writes_one_directory(tmp_path):
    """A killed hydra/launcher=salus sweep leaves only its salus-pack/; resuming it trained
    every job into one directory, not the sweep's run directories, and said nothing."""
    from omegaconf import OmegaConf

    from accelopt.runtime.run import _maybe_resume

    pack = tmp_path / "sweep" / "salus-pack"
    pack.mkdir(parents=True)
    saved = OmegaConf.structured(AccelConfig)
    saved.workload.jobs = [JobConfig(name="r0-job"), JobConfig(name="r1-job")]
    OmegaConf.save(saved, pack / "config.yaml")
    cfg = OmegaConf.structured(AccelConfig)
    cfg.run.resume = str(pack)
    out = io.StringIO()
    _maybe_resume(cfg, tmp_path / "new", Console(file=out, width=400))
    (note,) = [ln for ln in out.getvalue().splitlines() if ln.startswith("note:")]
    assert "hydra/launcher=salus" in note and "not into the sweep's run directories" in note
    assert Path(pack).is_dir()


def _stops_once(fired: list[int]):
    """A plugin that sends this process SIGTERM at its job's 3rd iteration, once in the
    test (``fired``): a ``run.compare=each`` run with it stops in its reference run with
    this plugin alone, the resumed run goes on."""
    import os
    import signal

    from accelopt import PluginSpec, hookimpl

    class StopAt:
        def __init__(self, _config=None) -> None:
            pass

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            if context.iteration == 3 and not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGTERM)

    return PluginSpec(name="stop_at", factory=StopAt)


@pytest.mark.timeout(120)
def test_a_run_stopped_in_its_reference_runs_is_resumed(tmp_path):
    """SIGTERM while the run.compare references ran: its config.yaml was written only after
    them, so the directory was refused ('has no config.yaml; pass the directory of a run
    that accelopt wrote') and the stop ended in a bare 'terminated (SIGTERM)'. Now it can be
    resumed: the references run again, then its jobs."""
    import signal

    from accelopt.cli.hydra_run import compose_checked, stopped_line
    from accelopt.config import register_plugin_configs, register_schema
    from accelopt.errors import Terminated, raise_terminated
    from accelopt.plugin import Registry
    from accelopt.runtime.run import execute

    fired: list[int] = []
    spec = _stops_once(fired)
    registry = Registry.discover()
    registry.add(spec)
    register_schema()
    register_plugin_configs([spec, registry.get("noop")])
    cfg = compose_checked(["+plugins=[stop_at,noop]", "run.compare=each", "workload=single",
                           "workload.jobs.0.iterations=8", "workload.jobs.0.width=8",
                           "run.checkpoint_every=2", "run.progress=false"])
    stopped, again = tmp_path / "stopped", tmp_path / "again"
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(Terminated):
            execute(cfg, run_dir=stopped, registry=registry, console=Console(file=io.StringIO()))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert fired and (stopped / "compare" / "stop_at" / "checkpoints" / "00-mlp.pt").is_file()
    assert not (stopped / "metrics.json").exists()  # its own jobs never began
    assert stopped_line("terminated (SIGTERM)", stopped) == (
        "terminated (SIGTERM) during the run.compare=each reference runs, before this run's "
        f"own jobs began: what they ran is kept in {stopped / 'compare'}; run it again (the "
        f"reference runs start over) with: accelopt run run.resume={stopped}")

    out = io.StringIO()
    record = execute(compose_checked([f"run.resume={stopped}"]), run_dir=again,
                     registry=registry, console=Console(file=out, width=400),
                     overrides=[f"run.resume={stopped}"])
    assert f"resuming {stopped}: it stopped during its run.compare=each reference runs" in \
        out.getvalue()
    assert [j.status for j in record.jobs] == ["done"]
    summary = json.loads((again / "metrics.json").read_text())["summary"]
    assert summary["resumed_from"] == str(stopped)
    assert {"compare.baseline.avg_jct_s", "compare.stop_at.avg_jct_s",
            "compare.noop.avg_jct_s"} <= set(record.metrics)
    for label in ("baseline", "stop_at", "noop"):  # started over, not carried
        ref = json.loads((again / "compare" / label / "metrics.json").read_text())
        assert [j["iterations"] for j in ref["jobs"]] == [8] and "resumed_from" not in \
            ref["summary"], label
    # its references ended: a resume of this directory continues its own jobs only
    assert "compare: none" in (again / "config.yaml").read_text()


@pytest.mark.timeout(120)
def test_a_run_stopped_after_its_jobs_ended_says_there_is_nothing_to_resume(tmp_path):
    """SIGTERM while the timeline was drawn (its jobs ended, metrics.json written): the
    line said 'continue it from its checkpoints with: accelopt run run.resume=D', which is
    refused as already finished, and named trace.json, which it had not written."""
    from accelopt.cli.hydra_run import stopped_line

    run_dir = tmp_path / "run"
    run_in_process("workload=single", "workload.jobs.0.iterations=4", "run.progress=false",
                   "run.checkpoint_every=2", run_dir=run_dir)
    for name in ("metrics.csv", "trace.json", "timeline.png"):  # stopped while writing these
        (run_dir / name).unlink()
    line = stopped_line("terminated (SIGTERM)", run_dir)
    assert line == (
        "terminated (SIGTERM) after its jobs ended (all 1 job(s) done), while it wrote its "
        f"outputs: {run_dir} holds metrics.json, not metrics.csv, trace.json, timeline.png; "
        "nothing to resume (the jobs' results and the run's figures are in metrics.json; run "
        "it again for the rest)")
    refused = accelopt("run", f"run.resume={run_dir}", f"hydra.run.dir={tmp_path / 'new'}",
                       cwd=tmp_path)
    assert refused.returncode == 2 and "already finished" in refused.stderr  # as it says


def test_a_stopped_line_names_only_what_the_run_kept(tmp_path):
    """A run killed before it wrote its evidence keeps only its checkpoints: the line named
    metrics.json and trace.json all the same (or, without metrics.json, was not said)."""
    from accelopt.cli.hydra_run import stopped_line

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "00-mlp.pt").write_bytes(b"")
    assert stopped_line("interrupted (Ctrl-C)", tmp_path) == (
        f"interrupted (Ctrl-C): its checkpoints are kept in {tmp_path}; continue it from its "
        f"checkpoints with: accelopt run run.resume={tmp_path}")
    (tmp_path / "checkpoints" / "00-mlp.pt").unlink()
    assert stopped_line("interrupted (Ctrl-C)", tmp_path) == ""  # nothing kept: the bare line


def test_a_stopped_line_does_not_count_an_empty_trace_as_kept(tmp_path):
    """A cluster run stopped with its ranks (SIGTERM to the process group) whose ranks left
    no timeline wrote a trace.json of no events: the line said its timeline was kept in it."""
    from accelopt.cli.hydra_run import stopped_line

    note = "the ranks' timelines ended with their processes and are not in trace.json"
    (tmp_path / "metrics.json").write_text(json.dumps({"telemetry": {"note": note}}))
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    assert stopped_line("terminated (SIGTERM)", tmp_path) == (
        f"terminated (SIGTERM): what ran is kept in {tmp_path} (metrics.json); trace.json "
        f"holds no timeline: {note}")
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [{"ph": "X"}]}))
    assert stopped_line("terminated (SIGTERM)", tmp_path) == (
        f"terminated (SIGTERM): what ran is kept in {tmp_path} (metrics.json, trace.json)")
