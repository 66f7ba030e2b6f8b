"""``accelopt bench``: every run of the plan accounted for, a damaged bench.json refused in
one line, a plugin listed twice refused, and the help naming every option."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from clirun import accelopt_in_process, cli_env, the_error_line
from test_bench import _finished_bench

from accelopt import LayerOffer, PluginSpec, hookimpl
from accelopt.bench.runner import bench_command, collect, parse_args, plugin_sets, run_plan
from accelopt.errors import JobsUnfinished, UserError
from accelopt.plugin import Registry


class RefuseAtBuild:
    """Refuses the run while its jobs are built (as a plugin that finds the job's optimizer
    unsuitable does): the run writes no metrics.json, only its error line in the log."""

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any:
        raise UserError("refuse_build: this job cannot be built (test)")


REFUSE_BUILD = PluginSpec(name="refuse_build", factory=lambda c: RefuseAtBuild(),
                          description="refuses every run while its jobs are built (test)")


def _sweep_of_refused_runs(out: Path) -> list[tuple[int, list[str], bool]]:
    """A finished bench of [] and [a], 1 repeat, whose [a] runs were refused before writing
    a metrics.json: their error is only in sweep.log, as Hydra's sweep writes it."""
    plan = run_plan([[], ["a"]], 1)
    log = []
    for i, (_, plugins, _) in enumerate(plan):
        log.append(f"[2026-01-01 00:00:0{i},000][HYDRA] \t#{i} : +plugins=[{','.join(plugins)}]")
        if plugins:
            log.append(f"error: plugins.a.lr: run {i} refused [plugin 'a', accelopt_layer_build]")
            continue
        (out / "runs" / str(i)).mkdir(parents=True)
        (out / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": {"avg_jct_s": 1.0}, "run": {"plugins": plugins}}))
    log.append("error: 2 of 4 runs of the sweep failed: #1, #3 (#1: plugins.a.lr: refused)")
    (out / "sweep.log").write_text("\n".join(log) + "\n")
    context = {"command": "accelopt bench", "metric": "avg_jct_s", "higher_is_better": False,
               "repeats": 1, "machine": "m", "python": "3", "settings": "s",
               "sweep_s": 1.0, "quality": None}
    (out / "bench.json").write_text(json.dumps(
        {"context": context, "sets": [{"label": "baseline"}],
         "runs": [{"run": i, "repeat": r, "plugins": p, "warmup": w}
                  for i, (r, p, w) in enumerate(plan)]}))
    return plan


def test_runs_that_wrote_no_metrics_are_left_out_with_their_error(tmp_path, capsys):
    """A set whose runs were all refused while the job was built vanished from the report
    in silence (exit 0): only runs with a metrics.json were looked at."""
    plan = _sweep_of_refused_runs(tmp_path)
    results, left_out = collect(tmp_path / "runs", "avg_jct_s", plan)
    assert [r.plugins for r in results] == [()]
    assert left_out == ["[a] repeat 0 (run 3): it failed before writing its metrics.json: "
                        "plugins.a.lr: run 3 refused [plugin 'a', accelopt_layer_build]"]
    # --reanalyze gives the same report (the log accounts for the run: no --force needed)
    assert bench_command(["--reanalyze", "--out", str(tmp_path)]) == JobsUnfinished.exit_code
    assert "(run 3): it failed before writing" in capsys.readouterr().err
    # a run missing with no error of its own in the log is no failure the log accounts for
    (tmp_path / "sweep.log").write_text("")
    _, left_out = collect(tmp_path / "runs", "avg_jct_s", plan)
    assert left_out == [f"[a] repeat 0 (run 3): it wrote no metrics.json (see "
                        f"{tmp_path / 'sweep.log'})"]


@pytest.mark.timeout(120)
def test_a_set_refused_while_its_jobs_are_built_is_named_and_exits_3(tmp_path, capfd,
                                                                     monkeypatch):
    """The end-to-end case: the bench exited 0 with the baseline alone in its report. The
    bench in this process; its sweep, a process of its own, finds the plugin by the
    environment it inherits."""
    monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])  # tests/: this module
    monkeypatch.setenv("ACCELOPT_PLUGINS", "test_bench_fixes:REFUSE_BUILD")
    out = tmp_path / "b"
    result = accelopt_in_process("bench", "--sets", "[],[refuse_build]", "--repeats", "1",
                                 "--no-eval", "--out", str(out), "workload=tiny", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 3, result.stderr
    line = the_error_line(result)
    assert re.fullmatch(r"error: 1 measured run\(s\) left out of the report: \[refuse_build\] "
                        r"repeat 0 \(run 3\): it failed before writing its metrics.json: "
                        r"refuse_build: this job cannot be built \(test\).*", line), line
    saved = json.loads((out / "bench.json").read_text())
    assert [s["label"] for s in saved["sets"]] == ["baseline"]
    assert saved["context"]["left_out"] == [line.split("report: ", 1)[1]]
    assert "**Runs left out of this report**" in (out / "bench.md").read_text()


@pytest.mark.parametrize(("damage", "named"), [
    (lambda b: b["runs"][4].pop("repeat"), "runs[4] has no integer 'repeat' (got None)"),
    (lambda b: b["runs"][0].update(plugins="clip"), "runs[0] has no list of plugin names"),
    (lambda b: b["context"].pop("metric"), "its context has no str 'metric' (got None)"),
    (lambda b: b["context"].update(higher_is_better="no"), "no bool 'higher_is_better'"),
    (lambda b: b.update(context=[]), "it has no 'context' object"),
    (lambda b: b.update(runs=[]), "its 'runs' is not a list of the sweep's runs"),
])
def test_reanalyze_of_a_damaged_bench_json_is_one_line(tmp_path, damage, named):
    """A partial or older bench.json was a KeyError traceback."""
    _finished_bench(tmp_path)
    saved = json.loads((tmp_path / "bench.json").read_text())
    damage(saved)
    (tmp_path / "bench.json").write_text(json.dumps(saved))
    with pytest.raises(UserError) as info:
        bench_command(["--reanalyze", "--out", str(tmp_path)])
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert message.startswith(f"--reanalyze: {tmp_path / 'bench.json'} is not what a bench "
                              "writes: ") and named in message, message


@pytest.mark.parametrize("value", ["NaN", "Infinity", "true"])
def test_a_metric_that_is_no_finite_number_is_left_out(tmp_path, capsys, value):
    """A NaN metric was a measurement: the baseline's median was nan and every gain n/a."""
    _finished_bench(tmp_path)
    path = tmp_path / "runs" / "4" / "metrics.json"  # the baseline, repeat 0
    path.write_text(re.sub(r'"avg_jct_s": [^,]+', f'"avg_jct_s": {value}', path.read_text()))
    assert bench_command(["--reanalyze", "--out", str(tmp_path)]) == JobsUnfinished.exit_code
    assert "[] repeat 0 (run 4): its avg_jct_s is" in capsys.readouterr().err
    saved = json.loads((tmp_path / "bench.json").read_text())
    baseline = {s["label"]: s for s in saved["sets"]}["baseline"]
    assert baseline["n"] == 2 and baseline["median"] == pytest.approx(1.015)


def test_a_plugin_listed_twice_is_refused_as_run_refuses_it():
    """`--plugins noop,noop` dropped the duplicate in silence and started the bench."""
    registry = Registry.discover()
    for plugins in ("noop,noop", "noop, clip,noop"):
        with pytest.raises(UserError, match=r"^plugin 'noop' is selected twice; list it "
                           r"once$") as info:
            plugin_sets(parse_args(["--plugins", plugins]), registry)
        assert info.value.exit_code == 2
    assert plugin_sets(parse_args(["--plugins", "noop"]), registry) == [[], ["noop"]]


def test_the_help_lists_eval_beside_no_eval(capsys):
    """docs/combinations.md uses --eval, which the help hid."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert re.search(r"--eval, --no-eval\s+the quality column, on unless --no-eval",
                     capsys.readouterr().out)
    assert parse_args(["--plugins", "noop"]).eval is True
    assert parse_args(["--plugins", "noop", "--eval"]).eval is True
    assert parse_args(["--plugins", "noop", "--no-eval"]).eval is False
    with pytest.raises(UserError, match="--reanalyze runs nothing: .*; drop --eval"):
        parse_args(["--reanalyze", "--out", "x", "--eval"])


def test_a_sweep_whose_every_run_was_refused_names_each_run(tmp_path):
    """Every run refused while its jobs were built (none wrote a metrics.json): the sweep's
    runs go to the report, which names each with its error (exit 3), rather than the
    sweep's last line alone."""
    from rich.console import Console

    from accelopt.bench.runner import NothingMeasured, _report_runs, _run_sweep

    plan = run_plan([[], ["a"]], 1)
    (tmp_path / "runs").mkdir()
    script = "; ".join(f"print('[HYDRA] \\t#{i} : x'); print('error: run {i} refused')"
                       for i in range(len(plan)))
    command = [sys.executable, "-c", f"{script}; raise SystemExit(2)"]
    assert _run_sweep(command, tmp_path, len(plan), Console(file=io.StringIO())) == 2
    context = {"metric": "duration_s"}
    with pytest.raises(NothingMeasured) as info:
        _report_runs(tmp_path, context, plan, Console(file=io.StringIO()))
    assert info.value.exit_code == 3 and "\n" not in str(info.value)
    assert str(info.value).endswith(
        "measured duration_s: [] repeat 0 (run 2): it failed before writing its metrics.json: "
        "run 2 refused; [a] repeat 0 (run 3): it failed before writing its metrics.json: "
        "run 3 refused")


def test_a_sweep_that_failed_though_every_run_measured_exits_3(tmp_path, monkeypatch, capsys):
    """The sweep's exit code was ignored: a bench whose sweep failed past its last run
    exited 0."""
    from accelopt.bench import runner

    def sweep(command: list[str], out: Path, total: int, *args: Any, **kwargs: Any) -> int:
        for i, (_, plugins, _) in enumerate(run_plan([[], ["noop"]], 1)):
            (out / "runs" / str(i)).mkdir(parents=True)
            (out / "runs" / str(i) / "metrics.json").write_text(json.dumps(
                {"summary": {"duration_s": 1.0}, "run": {"plugins": plugins}}))
        (out / "sweep.log").write_text("error: the sweep's launcher failed after its runs\n")
        return 1

    monkeypatch.setattr(runner, "_run_sweep", sweep)
    out = tmp_path / "b"
    assert bench_command(["--sets", "[],[noop]", "--repeats", "1", "--no-eval", "--out",
                          str(out), "workload=tiny"]) == JobsUnfinished.exit_code
    assert (f"error: the sweep exited 1 though every run of the plan measured duration_s; "
            f"see {out / 'sweep.log'}") in capsys.readouterr().err
    assert json.loads((out / "bench.json").read_text())["sets"]  # the report is written
