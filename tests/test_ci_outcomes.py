"""What a CI step reads from a run: its outputs after a stop, its exit code, its per-job
records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelopt.testing import run_workload

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("where", ["drawing_process", "score_result", "end"])
def test_a_stop_after_every_job_ended_still_writes_their_results(tmp_path: Path, monkeypatch,
                                                                 where):
    """SIGTERM (or Ctrl-C) once every job had ended, while they were scored: the run left
    only config.yaml, its log and the weights, and its last line was a bare "terminated"."""
    import accelopt.runtime.run as run
    from accelopt.cli.hydra_run import stopped_line
    from accelopt.errors import Terminated
    from accelopt.runtime.run import Lifecycle

    def stop(*_args, **_kwargs):
        raise Terminated()

    if where in ("drawing_process", "score_result"):  # its start; the jobs' scoring
        monkeypatch.setattr(run, where, stop)
    else:
        monkeypatch.setattr(Lifecycle, "end", stop)  # the plugins' run end
    with pytest.raises(Terminated):
        run_workload([], ["run.compare=none"], tmp_path=tmp_path)
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "metrics.json").is_file()]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [j["status"] for j in metrics["jobs"]] == ["done", "done"]
    assert all(j["iterations"] > 0 and j["losses"] for j in metrics["jobs"])
    assert metrics["summary"]["error"] == "terminated (SIGTERM)"
    assert (run_dir / "metrics.csv").is_file() and (run_dir / "trace.json").is_file()
    if where != "end":
        assert all("not scored: terminated (SIGTERM)" in j["quality_note"]
                   for j in metrics["jobs"])
    line = stopped_line("terminated (SIGTERM)", run_dir)
    assert line.startswith("terminated (SIGTERM) after its jobs ended (all 2 job(s) done)")
    assert str(run_dir) in line


@pytest.mark.parametrize("order", [(1, 3), (3, 1)])
def test_a_sweeps_exit_code_is_its_most_severe_runs_whatever_their_order(
        tmp_path: Path, monkeypatch, capsys, order):
    """A point whose plugin crashed (exit 1) and one whose job diverged (exit 3): the sweep
    exited with the last failing point's code (3 or 1 by their order) and its closing line
    named only the first point's reason."""
    import accelopt.runtime.run as run
    from accelopt.cli.main import dispatch
    from accelopt.errors import AccelOptError, JobsUnfinished

    errors = {1: AccelOptError("plugin 'boom' raised in hook accelopt_run_start: ValueError"),
              3: JobsUnfinished("1 of 2 jobs diverged")}

    def execute(cfg, **_kwargs):
        raise errors[order[int(cfg.run.seed) - 1]]

    monkeypatch.setattr(run, "execute", execute)
    monkeypatch.chdir(tmp_path)
    code = dispatch(["run", "-m", "workload=tiny", "run.progress=false", "run.seed=1,2",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}"], False)
    assert code == 1  # a crash outranks jobs that did not complete, in either order
    closing = capsys.readouterr().err.strip().splitlines()[-1]
    assert closing == (
        f"error: 2 of 2 runs of the sweep failed: #0, #1 (#{order.index(1)}: {errors[1]}; "
        f"#{order.index(3)}: {errors[3]}); 1 exit 1 (a plugin raised, an output could not be "
        "written, or an internal error), 1 exit 3 (jobs failed, were rejected or diverged); the sweep exits 1, the most severe")


def test_the_sweeps_exit_code_ranks_a_crash_over_a_mistake_over_unfinished_jobs():
    from accelopt.cli.hydra_run import most_severe, sweep_failures

    assert most_severe([0, 3, 2, 0]) == 2 and most_severe([3, 1, 2]) == 1
    assert most_severe([0, 0]) == 0 and most_severe([3, 3]) == 3
    # one reason: the line as it always was
    assert sweep_failures(["", "x", "y"], [0, 3, 3]) == (
        "2 of 3 runs of the sweep failed: #1, #2 (#1: x)")


def test_a_sweep_stopped_midway_says_which_points_ended_and_which_never_ran(
        tmp_path: Path, monkeypatch, capsys):
    """Ctrl-C in a sweep's second point: the line spoke of that point only ("run it again for
    the rest"), not of the points before it (kept) or after it (never run), and a rerun into
    the same sweep directory is refused as taken."""
    import accelopt.runtime.run as run
    from accelopt.cli.main import dispatch
    from accelopt.errors import JobsUnfinished

    def execute(cfg, **_kwargs):
        if int(cfg.run.seed) == 1:
            raise JobsUnfinished("1 of 2 jobs diverged")  # it ended (its outputs kept)
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "execute", execute)
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    try:
        code = dispatch(["run", "-m", "workload=tiny", "run.progress=false", "run.seed=1,2,3",
                         f"hydra.sweep.dir={sweep}"], False)
    except SystemExit as stop:
        code = stop.code
    assert code == 130
    said = capsys.readouterr()
    assert said.out.strip().splitlines()[-1] == f"sweep summary: {sweep / 'sweep.json'}"
    last = said.err.strip().splitlines()[-1]
    assert last.endswith(
        f"interrupted (Ctrl-C); the sweep stopped at point #1: point #0 ended before it (kept "
        f"in {sweep}), and the points after it did not run: run them with a new "
        "hydra.sweep.dir (a directory holding a sweep's runs is not written into again)"), last
    summary = json.loads((sweep / "sweep.json").read_text())  # the points that ran, said so
    assert (summary["complete"], summary["exit_code"], summary["points_run"]) == (False, 130, 2)
    assert [(p["point"], p["status"], p["exit_code"]) for p in summary["points"]] == [
        (0, "failed", 3), (1, "interrupted", 130)]
    assert summary["points"][0]["error"] == "1 of 2 jobs diverged"


