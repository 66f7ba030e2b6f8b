"""Defects an outside user found in ``accelopt bench``: a reanalysis of the bench's own
metric kept its name's guessed direction, not the bench's; the report never said which
direction is better ("1 repeats"); the settings line lost bracketed overrides to rich markup;
Ctrl-C reached the sweep as SIGTERM; a stopped bench reported with --reanalyze --force was
called finished; the gain range was unpaired and shown for the baseline against itself.
Each bench directory is built here as a bench leaves it; no sweep runs."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from accelopt.bench import runner
from accelopt.bench.analysis import SetResult, summarize
from accelopt.bench.render import render_markdown, render_png, render_table
from accelopt.bench.runner import (
    _stop,
    _what_out_holds,
    _write_bench_json,
    bench_command,
    collect,
    report,
    run_plan,
)
from accelopt.errors import Terminated
from accelopt.report.console import default_console

VALUES = {(): 2.0, ("noop",): 1.0}


def _bench(out: Path, *, higher: bool, repeats: int = 3, sweep_s: float | None = 1.0,
           measured: int | None = None, settings: str = "s") -> list[tuple[int, list[str], bool]]:
    """A bench of [] and [noop] on avg_jct_s (noop halves it) reported as the bench reports
    it; ``measured``: only the first that many runs of the plan wrote a metrics.json (a
    stopped bench, its plan written and no report)."""
    plan = run_plan([[], ["noop"]], repeats)
    for i, (_, plugins, _) in enumerate(plan[:measured]):
        (out / "runs" / str(i)).mkdir(parents=True)
        (out / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": {"avg_jct_s": VALUES[tuple(plugins)]}, "run": {"plugins": plugins}}))
    context = {"command": "accelopt bench", "metric": "avg_jct_s", "higher_is_better": higher,
               "repeats": repeats, "machine": "m", "python": "3", "settings": settings,
               "sweep_s": sweep_s, "quality": None}
    if measured is not None:
        _write_bench_json(out, context, [], plan)
    else:
        results, _ = collect(out / "runs", "avg_jct_s", plan)
        report(results, context, plan, out, default_console())
    return plan


def _saved(path: Path) -> dict:
    return json.loads(path.read_text())


def test_reanalyzing_the_bench_s_own_metric_keeps_its_direction(tmp_path, capsys):
    """`--reanalyze --metric avg_jct_s` of a bench run with --higher-is-better yes wrote
    bench-avg_jct_s.json with higher_is_better false and the inverted gain, no warning."""
    _bench(tmp_path, higher=True)
    before = _saved(tmp_path / "bench.json")
    assert bench_command(["--reanalyze", "--out", str(tmp_path), "--metric", "avg_jct_s"]) == 0
    assert not (tmp_path / "bench-avg_jct_s.json").exists()
    after = _saved(tmp_path / "bench.json")
    assert after["context"]["higher_is_better"] is True
    assert [s["gain"] for s in after["sets"]] == [s["gain"] for s in before["sets"]] == [1.0, 0.5]
    assert "note:" not in capsys.readouterr().err


def test_a_direction_that_reverses_the_recorded_one_is_said(tmp_path, capsys):
    _bench(tmp_path, higher=True)
    capsys.readouterr()
    assert bench_command(["--reanalyze", "--out", str(tmp_path), "--metric", "avg_jct_s",
                          "--higher-is-better", "no"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: --higher-is-better no ")
    assert "lower is better" in err and "recorded higher is better" in err
    derived = _saved(tmp_path / "bench-avg_jct_s.json")
    assert derived["context"]["higher_is_better"] is False
    assert _saved(tmp_path / "bench.json")["context"]["higher_is_better"] is True
    # the same direction as recorded, given explicitly: no note
    assert bench_command(["--reanalyze", "--out", str(tmp_path), "--higher-is-better",
                          "yes"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_the_help_says_what_auto_does_in_a_reanalysis(capsys):
    with pytest.raises(SystemExit):
        runner.parse_args(["--help"])
    assert "keeps the direction bench.json records" in " ".join(capsys.readouterr().out.split())


def test_the_settings_line_keeps_bracketed_overrides(tmp_path, capsys):
    """`hydra.searchpath=[file:///tmp/x/cfg]` was printed as `hydra.searchpath=`."""
    _bench(tmp_path, higher=False,
           settings="overrides: hydra.searchpath=[file:///tmp/x/cfg] workload=mine")
    out = " ".join(capsys.readouterr().out.split())
    assert "overrides: hydra.searchpath=[file:///tmp/x/cfg] workload=mine" in out


def test_the_table_shows_a_bracketed_metric_name_as_is():
    summary = summarize([SetResult((), (1.0,)), SetResult(("a",), (2.0,))], "m[bold]", False)
    context = {"metric": "m[bold]", "higher_is_better": False, "repeats": 1}
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(render_table(summary, context))
    assert "m[bold] (lower is better)" in console.export_text()


def test_the_report_states_the_direction_and_counts_repeats_right(tmp_path):
    """bench.md never said which direction is better, and said "1 repeats"."""
    summary = summarize([SetResult((), (2.0,), repeats=(0,)),
                         SetResult(("a",), (1.0,), repeats=(0,))], "makespan_s", True)
    context = {"metric": "makespan_s", "higher_is_better": True, "repeats": 1,
               "command": "accelopt bench", "machine": "m", "python": "3", "settings": "s",
               "sweep_s": 1.0}
    markdown = render_markdown(summary, context)
    assert markdown.startswith("# Ablation: makespan_s (higher is better)\n")
    assert "Medians of 1 repeat, sets interleaved" in markdown and "1 repeats" not in markdown
    assert "makespan_s: higher is better" in markdown
    assert "medians of 1 interleaved repeat;" in str(render_table(summary, context).title)
    lower = render_markdown(summary, {**context, "higher_is_better": False, "repeats": 3})
    assert "(lower is better)" in lower  # fewer repeats than planned: "1 repeat (3 planned"
    render_png(summary, context, tmp_path / "bench.png")  # the direction in its labels


CHILD = """
import signal, sys
def said(number, frame):
    print(signal.Signals(number).name, flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, said)
