"""A bench's report as its runs measured it: a bench stopped while it writes its report says
how to write it, a mistyped --metric leaves an empty --out empty, --reanalyze files each run
under the set the plan ran there, and a report from fewer repeats than planned says how many
it has. Each bench directory is built here as a bench leaves it; no sweep runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from accelopt.bench import runner
from accelopt.bench.analysis import summarize
from accelopt.bench.render import render_table
from accelopt.bench.runner import (
    RUNNING,
    UnknownMetric,
    _write_bench_json,
    bench_command,
    collect,
    run_plan,
)
from accelopt.errors import Terminated, UserError

BENCH = ["--plugins", "noop", "--repeats", "2", "--metric", "avg_jct_s", "--no-eval",
         "workload=tiny"]
PLAN = run_plan([[], ["noop"]], 2)  # what BENCH plans: runs 0-1 warm-up, 2-5 measured
CONTEXT = {"command": "accelopt bench", "metric": "avg_jct_s", "higher_is_better": False,
           "repeats": 2, "machine": "m", "python": "3", "settings": "s", "sweep_s": None,
           "quality": None}


def _runs(out: Path, plan: list[tuple[int, list[str], bool]], numbers: range | None = None
          ) -> None:
    """runs/<n>/metrics.json of the plan's runs ``numbers`` (all by default), as a run writes
    them: fixed values, [noop] 10% faster than the baseline, drifting by repeat."""
    for i in numbers if numbers is not None else range(len(plan)):
        repeat, plugins, _ = plan[i]
        value = (0.9 if plugins else 1.0) * (1 + 0.01 * repeat)
        (out / "runs" / str(i)).mkdir(parents=True)
        (out / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": {"avg_jct_s": value, "error": None}, "run": {"plugins": plugins}}))


def _no_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sets run as planned, without composing each (seconds; not what is tested)."""
    monkeypatch.setattr(runner, "preflight", lambda sets, *args, **kwargs: sets)


def _bench_dir(out: Path, plan: list[tuple[int, list[str], bool]],
               numbers: range | None = None, **context: Any) -> None:
    """A bench's --out: its plan in bench.json (no figures: stopped, or before its report)
    and the runs ``numbers``."""
    _write_bench_json(out, {**CONTEXT, **context}, [], plan)
    (out / "sweep.log").write_text("")
    _runs(out, plan, numbers)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_a_bench_stopped_while_it_writes_its_report_says_how_to_write_it(
        tmp_path, monkeypatch, capsys, stop):
    """Stopped after its table was printed and bench.json written, before bench.png and
    bench.md: it said only 'interrupted' (exit 130), not where its runs are nor the command
    that reports them."""
    out = tmp_path / "b"

    def sweep(command: list[str], out: Path, *args: Any, **kwargs: Any) -> int:
        _runs(out, PLAN)  # every run measured
        return 0

    def stopped(*args: Any) -> None:
        raise stop

    _no_preflight(monkeypatch)
    monkeypatch.setattr(runner, "_run_sweep", sweep)
    monkeypatch.setattr(runner, "render_png", stopped)
    with pytest.raises(stop):
        bench_command([*BENCH, "--out", str(out)])
    captured = capsys.readouterr()
    assert "medians of 2 interleaved repeats" in captured.out  # the table was printed
    assert json.loads((out / "bench.json").read_text())["sets"]  # and bench.json written
    assert not (out / "bench.md").exists() and not (out / RUNNING).exists()
    assert captured.err == (
        "the bench stopped while it wrote its report, after its sweep (4 of its 4 measured "
        f"runs measured avg_jct_s; they are kept in {out / 'runs'}); report them with: "
        f"accelopt bench --reanalyze --force --out {out}\n")
    monkeypatch.undo()
    assert bench_command(["--reanalyze", "--force", "--out", str(out)]) == 0  # the command
    assert (out / "bench.md").is_file() and (out / "bench.png").is_file()


def _mistyped_sweep(foreign: bool) -> Any:
    """A sweep stopped by a mistyped --metric after the baseline's first run, as
    ``_run_sweep`` stops it: its log and first run written. ``foreign``: a file the bench
    does not write appears in --out meanwhile."""

    def sweep(command: list[str], out: Path, *args: Any, **kwargs: Any) -> int:
        (out / "sweep.log").write_text("[HYDRA] Launching 6 jobs locally\n")
        _runs(out, PLAN, range(1))
        (out / "runs" / "multirun.yaml").write_text("{}\n")
        if foreign:
            (out / "notes.txt").write_text("not the bench's")
        raise UnknownMetric("metric 'avg_jct' is not in the runs' metrics.json summary; did "
                            "you mean 'avg_jct_s'? choose one of: avg_jct_s")

    return sweep


