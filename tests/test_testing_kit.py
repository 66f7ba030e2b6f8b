"""accelopt.testing: the recorder, run_workload and the conformance suite, on real runs of
the ``tiny`` workload (no mocks of the runtime)."""

from __future__ import annotations

import collections
import functools
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from accelopt import (
    IterationContext,
    IterationResult,
    LayerOffer,
    PluginSpec,
    Registry,
    ReportRow,
    RunInfo,
    hookimpl,
)
from accelopt.testing import (
    LAUNCHER,
    RECORDER_NAME,
    HookRecorder,
    PluginConformance,
    check_config,
    check_declarations,
    check_hookimpls,
    check_no_retained_job_state,
    check_run,
    check_spec,
    conformance,
    hook_names,
    run_workload,
)
from accelopt.testing.recorder import RecorderPlugin

TINY_ITERATIONS = 6 + 4  # configs/workload/tiny.yaml


# --- the recorder ------------------------------------------------------------------------


def test_recorder_sees_the_noop_lifecycle_in_order(tmp_path: Path) -> None:
    recorder = HookRecorder()
    record = run_workload(["noop"], tmp_path=tmp_path, recorder=recorder)
    recorder.assert_order(
        ["configure", "layer_build", "optimizer_build", "job_built", "run_start", "allocate",
         "iteration_start", "after_forward", "before_optimizer_step", "after_step",
         "iteration_end", "release", "report_rows", "run_end"]
    )
    assert recorder.count("iteration_end") == TINY_ITERATIONS
    assert recorder.count("accelopt_run_start") == 1
    assert recorder.count("release") == len(record.jobs) == 2
    ends = recorder.calls("iteration_end")
    assert [c["result"].iteration for c in ends if c["context"].job.name == "tiny-mlp"] == list(
        range(6)
    )
    assert record.info.plugins == ("noop", RECORDER_NAME)


def test_a_dropped_recorder_frees_what_it_recorded() -> None:
    # the process-wide registry held every recorder, and through its calls every model and
    # tensor of every run a test suite recorded
    import gc
    import weakref

    from accelopt.testing import recorder as recorder_module

    recorder = HookRecorder()
    payload = torch.zeros(4)
    recorder.record("accelopt_iteration_end", tensor=payload)
    token, watched = recorder.token, weakref.ref(payload)
    assert recorder_module.RecorderFactory(token)(None).recorder is recorder
    del recorder, payload
    gc.collect()
    assert token not in recorder_module._RECORDERS and watched() is None


def test_recorder_implements_every_hook() -> None:
    implemented = {name for name in dir(RecorderPlugin) if name.startswith("accelopt_")}
    assert implemented == set(hook_names()), "add the new hook to accelopt/testing/recorder.py"


def test_assert_order_message_shows_the_actual_sequence() -> None:
    recorder = HookRecorder()
    for hook in ("accelopt_run_start", "accelopt_iteration_end", "accelopt_iteration_end"):
        recorder.record(hook)
    recorder.assert_order(["run_start", "iteration_end"])
    with pytest.raises(AssertionError) as info:
        recorder.assert_order(["iteration_end", "run_start"])
    message = str(info.value)
    assert "run_start was not called after iteration_end" in message
    assert "actual sequence: run_start, iteration_end x2" in message
    with pytest.raises(AssertionError, match="run_end was never called"):
        recorder.assert_order(["run_end"])


def test_a_misspelled_hook_name_is_refused_not_counted_as_zero() -> None:
    with pytest.raises(ValueError, match="'iteraton_end' is not an accelopt hook"):
        HookRecorder().count("iteraton_end")


# --- run_workload ------------------------------------------------------------------------


def test_run_workload_applies_plugin_overrides_and_keeps_runs_apart(tmp_path: Path) -> None:
    first = run_workload(["noop"], ["plugins.noop.record=false"], tmp_path=tmp_path)
    second = run_workload(["noop"], tmp_path=tmp_path)
    assert first.info.run_dir != second.info.run_dir
    assert (Path(first.info.run_dir) / "config.yaml").is_file()
    (noop_off,) = [r for r in first.plugin_rows if r.plugin == "noop"]
    (noop_on,) = [r for r in second.plugin_rows if r.plugin == "noop"]
    assert noop_off.metrics == {"inert": 1}  # record=false: no counts, only the inert mark
    assert noop_on.metrics["accelopt_iteration_end"] == TINY_ITERATIONS


