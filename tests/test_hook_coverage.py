"""Every hook point is really reached on a real run (the noop plugin counts its calls)."""

from __future__ import annotations

from accelopt.plugin import Registry

SINGLE_PROCESS_HOOKS = {
    "accelopt_configure": 1,
    "accelopt_job_built": 2,
    "accelopt_optimizer_build": 2,
    "accelopt_run_start": 1,
    "accelopt_allocate": 2 + 10,  # two admissions + one request per iteration
    "accelopt_release": 2,
    "accelopt_select_next": 6,  # only where there is a choice: while both jobs are ready
    "accelopt_iteration_start": 10,
    "accelopt_after_forward": 10,
    "accelopt_before_optimizer_step": 10,
    "accelopt_after_step": 10,
    "accelopt_iteration_end": 10,
}
"""Calls counted before ``accelopt_report_rows`` (``accelopt_run_end`` comes after it)."""


def test_noop_plugin_sees_every_single_process_hook(run_tiny):
    spec = Registry.discover().get("noop")
    both_at_zero = ["workload.jobs.1.arrival_s=0.0"]
    record = run_tiny(spec, overrides=both_at_zero)
    (row,) = [r for r in record.plugin_rows if r.plugin == "noop"]
    for hook, count in SINGLE_PROCESS_HOOKS.items():
        assert row.metrics.get(hook) == count, (hook, row.metrics)
    # layer_build: every submodule of both models plus each model itself
    assert row.metrics["accelopt_layer_build"] > 2
    # nothing changed: same results as without the plugin
    baseline = run_tiny(overrides=both_at_zero)
    assert [j.final_loss for j in baseline.jobs] == [j.final_loss for j in record.jobs]
    assert [j.status for j in record.jobs] == ["done", "done"]


def test_report_rows_hook_reaches_the_summary(run_tiny):
    from plugins_for_tests import LIFO

    record = run_tiny(LIFO, overrides=["workload.jobs.1.arrival_s=0.0"])
    # accelopt_report_rows: the plugin's own line, with what it did (tiny-cnn's 4 iterations
    # ran while both jobs were ready; tiny-mlp then ran alone, with no choice to make)
    assert [r.summary for r in record.plugin_rows if r.plugin == "lifo"] == ["made 4 choices"]


def test_cli_commands_hook_adds_a_subcommand(tmp_path):
    from clirun import accelopt

    env = {"ACCELOPT_PLUGINS": "plugins_for_tests:GREETER"}
    result = accelopt("greet", "world", cwd=tmp_path, **env)  # via accelopt_cli_commands
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello world"