signal.signal(signal.SIGTERM, said)
print("ready", flush=True)
while True:
    signal.pause()
"""


@pytest.mark.parametrize("why, sent", [(KeyboardInterrupt(), "SIGINT"),
                                       (Terminated(), "SIGTERM"),
                                       (ValueError("a refusal"), "SIGTERM")])
def test_ctrl_c_reaches_the_sweep_as_sigint(monkeypatch, why, sent):
    """The bench stopped its sweep with SIGTERM on Ctrl-C: the sweep recorded
    "terminated (SIGTERM)", 143, where the bench said "interrupted", 130."""
    monkeypatch.setattr(runner, "CTRL_C_GRACE_S", 0)  # this child got no Ctrl-C of its own
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        _stop(proc, why)
        assert proc.stdout.read() == f"{sent}\n" and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_sweep_that_ends_on_its_own_ctrl_c_gets_no_second_signal(monkeypatch):
    """A terminal's Ctrl-C reaches the sweep too: it is left to end on it."""
    sent: list[int] = []
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    monkeypatch.setattr(proc, "send_signal", sent.append)
    monkeypatch.setattr(proc, "terminate", lambda: sent.append(signal.SIGTERM))
    monkeypatch.setattr(runner, "CTRL_C_GRACE_S", 60)
    _stop(proc, KeyboardInterrupt())
    assert sent == [] and proc.returncode == 0


@pytest.mark.parametrize("forced", [False, True])
def test_a_stopped_bench_is_not_called_finished(tmp_path, capsys, forced):
    """An interrupted bench reported with --reanalyze --force (as its last line says) was
    "a finished bench ... or --reanalyze to report it again" to the next bench."""
    _bench(tmp_path, higher=False, sweep_s=None, measured=4)  # warm-ups, then repeat 0
    if forced:
        assert bench_command(["--reanalyze", "--force", "--out", str(tmp_path)]) == 0
        assert _saved(tmp_path / "bench.json")["sets"]
    message = _what_out_holds(tmp_path)
    assert "finished bench" not in message and "\n" not in message
    assert "holds a bench that did not finish (2 of its 6 measured runs measured avg_jct_s; " \
        "it was interrupted before its sweep ended" in message
    assert ("its report is from --reanalyze --force" in message) is forced
    assert "give another --out" in message
    assert message.endswith(f"accelopt bench --reanalyze --force --out {tmp_path}")


def test_a_finished_bench_is_still_called_finished(tmp_path):
    _bench(tmp_path, higher=False)
    assert "it holds a finished bench" in _what_out_holds(tmp_path)


def test_the_gain_range_is_paired_and_none_for_the_baseline(tmp_path):
    """The range was the baseline's median over each repeat's value (unpaired: a drift the
    interleaving cancels showed as spread), and the baseline's row a range against itself."""
    base = SetResult((), (1.0, 2.0, 1.0), repeats=(0, 1, 2))
    half = SetResult(("a",), (0.5, 1.0, 0.5), repeats=(0, 1, 2))
    baseline, alone = summarize([base, half], "avg_jct_s", False)
    assert (baseline.gain_low, baseline.gain_high) == (None, None)
    assert (alone.gain_low, alone.gain_high) == (2.0, 2.0)  # 2x in every repeat
    context = {"metric": "avg_jct_s", "higher_is_better": False, "repeats": 3,
               "command": "accelopt bench", "machine": "m", "python": "3", "settings": "s",
               "sweep_s": 1.0}
    markdown = render_markdown([baseline, alone], context)
    assert "| baseline | 1 | 1-2 | 1.000x | – |" in markdown
    assert "| a | 0.5 | 0.5-1 | 2.000x | 2.000-2.000 |" in markdown
    assert "Gain range: min-max over the repeats of the set's gain within each repeat" \
        in markdown
    render_png([baseline, alone], context, tmp_path / "bench.png")
    # without repeat labels: against the baseline's median, as before
    unpaired = summarize([SetResult((), (1.0, 2.0, 1.0)), SetResult(("a",), (0.5, 1.0, 0.5))],
                         "avg_jct_s", False)[1]
    assert (unpaired.gain_low, unpaired.gain_high) == (1.0, 2.0)