def test_run_workload_refuses_a_plugin_selection_in_overrides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plugins argument"):
        run_workload(overrides=["+plugins=[noop]"], tmp_path=tmp_path)


# --- conformance: every installed plugin passes ------------------------------------------


@pytest.mark.parametrize("spec", Registry.discover().all(), ids=lambda s: s.name)
def test_conformance_passes_for_installed_plugin(spec: PluginSpec, tmp_path: Path) -> None:
    conformance(spec, tmp_path)


def test_the_retention_check_skips_when_modes_leave_out_the_one_process_mode(tmp_path):
    """It can only look at plugin objects in this process (cluster.mode=none); it used to run
    that mode whatever ``modes`` said, failing a plugin that refuses it."""
    from plugins_for_tests import NEEDS_CLUSTER

    class ClusterOnly(PluginConformance):
        spec = NEEDS_CLUSTER
        modes = ("ps",)

    with pytest.raises(pytest.skip.Exception, match="needs cluster.mode=none"):
        ClusterOnly().test_does_not_retain_job_state(tmp_path)


def test_the_kit_says_a_transfer_plugin_checked_in_one_process_is_not_checked(tmp_path):
    """A plugin whose hooks are all transfer hooks passed every check with the default
    modes (one process), where no transfer hook is called: the kit says so."""
    import dataclasses

    from cluster_plugins import HALF

    class OneProcess(PluginConformance):
        spec = dataclasses.replace(HALF, description="float16 on the wire")

    class InACluster(OneProcess):
        modes = ("none", "ps")

    with pytest.raises(pytest.skip.Exception, match=r"plugin 'half_codec': "
                       r"accelopt_transfer_decode, accelopt_transfer_encode run only in a "
                       r"cluster, and modes has no cluster mode"):
        OneProcess().test_transfer_hooks_run_in_a_cluster_mode()
    InACluster().test_transfer_hooks_run_in_a_cluster_mode()


class TestNoopConformance(PluginConformance):
    """The base class as a third-party test module uses it (here by installed name)."""

    spec = "noop"
    modes = ("none", "ps")  # its transfer hooks too


# --- conformance: broken plugins fail with a message that says what to fix ---------------


class Counter:
    """A correct minimal plugin the broken variants below (and ``test_kit_gaps``'s) start
    from; ``name`` is the plugin its rows are of."""

    name = "counter"

    def __init__(self, config: Any = None) -> None:
        self.n = 0

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        self.n += 1

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow(plugin=self.name, summary=f"counted {self.n} iterations")]


def make_spec(factory: Any, **fields: Any) -> PluginSpec:
    return PluginSpec(**{"name": "counter", "factory": factory, "description": "counts", **fields})


def test_the_correct_minimal_plugin_passes(tmp_path: Path) -> None:
    conformance(make_spec(Counter), tmp_path)


def test_a_plugin_that_reports_nothing_fails(tmp_path: Path) -> None:
    class Silent(Counter):
        @hookimpl
        def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
            return []

    with pytest.raises(AssertionError, match=r"accelopt_report_rows gave no ReportRow\(plugin='counter'"
                       ) as info:
        check_run(make_spec(Silent), tmp_path)
    # it names the mode, and does not ask to implement a hook that is implemented
    assert "in cluster.mode=none" in str(info.value)
    assert "implement it" not in str(info.value)


def test_a_plugin_without_report_rows_is_told_to_implement_it(tmp_path: Path) -> None:
    class NoRows:
        def __init__(self, config: Any) -> None:
            self.n = 0

        @hookimpl
        def accelopt_iteration_end(self, context: IterationContext,
                                   result: IterationResult) -> None:
            self.n += 1

    with pytest.raises(AssertionError, match=r"plugin 'counter': in cluster.mode=none it "
                       r"reported nothing, as it implements no accelopt_report_rows; "
                       r"implement it"):
        check_run(make_spec(NoRows), tmp_path)