def test_a_mistyped_metric_leaves_an_empty_out_empty(tmp_path, monkeypatch):
    """An --out that existed empty was left holding bench.json, runs/ and sweep.log, so the
    corrected command was refused ("holds a bench that did not finish"); a new --out was
    removed."""
    out = tmp_path / "b"
    out.mkdir()
    _no_preflight(monkeypatch)
    monkeypatch.setattr(runner, "_run_sweep", _mistyped_sweep(foreign=False))
    with pytest.raises(UnknownMetric, match="did you mean 'avg_jct_s'"):
        bench_command([*BENCH, "--out", str(out)])
    assert out.is_dir() and list(out.iterdir()) == []  # the corrected command can use it
    with pytest.raises(UnknownMetric):  # a new --out is removed, as before
        bench_command([*BENCH, "--out", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists()
    # only what the bench wrote is removed
    monkeypatch.setattr(runner, "_run_sweep", _mistyped_sweep(foreign=True))
    with pytest.raises(UnknownMetric):
        bench_command([*BENCH, "--out", str(out)])
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_reanalyze_files_a_run_under_its_planned_set_or_names_it(tmp_path, capsys):
    """A run whose metrics.json lists another set than bench.json planned for it (edited,
    or copied from another run) was counted in the set it lists, in silence: here [noop]
    with 3 runs of 2 repeats, [clip] with 1."""
    plan = run_plan([[], ["clip"], ["noop"]], 2)  # 0-2 warm-up; repeat 0: 3-5, 1: 6-8
    _bench_dir(tmp_path, plan, sweep_s=1.0)
    (clip,) = [i for i, (r, p, w) in enumerate(plan) if p == ["clip"] and r == 1]
    (noop,) = [i for i, (r, p, w) in enumerate(plan) if p == ["noop"] and r == 1]
    copied = tmp_path / "runs" / str(clip) / "metrics.json"
    copied.write_bytes((tmp_path / "runs" / str(noop) / "metrics.json").read_bytes())
    with pytest.raises(UserError) as info:  # refused, as a missing or truncated run is
        bench_command(["--reanalyze", "--out", str(tmp_path)])
    message = str(info.value)
    assert "\n" not in message and "1 measured run(s) of the plan" in message
    assert (f"{copied} (its run.plugins is [noop], not [clip], the set bench.json planned for "
            "this run: edited, or copied from another run) ([clip], repeat 1)") in message
    assert "add --force" in message and not (tmp_path / "bench.md").exists()
    assert bench_command(["--reanalyze", "--force", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert {s["label"]: s["n"] for s in saved["sets"]} == {"baseline": 2, "clip": 1, "noop": 2}
    assert saved["context"]["missing_runs"] == [
        f"{copied} (its run.plugins is [noop], not [clip], the set bench.json planned for "
        "this run: edited, or copied from another run) ([clip], repeat 1)"]
    assert "(run.plugins is" not in capsys.readouterr().err
    # the bench's own report files no run under another set either: one line, exit 2
    with pytest.raises(UserError, match=r"its run.plugins is \[noop\], not \[clip\]"):
        collect(tmp_path / "runs", "avg_jct_s", plan)


def test_a_report_from_fewer_repeats_states_how_many_it_has(tmp_path, capsys):
    """A stopped bench reported with --reanalyze --force said "medians of 2 interleaved
    repeats", "2 repeat(s): too few" and "2 repeats" while every set had n=1."""
    _bench_dir(tmp_path, PLAN, range(4))  # repeat 0 measured, then stopped
    assert bench_command(["--reanalyze", "--force", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert {s["n"] for s in saved["sets"]} == {1} and saved["context"]["repeats"] == 2
    markdown = (tmp_path / "bench.md").read_text()
    assert "1 repeat (2 planned; the runs left out are named), sets interleaved" in markdown
    assert "2 repeats" not in markdown
    results, _ = collect(tmp_path / "runs", "avg_jct_s", PLAN, {4, 5})
    table = render_table(summarize(results, "avg_jct_s", False), saved["context"])
    assert "medians of 1 repeat (2 planned; the runs left out are named);" in str(table.title)
    assert str(table.caption).startswith("1 repeat(s) measured (2 planned): too few for a "
                                         "verdict")
    # sets that measured different numbers of repeats: the range
    for number in (4, 5):  # repeat 1: [noop], then the baseline
        _runs(tmp_path, PLAN, range(number, number + 1))
        results, _ = collect(tmp_path / "runs", "avg_jct_s", PLAN)
        title = str(render_table(summarize(results, "avg_jct_s", False), CONTEXT).title)
        assert ("medians of 1-2 repeats (2 planned; the runs left out are named);" in title
                if number == 4 else "medians of 2 interleaved repeats;" in title)
    # every repeat measured: the plan's count, as before
    capsys.readouterr()
    assert bench_command(["--reanalyze", "--out", str(tmp_path)]) == 0
    assert "2 repeats, sets interleaved" in (tmp_path / "bench.md").read_text()
    assert "medians of 2 interleaved repeats" in capsys.readouterr().out
