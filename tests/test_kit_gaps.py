"""Gaps a plugin author found in the conformance kit (``accelopt.testing``): state saved that
could never be loaded back, checkpoint answers the kit never asked for, nan/inf metrics
that became null in silence, and a numpy view of a parameter the retention check missed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from clirun import accelopt, the_error_line
from test_testing_kit import Counter  # the kit's minimal correct plugin

from accelopt import (
    PluginSpec,
    ReportRow,
    RunInfo,
    UserError,
    hookimpl,
)
from accelopt.errors import PluginResolutionError
from accelopt.plugin import PluginWarning
from accelopt.testing import (
    check_config,
    check_hookimpls,
    check_no_retained_job_state,
    check_run,
    conformance,
    run_workload,
)

UNPAIRED = ("plugin 'saveonly' implements accelopt_state_save but not accelopt_state_load: "
            "its checkpoints could never be resumed; add accelopt_state_load(self, job, state) "
            "restoring what accelopt_state_save returns (or drop accelopt_state_save)")



class SaveOnly(Counter):
    name = "saveonly"

    @hookimpl
    def accelopt_state_save(self, job: Any) -> dict[str, Any]:
        return {"n": self.n}


class LoadOnly(Counter):
    name = "loadonly"

    @hookimpl
    def accelopt_state_load(self, job: Any, state: dict[str, Any]) -> None:
        self.n = state["n"]


LOADED: list[dict[str, Any]] = []
"""What :class:`Stateful` instances were handed back (the kit's resume builds its own)."""


class Stateful(Counter):
    name = "stateful"

    @hookimpl
    def accelopt_state_save(self, job: Any) -> dict[str, Any]:
        return {"n": self.n}

    @hookimpl
    def accelopt_state_load(self, job: Any, state: dict[str, Any]) -> None:
        LOADED.append(dict(state))
        self.n = state["n"]


class StateList(Stateful):
    name = "statelist"

    @hookimpl
    def accelopt_state_save(self, job: Any) -> Any:
        return [1, 2]


class BadLoad(Stateful):
    name = "badload"

    @hookimpl
    def accelopt_state_load(self, job: Any, state: dict[str, Any]) -> None:
        self.n = state["count"]  # saved as "n": a KeyError at every resume


SAVEONLY = PluginSpec(name="saveonly", factory=SaveOnly, description="saves, never loads")
"""For ``ACCELOPT_PLUGINS=test_kit_gaps:SAVEONLY`` (the command line's test)."""


def spec_of(cls: type, **fields: Any) -> PluginSpec:
    return PluginSpec(**{"name": cls.name, "factory": cls, "description": "counts", **fields})


# --- 1. state_save without state_load ----------------------------------------------------


def test_a_plugin_saving_state_it_cannot_load_is_refused_when_built_and_by_the_kit(
        tmp_path: Path) -> None:
    spec = spec_of(SaveOnly)
    with pytest.raises(PluginResolutionError) as info:
        spec.instantiate()
    assert str(info.value) == UNPAIRED
    for check in (check_config, check_hookimpls):
        with pytest.raises(AssertionError) as failed:
            check(spec)
        assert str(failed.value) == UNPAIRED
    with pytest.raises(AssertionError, match="implements accelopt_state_save but not"):
        conformance(spec, tmp_path)
    spec_of(LoadOnly).instantiate()  # loading without saving is harmless: never given state


def test_the_command_refuses_the_unpaired_plugin_in_one_line(tmp_path: Path) -> None:
    result = accelopt("run", "workload=tiny", "+plugins=[saveonly]", "run.progress=false",
                      "run.checkpoint_every=2", f"hydra.run.dir={tmp_path / 'run'}",
                      cwd=tmp_path, ACCELOPT_PLUGINS="test_kit_gaps:SAVEONLY")
    assert result.returncode == 2, result.stderr
    assert the_error_line(result) == f"error: {UNPAIRED}"
    assert "Traceback" not in result.stderr


def test_the_resume_refusal_tells_an_absent_plugin_from_one_that_cannot_load() -> None:
    """A checkpoint holding a plugin's state: "not active" when the plugin is missing, and
    the hook to add when it is active but has no accelopt_state_load (a plugin built
    through PluginSet.of skips the refusal at instantiate: an older version's checkpoint)."""
    from accelopt.activation import PluginSet
    from accelopt.config import JobConfig
    from accelopt.job import Job, StepEvents

    spec = JobConfig(name="s", model="mlp", width=8, batch_size=8, iterations=3, seed=0)
    saver = SaveOnly()
    host = PluginSet.of([(spec_of(SaveOnly), saver)]).for_job("s")
    job = Job(spec, job_id="s", device=torch.device("cpu"), host=host)
    job.step(StepEvents(job.host))
    state = job.state_dict()
    assert state["plugins"] == {"saveonly": {"n": 1}}

    absent = Job(spec, job_id="s", device=torch.device("cpu"))
    absent.load_state_dict(state)
    with pytest.raises(UserError) as info:
        absent.restore_plugin_states()
    assert str(info.value) == ("job 's': its checkpoint holds the state of plugin 'saveonly', "
                               "which is not active in this run; resume with the run's own "
                               "plugins")
    active = Job(spec, job_id="s", device=torch.device("cpu"),
                 host=PluginSet.of([(spec_of(SaveOnly), SaveOnly())]).for_job("s"))
    active.load_state_dict(state)
    with pytest.raises(UserError) as info:
        active.restore_plugin_states()
    assert str(info.value) == (
        "job 's': its checkpoint holds the state of plugin 'saveonly', which is active but "
        "does not implement accelopt_state_load, so that state cannot be restored; add "
        "accelopt_state_load to the plugin (or resume with the version of it that wrote the "
        "checkpoint)")


# --- 2. the kit checkpoints and resumes a plugin with state ------------------------------


def test_the_kit_checks_state_save_answers(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"plugin 'statelist' answered accelopt_state_save "
                                             r"with list \[1, 2\]"):
        check_run(spec_of(StateList), tmp_path)


def test_the_kit_resumes_from_the_checkpoints_through_state_load(tmp_path: Path) -> None:
    LOADED.clear()
    conformance(spec_of(Stateful), tmp_path)
    # the resume handed each of the two jobs its state back: the count at its end
    assert sorted(s["n"] for s in LOADED) == [6, 10]  # tiny: 6 then 4 more iterations


def test_the_kit_fails_a_state_that_does_not_load_back(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"plugin 'badload': resuming the 'tiny' workload "
                                             r"from its checkpoints failed: .*KeyError"):
        check_run(spec_of(BadLoad), tmp_path)


# --- 3. nan and inf metrics --------------------------------------------------------------


def _nan_rows(name: str) -> type:
    class NanRow(Counter):
        @hookimpl
        def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
            return [ReportRow(plugin=name, summary="measured nothing",
                              metrics={"speedup": float("nan"), "bytes": float("inf"),
                                       "fine": 1.5})]

    NanRow.name = name
    return NanRow


def test_the_kit_fails_a_nan_metric_naming_plugin_and_metric(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"plugin 'nanrow': .* has metric 'speedup' = nan, "
                                             "which JSON cannot hold"), \
            warnings.catch_warnings():  # the run's own warning: its test is the next one
        warnings.simplefilter("ignore", PluginWarning)
        check_run(spec_of(_nan_rows("nanrow")), tmp_path)


def test_a_run_keeps_a_nan_metric_as_null_and_warns_once(tmp_path: Path) -> None:
    import json

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = run_workload([spec_of(_nan_rows("nanwarn"))], tmp_path=tmp_path)
    assert all(job.status == "done" for job in record.jobs)
    said = [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]
    assert said == [
        "plugin 'nanwarn' reported metric 'speedup' as nan, which JSON cannot hold: "
        "metrics.json records it as null; report a finite number, or leave the metric out "
        "when there is none",
        "plugin 'nanwarn' reported metric 'bytes' as inf, which JSON cannot hold: "
        "metrics.json records it as null; report a finite number, or leave the metric out "
        "when there is none"]
    (metrics,) = (tmp_path / "run-0").glob("metrics.json")
    text = metrics.read_text()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text)