def test_a_misspelled_argument_fails_and_names_the_right_one() -> None:
    class Misspelled(Counter):
        @hookimpl
        def accelopt_iteration_end(self, context: IterationContext, reslt: Any) -> None:
            pass

    with pytest.raises(AssertionError, match=r"argument 'reslt' is not passed by accelopt_iteration_end "
                       r"\(did you mean 'result'\?\)"):
        check_hookimpls(make_spec(Misspelled))


def test_a_misspelled_hook_fails_with_a_suggestion() -> None:
    class WrongHook(Counter):
        @hookimpl
        def accelopt_iteration_ends(self, context: Any) -> None:
            pass

    with pytest.raises(AssertionError, match="did you mean accelopt_iteration_end"):
        check_hookimpls(make_spec(WrongHook))


def test_an_undecorated_hook_method_fails() -> None:
    class Undecorated(Counter):
        def accelopt_run_start(self, run: RunInfo) -> None:
            pass

    with pytest.raises(AssertionError, match="accelopt_run_start looks like a hook but is not decorated"):
        check_hookimpls(make_spec(Undecorated))


def test_a_hook_set_on_the_instance_fails() -> None:
    class OnTheInstance(Counter):
        def __init__(self, config: Any) -> None:
            super().__init__(config)

            @hookimpl
            def accelopt_run_start(run: RunInfo) -> None:
                pass

            self.accelopt_run_start = accelopt_run_start

    with pytest.raises(AssertionError, match="accelopt_run_start is set on the instance, not "
                       "defined on its class"):
        check_hookimpls(make_spec(OnTheInstance))


def test_an_argument_with_a_default_fails() -> None:
    class Defaulted(Counter):
        @hookimpl
        def accelopt_run_end(self, run: RunInfo, metrics: Any = None) -> None:
            pass

    with pytest.raises(AssertionError, match="'metrics' has a default, so pluggy never passes it"):
        check_hookimpls(make_spec(Defaulted))


def test_a_keyword_only_argument_fails() -> None:
    class KeywordOnly(Counter):
        @hookimpl
        def accelopt_run_start(self, *, run: RunInfo) -> None:
            pass

    with pytest.raises(AssertionError, match="'run' is keyword-only"):
        check_hookimpls(make_spec(KeywordOnly))


def test_spec_without_description_or_with_bad_declarations_fails() -> None:
    with pytest.raises(AssertionError, match="description is empty"):
        check_spec(make_spec(Counter, description=""))
    with pytest.raises(AssertionError, match="after contains 'not-a-name'"):
        check_declarations(make_spec(Counter, after=("not-a-name",)))
    with pytest.raises(AssertionError, match="names itself in requires"):
        check_declarations(make_spec(Counter, requires=("counter",)))


def test_config_without_defaults_or_with_unsupported_types_fails() -> None:
    @dataclass
    class NoDefault:
        threshold: float

    @dataclass
    class BadType:
        layers: object = None

    with pytest.raises(AssertionError, match="give every field a default"):
        check_config(make_spec(Counter, config=NoDefault))
    with pytest.raises(AssertionError, match="not a valid OmegaConf schema"):
        check_config(make_spec(Counter, config=BadType))


def test_a_plugin_that_raises_fails_naming_plugin_and_hook(tmp_path: Path) -> None:
    class Raising(Counter):
        @hookimpl
        def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
            raise RuntimeError("boom")

    with pytest.raises(AssertionError, match="plugin 'counter' raised in hook accelopt_iteration_end"):
        check_run(make_spec(Raising), tmp_path)


def test_a_plugin_that_makes_the_loss_diverge_fails_the_run_check(tmp_path: Path) -> None:
    """Jobs ran to "done" with a loss of nan under it, and the run check passed."""
    class Poisons(Counter):
        @hookimpl
        def accelopt_after_forward(self, context: IterationContext, loss: Any) -> Any:
            return loss * float("nan")

    with pytest.raises(AssertionError, match=r"plugin 'counter': under it tiny-mlp, tiny-cnn "
                       r"\(the 'tiny' workload\) diverged: its loss is not finite from loss 2 of "):
        check_run(make_spec(Poisons), tmp_path)


