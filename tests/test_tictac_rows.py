"""tictac's rows and ``accelopt tictac order`` say what a run does: the same loss for the
plan, no priority schedule named where none ran, a refused early update said in the row,
and all-reduce mode answered as a run answers it."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
from accelopt_plugins.tictac.plugin import nothing_to_order
from test_tictac_cluster import server_plugin

pytestmark = pytest.mark.timeout(120)

TESTS = str(Path(__file__).parent)


def test_cli_plans_a_model_computing_its_own_loss_as_a_run_does(monkeypatch):
    """A ``loss: model`` job whose traced output has no loss (the GPT-2 of workload=lm):
    the run summed the output, the CLI called the job's loss and failed "does not run on the
    job's inputs to be timed: UserError: loss=model, but the model's output ... has no loss
    tensor". The CLI's planning gets the run's loss (the plan itself is faked: tracing is
    ``test_tictac.py``'s)."""
    import torch
    from accelopt_plugins.tictac import plan as plan_module
    from accelopt_plugins.tictac.cli import make_plan, parse

    monkeypatch.syspath_prepend(TESTS)  # byo_models
    seen = {}

    def planned(model, x, *, loss, **_):
        out = model(x)  # traced without labels: no loss in the output
        assert out.loss is None
        seen["loss"] = loss(out)
        return "plan"

    monkeypatch.setattr(plan_module, "plan_measured", planned)
    config, meta, overrides = parse([
        "workload=single", "workload.jobs=[{name: m, model: 'byo_models:own_loss', dataset: "
        "synthetic_vectors, loss: model, batch_size: 8, iterations: 2}]"])
    assert make_plan(config, meta, overrides) == "plan"
    assert isinstance(seen["loss"], torch.Tensor) and seen["loss"].requires_grad


def _tuned_off(tmp_path, monkeypatch, iterations: int):
    """A server's priority plugin tuning its window (credit -1) whose run ended after
    ``iterations`` iterations, each timed at 12 ms."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="priority",
                                    credit_bytes=-1)
    for i in range(iterations):
        plugin.accelopt_transfer_order(
            transfers=[dataclasses.replace(r, iteration=i) for r in records], destination=1)
        plugin.tuner.record(i, 0.012)
    return plugin


def test_priority_stopped_before_tuning_ran_anything_says_the_default_order_ran(
        tmp_path, monkeypatch):
    """4 iterations of a tuning over 2-13: each ran the default order (off_calls == calls),
    yet the row said "enforced priority", inert 0, and named the predicted 64 KiB schedule
    that never ran."""
    plugin = _tuned_off(tmp_path, monkeypatch, 4)
    assert plugin.calls == plugin.skipped == 4
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "enforced priority" not in row.summary
    assert row.summary.startswith("server rank 0: ran the default order (whole step) "
                                  "throughout, no priority schedule: 4 iteration(s)")
    assert "tuning needs 15 iterations to run its choice" in row.summary
    assert "tuning over iterations 2-13 not finished" in row.summary
    assert row.metrics["inert"] == 1
    assert row.metrics["predicted_schedule"] == "off"
    assert row.metrics["predicted_ms"] == row.metrics["predicted_off_ms"]
    assert "ms (off (default order, whole step)) at link" in row.summary
    assert "credit 65536 B)" not in row.summary


def test_priority_stopped_inside_tuning_names_what_ran_last(tmp_path, monkeypatch):
    """Stopped at iteration 5 (credit 0's block, 4-5): the row names what ran, not the
    grid's last candidate."""
    plugin = _tuned_off(tmp_path, monkeypatch, 6)
    assert plugin.skipped < plugin.calls
    (row,) = plugin.accelopt_report_rows(run=None)
    assert row.summary.startswith("server rank 0: enforced priority")
    assert row.metrics["inert"] == 0
    assert row.metrics["predicted_schedule"] == "credit_0"
    assert "ms (credit 0 B) at link" in row.summary


def test_a_refused_early_update_is_said_in_the_priority_row(tmp_path, monkeypatch):
    """grad_clip: the core refuses the early update (a log line); the row claimed "each
    tensor updated early" with warnings 0."""
    from test_tictac_cluster import make_cfg

    clipped = make_cfg()
    clipped.workload.jobs[0].grad_clip = 1.0
    with monkeypatch.context() as patch, \
            pytest.warns(RuntimeWarning, match=r"early update refused \(grad_clip=1.0 needs"):
        patch.setattr("test_tictac_cluster.make_cfg", lambda *a, **k: clipped)
        plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="priority",
                                        credit_bytes=0)
    plugin.accelopt_transfer_order(transfers=records, destination=1)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "updated early" not in row.summary
    assert ("the early update refused (grad_clip=1.0 needs the norm over every gradient): "
            "the whole optimizer step") in row.summary
    assert row.metrics["warnings"] == 1
    assert "ms (credit 0 B with the early update, which the step refused) at link" in \
        row.summary
    plain, records = server_plugin(tmp_path, monkeypatch, heuristic="priority",
                                   credit_bytes=0)
    assert plain.whole_step == ""


def test_cli_in_allreduce_mode_says_what_a_run_says(capsys):
    """The CLI printed a TAC order and its makespans for a mode in which a run stays out
    ("nothing to order")."""
    from accelopt.cli.main import dispatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dispatch(["tictac", "order", "workload=tiny", "cluster.mode=allreduce",
                         "plugins.tictac.oracle_runs=1"], False) == 0
    out = capsys.readouterr().out
    assert out == f"# tictac: {nothing_to_order('allreduce')}\n"
    assert "nothing to order (cluster.mode=allreduce: all-reduce" in out
    assert "\n  tac:" not in out and "net.1.weight" not in out