# --- 4. a numpy view of a parameter ------------------------------------------------------


def _keeper(view: str) -> type:
    class Keeper(Counter):
        def __init__(self, config: Any = None) -> None:
            super().__init__(config)
            self.k: dict[str, Any] = {}

        @hookimpl
        def accelopt_job_built(self, run: Any, job: Any) -> None:
            array = next(job.model.parameters()).data.numpy()
            self.k[job.job.name] = {"array": array, "slice": array[1:],
                                     "memoryview": memoryview(array),
                                     "copy": array.copy()}[view]

    return Keeper


@pytest.mark.parametrize("view", ["array", "slice", "memoryview"])
def test_a_numpy_view_of_a_parameter_fails_the_retention_check(tmp_path: Path,
                                                               view: str) -> None:
    spec = spec_of(_keeper(view))
    kind = "memoryview" if view == "memoryview" else "ndarray"
    with pytest.raises(AssertionError, match=rf"still holds a {kind} viewing a job's parameter "
                                             r"or buffer .* at Keeper\.k\['tiny-"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


def test_a_copy_of_a_parameter_as_numpy_passes_the_retention_check(tmp_path: Path) -> None:
    spec = spec_of(_keeper("copy"))
    check_no_retained_job_state(spec, check_run(spec, tmp_path))
