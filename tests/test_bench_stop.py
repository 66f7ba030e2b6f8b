"""A bench stopped midway or still running, as its ``--out`` records it: the runs that can be
reported are those that measured the metric, and a running bench is not called finished.
Each directory is built here as the bench leaves it; no sweep runs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from accelopt.bench import runner
from accelopt.bench.runner import (
    RUNNING,
    _mark_running,
    _say_how_to_report_what_ran,
    _write_bench_json,
    bench_command,
    run_plan,
)
from accelopt.errors import UserError

PLAN = run_plan([[], ["noop"]], 2)  # runs 0-1 warm-up; 2-5 measured: [] [noop] [noop] []
CONTEXT = {"command": "accelopt bench", "metric": "duration_s", "higher_is_better": False,
           "repeats": 2, "machine": "m", "python": "3", "settings": "s", "sweep_s": None,
           "quality": None}
BENCH = ["--plugins", "noop", "--repeats", "2", "workload=tiny", "run.progress=false"]


def _run(out: Path, number: int, summary: dict[str, object]) -> None:
    (out / "runs" / str(number)).mkdir(parents=True)
    (out / "runs" / str(number) / "metrics.json").write_text(json.dumps(
        {"summary": summary, "run": {"plugins": PLAN[number][1]}}))


def _stopped(out: Path, *, measured: tuple[int, ...] = ()) -> None:
    """A bench SIGTERMed in the run after ``measured``: the warm-up runs measured, and the
    run it stopped wrote its metrics.json with the error and the time to it."""
    _write_bench_json(out, CONTEXT, [], PLAN)
    (out / "sweep.log").write_text("")
    for number in (0, 1, *measured):
        _run(out, number, {"duration_s": 1.0, "error": None})
    _run(out, max((1, *measured)) + 1, {"duration_s": 0.4, "error": "terminated (SIGTERM)"})


def test_the_stopped_run_is_not_counted_as_one_to_report(tmp_path, capsys):
    """The killed run was counted ("stopped after 1 of its 4 measured runs; report them
    with ...") and the command given then failed: no run measured duration_s."""
    _stopped(tmp_path)
    _say_how_to_report_what_ran(tmp_path, PLAN, "duration_s")
    assert capsys.readouterr().err == ""
    with pytest.raises(UserError) as info:
        bench_command([*BENCH, "--out", str(tmp_path)])
    message = str(info.value)
    assert "holds a bench that did not finish (0 of its 4 measured runs measured duration_s" \
        in message
    assert "--reanalyze" not in message and "\n" not in message


def test_a_stopped_bench_counts_the_runs_that_measured(tmp_path, capsys):
    _stopped(tmp_path, measured=(2, 3))  # the baseline's and noop's first runs; 4 stopped
    _say_how_to_report_what_ran(tmp_path, PLAN, "duration_s")
    assert capsys.readouterr().err == (
        "the bench stopped after 2 of its 4 measured runs; report them with: accelopt bench "
        f"--reanalyze --force --out {tmp_path}\n")
    with pytest.raises(UserError, match=r"\(2 of its 4 measured runs measured duration_s; "
                       r".*; or report those with --reanalyze --force"):
        bench_command([*BENCH, "--out", str(tmp_path)])
    # the command it gives reports them, naming the stopped run (exit 3)
    assert bench_command(["--reanalyze", "--force", "--out", str(tmp_path)]) == 3
    assert "[noop] repeat 1 (run 4): the run failed: terminated (SIGTERM)" in capsys.readouterr().err


def test_runs_without_the_baseline_are_not_sent_to_reanalyze(tmp_path, capsys):
    """--reanalyze --force reports gains against the baseline: runs without one measured
    cannot be reported."""
    _write_bench_json(tmp_path, CONTEXT, [], PLAN)
    _run(tmp_path, 3, {"duration_s": 1.0})  # [noop] of repeat 0; the baseline's run 2 failed
    _run(tmp_path, 2, {"duration_s": 2.0, "error": "boom"})
    _say_how_to_report_what_ran(tmp_path, PLAN, "duration_s")
    err = capsys.readouterr().err
    assert err.startswith("the bench stopped after 1 of its 4 measured runs, none of them the "
                          "baseline's") and "--reanalyze" not in err
    with pytest.raises(UserError) as info:
        bench_command([*BENCH, "--out", str(tmp_path)])
    assert "(1 of its 4 measured runs" in str(info.value)
    assert "--reanalyze" not in str(info.value)


def _marked(out: Path, pid: int, host: str | None = None) -> None:
    (out / RUNNING).write_text(json.dumps({"pid": pid, "host": host or platform.node()}))


@pytest.mark.parametrize("reporting", [False, True])
def test_an_out_whose_bench_is_still_running_is_said_so(tmp_path, reporting):
    """A running bench's --out was "a finished bench; ... or --reanalyze to report it
    again" (when its report was being written) or "did not finish; ... report those with
    --reanalyze --force": either would be replaced by the bench's own report."""
    _stopped(tmp_path, measured=(2, 3))
    if reporting:  # the report's figures written, its chart not yet
        saved = json.loads((tmp_path / "bench.json").read_text())
        _write_bench_json(tmp_path, saved["context"], [{"label": "baseline"}], PLAN)
    _marked(tmp_path, os.getpid())
    with pytest.raises(UserError) as info:
        bench_command([*BENCH, "--out", str(tmp_path)])
    message = str(info.value)
    assert (f"holds a bench that has not finished: it is still running (process {os.getpid()} "
            f"on {platform.node()})") in message
    assert "give another --out, or wait for it to end" in message
    assert "--reanalyze" not in message and "finished bench" not in message
    with pytest.raises(UserError, match="--reanalyze: the bench in .* has not finished: it is "
                       "still running"):
        bench_command(["--reanalyze", "--force", "--out", str(tmp_path)])
    assert not (tmp_path / "bench.md").exists()


def test_a_bench_on_another_host_may_still_be_running(tmp_path):
    _stopped(tmp_path)
    _marked(tmp_path, 1, host=f"not-{platform.node()}")
    with pytest.raises(UserError, match=r"has not finished: it may still be running \(process "
                       r"1 on not-"):
        bench_command([*BENCH, "--out", str(tmp_path)])


def test_a_killed_bench_is_one_that_did_not_finish(tmp_path):
    """Its marker stays (SIGKILL ran no cleanup), naming a process that is gone."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    _stopped(tmp_path, measured=(2,))
    _marked(tmp_path, int(gone.stdout))
    with pytest.raises(UserError, match=r"holds a bench that did not finish \(1 of its 4 "
                       r"measured runs measured duration_s; .*; or report those with"):
        bench_command([*BENCH, "--out", str(tmp_path)])


def test_the_running_marker_lives_exactly_as_long_as_the_bench(tmp_path, monkeypatch):
    out = tmp_path / "b"
    seen: list[bool] = []

    def stopped(*args: object) -> int:
        seen.append((out / RUNNING).exists())
        with pytest.raises(UserError, match="has not finished: it is still running"):
            _mark_running(out)  # a second bench given the same --out meanwhile
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_bench", stopped)
    with pytest.raises(KeyboardInterrupt):
        bench_command([*BENCH, "--out", str(out)])
    assert seen == [True] and not (out / RUNNING).exists()