def test_a_sweep_names_the_runs_whose_plugins_changed_nothing(tmp_path: Path, monkeypatch,
                                                               capsys):
    """A CI smoke sweep over plugin sets: a run whose plugin's rows all say inert passed as
    that plugin passing, though it exercised nothing of it, and nothing after the tables said
    so."""
    from types import SimpleNamespace

    import accelopt.runtime.run as run
    from accelopt.cli.main import dispatch
    from accelopt.types import INERT, ReportRow

    rows = {1: [], 2: [ReportRow("idle", "nothing to do", {INERT: 1})],
            3: [ReportRow("busy", "did it", {}), ReportRow("idle", "nothing", {INERT: 1})]}
    plugins = {1: (), 2: ("idle",), 3: ("busy", "idle")}

    def execute(cfg, **_kwargs):
        seed = int(cfg.run.seed)
        return SimpleNamespace(info=SimpleNamespace(plugins=plugins[seed]), plugin_rows=rows[seed],
                               jobs=[])

    monkeypatch.setattr(run, "execute", execute)
    monkeypatch.chdir(tmp_path)
    code = dispatch(["run", "-m", "workload=tiny", "run.progress=false", "run.seed=1,2,3",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}"], False)
    assert code == 0  # a note, not a failure: the runs did what they were asked
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("note: 2 of 3 runs of the sweep had plugins that changed nothing in them "
                    "(their report rows say inert): #1 [idle], #2 [idle]; those runs test "
                    "nothing of those plugins on this workload")


def test_one_stop_signalled_twice_at_once_is_one_stop(monkeypatch):
    """``timeout`` (and a CI runner's time limit) sends SIGTERM to the command and then to its
    process group: the second, raised inside the first one's clean-up, left metrics.json and
    metrics.csv disagreeing about a job, or the trace unwritten. A SIGTERM that soon after is
    the same stop; a later one stops the clean-up."""
    import time

    import accelopt.errors as errors
    from accelopt.errors import Terminated, raise_terminated

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(errors, "_last_sigterm", [])
    with pytest.raises(Terminated):
        raise_terminated(15, None)
    clock[0] += 0.01
    raise_terminated(15, None)  # the process group's copy of the same stop: nothing raised
    clock[0] += errors.REPEATED_SIGTERM_S
    with pytest.raises(Terminated):  # a second stop, asked for later: it stops the clean-up
        raise_terminated(15, None)