def test_a_plugin_that_keeps_the_jobs_layers_fails_the_retention_check(tmp_path: Path) -> None:
    class Hoarder(Counter):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.layers: list[Any] = []

        @hookimpl
        def accelopt_layer_build(self, layer: LayerOffer) -> None:
            self.layers.append(layer.module)

    spec = make_spec(Hoarder)
    with pytest.raises(AssertionError, match=r"still holds a model/layer \(\w+\) at Hoarder.layers\[0\]"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


class _Slotted:
    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: Any = None


class _Box:
    def __init__(self, inner: Any) -> None:
        self.inner = inner


@pytest.mark.parametrize("keep, where", [
    (lambda m: collections.deque([m]), r"\.kept\[0\]"),
    (lambda m: setattr(slotted := _Slotted(), "held", m) or slotted, r"\.kept\.held"),
    (lambda m: (lambda: m), r"\.kept<closure m>"),
    (lambda m: _Box(_Box(_Box(_Box([m])))), r"\.kept\.inner\.inner\.inner\.inner\[0\]"),
    # a dict keyed by the model, a partial over it, a table keyed by its parameters (as
    # an optimizer's state is): the keys and a partial's arguments were not walked
    (lambda m: {m: 1}, r"\.kept<key <\w+>>"),
    (lambda m: functools.partial(print, m), r"\.kept\.args\[0\]"),
    (lambda m: collections.defaultdict(dict, {p: 0 for p in m.parameters()}),
     r"\.kept<key <Parameter>>"),
])
def test_the_retention_check_sees_a_model_kept_in_any_container(tmp_path: Path, keep: Any,
                                                                 where: str) -> None:
    """A model kept in a deque, a __slots__ object, a closure or five levels deep passed
    the check (only dicts, lists, dataclasses and attributes four deep were walked)."""
    class Keeper(Counter):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.kept: Any = None

        @hookimpl
        def accelopt_job_built(self, run: Any, job: Any) -> None:
            self.kept = keep(job.model)

    spec = make_spec(Keeper)
    kept = r"(a model/layer \(\w+\)|a job's parameter or autograd tensor)"
    with pytest.raises(AssertionError, match=rf"still holds {kept} at Keeper{where}"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


def test_the_retention_check_walks_a_module_plugin(tmp_path: Path) -> None:
    """A plugin that is a module of hooks (the guide allows one) passed the check whatever
    its globals held: a module was never walked."""
    module = types.ModuleType("hoarding_hooks")

    def accelopt_job_built(run: Any, job: Any) -> None:
        module.kept = job.model

    module.accelopt_job_built = hookimpl(accelopt_job_built)
    module.accelopt_report_rows = hookimpl(
        lambda: [ReportRow(plugin="hoarding_hooks", summary="kept a model")])
    spec = PluginSpec(name="hoarding_hooks", factory=lambda config: module,
                      description="a module of hooks")
    with pytest.raises(AssertionError, match=r"still holds a model/layer \(\w+\) at "
                                             r"hoarding_hooks\.kept"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


class _ClassCache(Counter):
    """Keeps the jobs' models on a mutable class attribute: the instance's own attributes
    show nothing, the class's dict holds them."""

    models: ClassVar[dict[str, Any]] = {}

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> None:
        if layer.path == "":
            self.models[layer.job.job_id] = layer.module


_HOARD: dict[str, Any] = {}
"""A module-level cache of the jobs' models (cleared by its test)."""


class _GlobalCache(Counter):
    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> None:
        if layer.path == "":
            _HOARD[layer.job.job_id] = layer.module


@pytest.mark.parametrize("plugin, where", [
    (_ClassCache, r"_ClassCache\.models\['00-tiny-mlp'\]"),
    (_GlobalCache, r"test_testing_kit\._HOARD\['00-tiny-mlp'\]"),
])
def test_the_retention_check_sees_a_model_kept_on_the_class_or_in_a_global(
        tmp_path: Path, plugin: type, where: str) -> None:
    """A model kept on a mutable class attribute or in a global of the plugin's module
    passed: only the instance's own attributes were walked."""
    spec = make_spec(plugin)
    try:
        with pytest.raises(AssertionError, match=rf"still holds a model/layer \(\w+\) at "
                                                 rf"{where}"):
            check_no_retained_job_state(spec, check_run(spec, tmp_path))
    finally:
        _ClassCache.models.clear()
        _HOARD.clear()


def test_a_plugin_taking_a_subset_of_arguments_passes(tmp_path: Path) -> None:
    class Subset(Counter):
        @hookimpl
        def accelopt_configure(self, config: Any) -> None:
            self.config = config

        @hookimpl
        def accelopt_layer_build(self, layer: LayerOffer) -> None:
            return None

    conformance(make_spec(Subset), tmp_path)


# --- the kit in cluster runs ----------------------------------------------------------------


class AnswersAnEvent(Counter):
    """Answers ``accelopt_iteration_end`` (declared ``-> None``); module level, so that a
    cluster run's ranks can build it."""

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> Any:
        self.n += 1
        return self.n


@pytest.mark.timeout(180)
def test_an_answer_to_an_event_fails_the_run_check_in_a_cluster_mode(tmp_path: Path) -> None:
    """The answer watcher ran in mode none only: a kit with ``modes = ("ps",)`` passed a
    plugin answering an event, though the guide says the run check catches it."""
    with pytest.raises(AssertionError, match=r"plugin 'counter': in the 'tiny' workload in "
                       r"cluster.mode=ps, accelopt_iteration_end returned int 1, but "
                       r"accelopt_iteration_end is declared to return None"):
        check_run(make_spec(AnswersAnEvent), tmp_path, overrides=ONE_JOB, mode="ps")

ONE_JOB = ["workload.jobs=[{name: m, model: mlp, width: 8, batch_size: 8, iterations: 2}]",
           "cluster.timeout_s=30"]


@pytest.mark.timeout(180)
def test_recorder_gathers_every_ranks_calls_in_a_ps_run(tmp_path: Path) -> None:
    recorder = HookRecorder()
    record = run_workload(["noop"], [*ONE_JOB, "cluster.mode=ps"], tmp_path=tmp_path,
                          recorder=recorder)
    assert [j.status for j in record.jobs] == ["done"]
    assert recorder.ranks() == [LAUNCHER, 0, 1, 2]  # the launcher, the server, two workers
    # the launcher's own calls (validation, scoring) are not counted as rank 0's
    assert recorder.count("layer_build", rank=0) == recorder.count("layer_build", rank=1) > 0
    assert recorder.count("configure", rank=0) == recorder.count("configure", rank=1) == 1
    assert recorder.count("configure", rank=LAUNCHER) == 2
    assert recorder.count("iteration_start", rank=LAUNCHER) == 0
    for rank in (0, 1, 2):
        recorder.assert_order(["run_start", "iteration_start", "iteration_end", "report_rows",
                               "run_end"], rank=rank)
        assert recorder.count("iteration_end", rank=rank) == 2
    # the server runs no forward; the workers take no optimizer step
    assert recorder.count("after_forward", rank=0) == 0
    assert recorder.count("before_optimizer_step", rank=0) == 2
    assert recorder.count("after_forward", rank=1) == 2
    assert recorder.count("before_optimizer_step", rank=1) == 0
    assert recorder.count("transfer_done", rank=1) > 0
    # decisions are the leader's
    assert recorder.count("allocate", rank=0) > 0 and recorder.count("allocate", rank=1) == 0
    (start,) = recorder.calls("run_start", rank=2)
    assert (start["run"].rank, start["run"].role, start["run"].world_size) == (2, "worker", 3)


@pytest.mark.timeout(180)
def test_an_uninstalled_spec_reaches_every_rank(tmp_path: Path) -> None:
    from plugins_for_tests import RANK_REPORTER

    registry = Registry.discover(autoload=False)  # nothing installed: only what is added
    record = run_workload([RANK_REPORTER], [*ONE_JOB, "cluster.mode=allreduce"],
                          tmp_path=tmp_path, registry=registry)
    rows = sorted(r.summary for r in record.plugin_rows if r.plugin == "rank_reporter")
    assert rows == ["worker rank 0", "worker rank 1"]


def test_a_spec_that_cannot_travel_to_the_ranks_is_refused_in_one_line(tmp_path: Path) -> None:
    from accelopt.errors import UserError

    local = PluginSpec(name="local_only", factory=lambda config: Counter(config),
                       description="a lambda factory: it cannot be pickled")
    with pytest.raises(UserError, match="'local_only' was added in code and cannot be sent") as info:
        run_workload([local], [*ONE_JOB, "cluster.mode=ps"], tmp_path=tmp_path)
    assert "\n" not in str(info.value)
    assert not list(tmp_path.rglob("metrics.json"))


def test_the_recorder_ships_an_optimizer_as_a_description() -> None:
    """A rank's recorded optimizer reached the test process as a live object: unpickling it
    ran Optimizer.__setstate__, which patched its class's step for the whole process (a
    plugin's optimizer subclass skipping Optimizer.__init__ then failed in later runs)."""
    import torch

    from accelopt.testing.recorder import Shipped, _portable

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    shipped = _portable({"previous": optimizer})["previous"]
    assert isinstance(shipped, Shipped) and shipped.type == "SGD"
    assert "1 parameters" in shipped.text


@pytest.mark.parametrize("keep, where", [
    (lambda m: {n: p.data for n, p in m.named_parameters()}, r"\['net\.1\.weight'\]"),
    (lambda m: m.state_dict(), r"\['net\.1\.weight'\]"),
    (lambda m: [p.detach()[:1] for p in m.parameters()], r"\[0\]"),  # a view of one
])
def test_the_retention_check_sees_detached_aliases_of_the_jobs_weights(
        tmp_path: Path, keep: Any, where: str) -> None:
    """``{n: p.data}`` or ``model.state_dict()`` are plain tensors that share the
    parameters' storage: they keep the job's weights alive, and passed the check."""
    class Aliases(Counter):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.kept: dict[str, Any] = {}

        @hookimpl
        def accelopt_job_built(self, run: Any, job: Any) -> None:
            self.kept[job.job.name] = keep(job.model)

    spec = make_spec(Aliases)
    with pytest.raises(AssertionError, match=r"still holds a tensor sharing its storage with a "
                       rf"job's parameter or buffer .* at Aliases\.kept\['tiny-mlp'\]{where}"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


def test_the_retention_check_allows_copies_of_the_jobs_weights(tmp_path: Path) -> None:
    class Copies(Counter):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.kept: dict[str, Any] = {}

        @hookimpl
        def accelopt_job_built(self, run: Any, job: Any) -> None:
            self.kept[job.job.name] = {k: t.clone() for k, t in job.model.state_dict().items()}

    spec = make_spec(Copies)
    instances = check_run(spec, tmp_path)
    check_no_retained_job_state(spec, instances)
    assert any(i.kept.get("tiny-mlp") for i in instances)  # it did keep its copies


def test_an_answer_from_a_hook_declared_to_return_none_fails_the_run_check(
        tmp_path: Path) -> None:
    """A hook documented to return None answering 42: the core ignores it (whatever the
    plugin meant by it never happens) and conformance passed."""
    class Answers(Counter):
        @hookimpl
        def accelopt_iteration_end(self, context: IterationContext,
                                   result: IterationResult) -> Any:
            self.n += 1
            return 42

    with pytest.raises(AssertionError, match=r"plugin 'counter': in the 'tiny' workload, "
                       r"accelopt_iteration_end returned int 42, but accelopt_iteration_end is "
                       r"declared to return None: the core ignores the answer"):
        check_run(make_spec(Answers), tmp_path)

    class Named(Counter):  # an implementation under another name (specname)
        @hookimpl(specname="accelopt_run_start")
        def started(self, run: RunInfo) -> Any:
            return "started"

    with pytest.raises(AssertionError, match=r"started returned str 'started', but "
                       "accelopt_run_start is declared to return None"):
        check_run(make_spec(Named), tmp_path / "named")
    instances = check_run(make_spec(Counter), tmp_path / "counter")  # None: fine
    assert not [a for a in vars(instances[0]) if a.startswith("accelopt_")]  # unwrapped
