"""``run.compare``: a reference run's directory that is not free refuses the run before it
writes anything, so the same command runs once the user's file is moved away; the inert
note is one helper for ``run.compare``, ``accelopt bench`` and the benchmark scripts."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from accelopt.config import register_plugin_configs, register_schema
from accelopt.errors import ConfigError
from accelopt.plugin import Registry
from accelopt.runtime.compare import inert_plugins, is_inert, refuse_taken_references
from accelopt.runtime.run_dir import CLAIM_FILE
from accelopt.types import INERT, ReportRow


def _cfg(overrides: list[str]):
    from accelopt.cli.hydra_run import compose_checked

    registry = Registry.discover()
    register_schema()
    register_plugin_configs([registry.get("noop")])
    return compose_checked(["+plugins=[noop]", "workload=tiny", "run.progress=false",
                            *overrides]), registry


@pytest.mark.timeout(60)
def test_a_taken_reference_directory_refuses_before_the_run_writes_anything(tmp_path):
    """The reference's directory was checked when the reference started, after the run with
    plugins had claimed its directory and written config.yaml there: with the user's file
    moved away, the same command was refused ('already holds config.yaml')."""
    from accelopt.runtime.run import execute

    run_dir = tmp_path / "cx"
    user_file = run_dir / "compare" / "baseline" / "trace.json"
    user_file.parent.mkdir(parents=True)
    user_file.write_text(json.dumps({"keep": 1}))
    cfg, registry = _cfg(["run.compare=baseline"])
    with pytest.raises(ConfigError, match="compare/baseline already holds trace.json") as info:
        execute(cfg, run_dir=run_dir, registry=registry, console=Console(file=io.StringIO()))
    assert "\n" not in str(info.value)
    assert json.loads(user_file.read_text()) == {"keep": 1}  # the user's file is untouched
    # nothing of the refused run: no config, no claim on the directory
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == [
        "compare", "compare/baseline", "compare/baseline/trace.json"]
    assert not (run_dir / CLAIM_FILE).exists()


def test_every_reference_directory_is_checked_before_any_runs(tmp_path):
    """With run.compare=each the second reference's taken directory was found only after
    the first reference had run."""
    taken = tmp_path / "compare" / "noop" / "metrics.json"
    taken.parent.mkdir(parents=True)
    taken.write_text("{}")
    refuse_taken_references(tmp_path, [()])  # the baseline's directory is free
    with pytest.raises(ConfigError, match=r"compare/noop already holds a run \(metrics.json\)"):
        refuse_taken_references(tmp_path, [(), ("noop",), ("clip",)])
    assert not (tmp_path / "compare" / "baseline").exists()


def test_inert_is_every_row_of_the_plugin_saying_so():
    rows = [ReportRow("tictac", "nothing to order", {INERT: 1}),
            ReportRow("salus", "reordered 3 jobs", {}),
            ReportRow("gradcomm", "no gradients to compress", {INERT: 1}),
            ReportRow("gradcomm", "compressed 2 tensors", {})]
    assert inert_plugins(["tictac", "salus", "gradcomm", "noop"], rows) == ["tictac"]
    assert is_inert("tictac", [("tictac", {"inert": 1})])  # metrics.json's rows
    assert not is_inert("noop", [])  # no rows: it said nothing either way


def test_compare_modes_are_unchanged_for_a_free_directory(tmp_path: Path):
    refuse_taken_references(tmp_path / "new", [(), ("noop",)])
    assert not (tmp_path / "new").exists()  # checking writes nothing


@pytest.mark.timeout(120)
def test_a_failing_reference_run_is_named_with_its_directory(tmp_path):
    """A plugin raising in its reference run (run.compare=each) gave the line of a run that
    failed itself ("plugin 'boom' raised ...") with no directory, while the run with the
    selected plugins had not started and the evidence was in compare/boom."""
    from plugins_for_tests import BOOM

    from accelopt.errors import PluginHookError
    from accelopt.runtime.run import execute

    registry = Registry.discover()
    registry.add(BOOM)
    register_schema()
    register_plugin_configs([registry.get("noop"), BOOM])
    from accelopt.cli.hydra_run import compose_checked

    cfg = compose_checked(["+plugins=[noop,boom]", "workload=tiny", "run.progress=false",
                           "run.compare=each"])
    run_dir = tmp_path / "cx"
    with pytest.raises(PluginHookError) as info:
        execute(cfg, run_dir=run_dir, registry=registry, console=Console(file=io.StringIO()))
    where = run_dir / "compare" / "boom"
    assert str(info.value).startswith(
        f"the reference run with boom alone (run.compare) failed, outputs kept in {where}: "
        "plugin 'boom' raised in hook accelopt_iteration_end")
    assert (where / "metrics.json").is_file() and "\n" not in str(info.value)


@pytest.mark.timeout(120)
def test_the_measured_gain_row_carries_its_figures(tmp_path):
    """The measured-gain row's metrics were empty: a script comparing runs had to parse
    its sentence for the baseline's and the set's figures."""
    from accelopt.runtime.run import execute

    cfg, registry = _cfg(["run.compare=baseline"])
    record = execute(cfg, run_dir=tmp_path / "g", registry=registry,
                     console=Console(file=io.StringIO()))
    (row,) = [r for r in record.plugin_rows if r.summary.startswith("measured gain")]
    base, mine = row.metrics["baseline.avg_jct_s"], row.metrics["together.avg_jct_s"]
    assert base == record.metrics["compare.baseline.avg_jct_s"]
    assert row.metrics["together.avg_jct_s.gain"] == pytest.approx(base / mine)
    assert f"{base:.3f} -> {mine:.3f}" in row.summary


def test_a_measured_gain_row_leaves_a_plugins_inert_rows_inert():
    """The measured-gain row run.compare adds after a plugin's rows carries no ``inert``:
    counted as the plugin's own, a plugin that changed nothing read as active in every
    compared run (the sweep's closing note never named it)."""
    from accelopt.runtime.compare import COMPARED

    rows = [ReportRow("tictac", "nothing to order", {INERT: 1}),
            ReportRow("tictac", "measured gain vs the same run without plugins: ...",
                      {COMPARED: 1, "together.avg_jct_s": 1.0})]
    assert inert_plugins(["tictac"], rows) == ["tictac"]
    assert not is_inert("tictac", [("tictac", {COMPARED: 1})])  # no row of its own
