"""Every hookspec is documented the way it is declared, and the core really calls it.

Like datasette's documentation tests: a hook whose signature or *Called*/*Ranks*/*Thread*
lines in ``docs/hooks.md`` differ from its hookspec, a hook without an example, or a hook no
real run calls, fails CI. "Called" means called by the core in a run these tests make (one
process, a parameter-server cluster, an all-reduce cluster), recorded by
``accelopt.testing.HookRecorder`` on every rank, not merely named in a test file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accelopt import hookspecs
from accelopt.testing import HookRecorder, hook_names, run_workload
from accelopt.testing.hookdocs import (
    FIELDS,
    documented_fields,
    documented_signature,
    fields,
    section,
    signature_line,
)

ROOT = Path(__file__).resolve().parent.parent
HOOKS = hook_names()
DOCS = (ROOT / "docs" / "hooks.md").read_text()


def test_there_are_hooks_for_the_four_hook_points():
    for point in ("accelopt_allocate", "accelopt_select_next", "accelopt_transfer_order",
                  "accelopt_layer_build"):
        assert point in HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_as_declared(hook):
    spec = getattr(hookspecs, hook)
    text = section(DOCS, hook)
    assert text, f"docs/hooks.md has no '### {hook}' section"
    assert documented_signature(text) == signature_line(hook, spec), (
        f"docs/hooks.md: the signature of {hook} differs from its hookspec")
    declared = fields(spec)
    assert set(declared) == set(FIELDS), (
        f"hookspecs.{hook}: its docstring needs the lines {', '.join(f + ':' for f in FIELDS)} "
        f"(has {', '.join(declared) or 'none'})")
    assert documented_fields(text) == declared, (
        f"docs/hooks.md: the Called/Ranks/Thread lines of {hook} differ from its docstring")
    assert "```python" in text and f"def {hook}(" in text, (
        f"docs/hooks.md: the {hook} section needs a python example implementing it")


def test_documented_hooks_exist():
    documented = re.findall(r"^### (accelopt_\w+)", DOCS, flags=re.M)
    assert sorted(documented) == sorted(HOOKS)


@pytest.fixture(scope="module")
def called(tmp_path_factory) -> dict[str, set[str]]:
    """Hook -> the modes in which a real run made the core call it."""
    from accelopt.cli.main import plugin_cli_commands
    from accelopt.plugin import Registry

    out: dict[str, set[str]] = {}
    both_ready = ["workload.jobs.1.arrival_s=0.0"]  # two ready jobs: select_next is asked
    one_job = ["workload.jobs=[{name: m, model: mlp, width: 8, batch_size: 8, iterations: 2}]"]
    runs = {"none": both_ready, "ps": [*both_ready, "cluster.mode=ps"],
            "allreduce": [*one_job, "cluster.mode=allreduce"]}
    for mode, overrides in runs.items():
        recorder = HookRecorder()
        record = run_workload([], overrides, tmp_path=tmp_path_factory.mktemp(mode),
                              recorder=recorder)
        assert all(j.status == "done" for j in record.jobs)
        for name in recorder.names():
            out.setdefault(name, set()).add(mode)
    recorder = HookRecorder()  # a checkpointed run, then resumed: the checkpoint hooks
    first = run_workload([], [*one_job, "run.checkpoint_every=1"], recorder=recorder,
                         tmp_path=tmp_path_factory.mktemp("checkpointed"))
    run_workload([], [f"run.resume={first.info.run_dir}", "run.resume_finished=true"],
                 recorder=recorder, tmp_path=tmp_path_factory.mktemp("resumed"))
    for name in recorder.names():
        out.setdefault(name, set()).add("resume")
    recorder = HookRecorder()
    registry = Registry.discover()
    registry.add(recorder.spec())
    plugin_cli_commands(registry)  # what `accelopt <command>` asks of installed plugins
    for name in recorder.names():
        out.setdefault(name, set()).add("cli")
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_called_by_the_core(hook, called):
    assert hook in called, f"no run of these tests makes the core call {hook}"


@pytest.mark.timeout(240)
def test_the_events_of_one_iteration_fire_in_every_mode(called):
    for hook in ("accelopt_iteration_start", "accelopt_before_optimizer_step",
                 "accelopt_after_step", "accelopt_iteration_end"):
        assert called[hook] >= {"none", "ps", "allreduce"}, (hook, called[hook])
    assert called["accelopt_transfer_done"] >= {"ps", "allreduce"}
