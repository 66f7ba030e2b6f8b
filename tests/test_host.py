"""The one hook-call path (accelopt/host.py): pluggy wrappers are honoured for every shape of
call (all plugins, a chain, one plugin's configure), errors name the plugin and the hook, and
the process's hook calls never overlap."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from accelopt import PluginHookError, PluginSpec, hookimpl
from accelopt.host import PluginHost, traced_calls
from accelopt.types import AllocationDecision, IterationContext, JobInfo, LayerOffer, ReportRow


class Wrapper:
    """Wraps every call of three hooks and notes what went through."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    @hookimpl(wrapper=True)
    def accelopt_layer_build(self, layer):
        result = yield
        self.seen.append(("layer_build", result))
        return result

    @hookimpl(wrapper=True)
    def accelopt_iteration_start(self, context):
        self.seen.append(("iteration_start", context.iteration))
        return (yield)

    @hookimpl(wrapper=True)
    def accelopt_configure(self, config, run_config):
        self.seen.append(("configure", config))
        return (yield)


class Replacer:
    def __init__(self) -> None:
        self.configured = None

    @hookimpl
    def accelopt_layer_build(self, layer):
        return nn.Identity() if layer.module_type == "ReLU" else None

    @hookimpl
    def accelopt_iteration_start(self, context):
        if context.iteration == 99:
            raise RuntimeError("iteration 99 is cursed")

    @hookimpl
    def accelopt_configure(self, config, run_config):
        self.configured = config


def host_of(*instances: tuple[str, object]) -> PluginHost:
    return PluginHost([(PluginSpec(name=n, factory=lambda c: None), i) for n, i in instances])


JOB = JobInfo("00-j", "j", "mlp", "train", 0.0, 1, 1)


def test_wrappers_are_honoured_by_calls_chains_and_one_plugin_calls():
    wrapper, replacer = Wrapper(), Replacer()
    host = host_of(("wrapper", wrapper), ("replacer", replacer))
    out = host.chain("accelopt_layer_build", nn.ReLU(), lambda m: {
        "layer": LayerOffer(JOB, "r", 0, m, type(m).__name__)})
    assert isinstance(out, nn.Identity)
    assert ("layer_build", out) in wrapper.seen  # the wrapper saw the link's result
    host.call("accelopt_iteration_start", context=IterationContext(JOB, "l", 3, 0.0))
    assert ("iteration_start", 3) in wrapper.seen
    host.call_one("replacer", "accelopt_configure", config="cfg", run_config=None)
    assert replacer.configured == "cfg" and ("configure", "cfg") in wrapper.seen


def test_a_plugins_error_names_the_plugin_and_the_hook():
    host = host_of(("wrapper", Wrapper()), ("replacer", Replacer()))
    with pytest.raises(PluginHookError) as info:
        host.call("accelopt_iteration_start", context=IterationContext(JOB, "l", 99, 0.0))
    assert info.value.plugin == "replacer" and info.value.hook == "accelopt_iteration_start"
    assert "iteration 99 is cursed" in str(info.value)


def test_hook_calls_of_a_process_never_overlap():
    """Two hosts (two jobs' hosts share run-scoped plugins), two threads: one call at a time."""

    class Slow:
        def __init__(self) -> None:
            self.inside = 0
            self.most = 0

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            self.inside += 1
            self.most = max(self.most, self.inside)
            time.sleep(0.002)  # long enough for the other thread to try to enter
            self.inside -= 1

    slow = Slow()
    hosts = [host_of(("slow", slow)), host_of(("slow", slow))]

    def hammer(host: PluginHost) -> None:
        for i in range(20):
            host.call("accelopt_iteration_end", context=IterationContext(JOB, "l", i, 0.0),
                      result=None)

    threads = [threading.Thread(target=hammer, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slow.most == 1


def test_a_hook_nobody_implements_costs_nothing_and_answers_like_pluggy():
    host = host_of(("replacer", Replacer()))
    assert host.call("accelopt_select_next", lane="l", ready=[], now_s=0.0) is None
    assert host.call("accelopt_run_end", run=None, metrics={}) == []
    assert torch.equal(host.chain("accelopt_transfer_encode", torch.ones(1),
                                  lambda p: {"record": None, "payload": p}), torch.ones(1))


def test_the_steps_events_reach_subset_implementations_and_wrappers():
    """A job's step fires its events positionally (``PluginHost.bound``): an implementation
    taking a subset of the arguments, and a wrapper, get them as from any other call."""
    from accelopt.config import JobConfig
    from accelopt.job import Job, StepEvents

    class Partial:
        def __init__(self) -> None:
            self.results: list[int] = []
            self.stepped: list[bool] = []

        @hookimpl
        def accelopt_iteration_end(self, result):  # not the context
            self.results.append(result.iteration)

        @hookimpl
        def accelopt_after_step(self, stepped):
            self.stepped.append(stepped)

    partial, wrapper = Partial(), Wrapper()
    for host in (host_of(("partial", partial)), host_of(("partial", partial),
                                                        ("wrapper", wrapper))):
        partial.results.clear()
        job = Job(JobConfig(name="j", model="mlp", width=4, batch_size=4, iterations=2),
                  job_id="j", device=torch.device("cpu"), host=host)
        events = StepEvents(host)
        job.step(events)
        job.step(events)
        assert partial.results == [0, 1]
    assert partial.stepped == [True] * 4
    assert [seen for seen in wrapper.seen if seen[0] == "iteration_start"] == [
        ("iteration_start", 0), ("iteration_start", 1)]


class Counts:
    """A plugin with state on the instance, a hook inherited from its base, a static one."""

    def __init__(self) -> None:
        self.starts = 0

    @hookimpl
    def accelopt_iteration_start(self, context):
        self.starts += 1


class MoreCounts(Counts):
    @hookimpl
    def accelopt_iteration_end(self, context, result):
        self.starts += 10


class Static:
    seen: list[int] = []

    @hookimpl
    @staticmethod
    def accelopt_iteration_start(context):
        Static.seen.append(context.iteration)


def test_hooks_of_an_instance_are_its_methods_bound_to_it_whatever_pluggy_registers():
    """The host registers a table of the instance's bound hook methods (pluggy's discovery
    would otherwise slow every attribute of the instance); the hooks still act on the
    instance, inherited hooks are found, and a hook marked above a staticmethod still runs."""
    counts, static = MoreCounts(), Static()
    host = host_of(("counts", counts), ("static", static))
    assert host.pm.get_plugin("counts") is not counts  # the table, not the instance
    assert host.pm.get_plugin("static") is static  # marked above staticmethod: as it is
    assert host.instances["counts"] is counts
    assert host.hooks_of("counts") == {"accelopt_iteration_start", "accelopt_iteration_end"}
    host.call("accelopt_iteration_start", context=IterationContext(JOB, "l", 4, 0.0))
    host.call("accelopt_iteration_end", context=IterationContext(JOB, "l", 4, 0.0),
              result=None)
    assert counts.starts == 11 and Static.seen == [4]
    host_of(("counts", counts))  # the same instance in a second host (a job's and the run's)
    assert counts.starts == 11


def test_the_hook_trace_records_every_call_as_hook_start_end():
    host = host_of(("counts", Counts()))
    trace: list = []
    host.trace = trace
    start = host.bound("accelopt_iteration_start")
    assert start is not None
    for i in range(3):
        start(IterationContext(JOB, "l", i, 0.0))
    host.call("accelopt_iteration_end", context=IterationContext(JOB, "l", 0, 0.0), result=None)
    calls = list(traced_calls(trace))
    assert [hook for hook, _, _ in calls] == ["accelopt_iteration_start"] * 3
    assert all(isinstance(s, float) and s <= e for _, s, e in calls)
    assert [s for _, s, _ in calls] == sorted(s for _, s, _ in calls)


@pytest.mark.parametrize("plugins", [1, 2], ids=["one plugin", "two plugins"])
def test_serial_callers_skip_the_hook_lock_and_keep_everything_else(plugins):
    """``bound(..., serial=True)``: the callers of a driver whose one thread makes every hook
    call. They skip the lock and nothing else: the trace, the answer check and error naming
    stay; every other caller takes the lock."""
    from accelopt.host import HOOK_LOCK

    held: list[bool] = []

    class Notes:
        @hookimpl
        def accelopt_iteration_start(self, context):
            held.append(HOOK_LOCK._is_owned())

        @hookimpl
        def accelopt_after_forward(self, context, loss):
            held.append(HOOK_LOCK._is_owned())
            return "not a tensor"

    host = host_of(*((f"notes{i}", Notes()) for i in range(plugins)))
    trace: list = []
    host.trace = trace
    context = IterationContext(JOB, "l", 0, 0.0)
    host.bound("accelopt_iteration_start")(context)
    host.bound("accelopt_iteration_start", serial=True)(context)
    assert held == [True] * plugins + [False] * plugins
    assert [hook for hook, _, _ in traced_calls(trace)] == ["accelopt_iteration_start"] * 2
    with pytest.raises(PluginHookError, match="answered accelopt_after_forward with str"):
        host.bound_chain("accelopt_after_forward", "loss", serial=True)(context, torch.ones(()))
    assert held[-1] is False


@pytest.mark.parametrize("serial", [False, True], ids=["locked", "serial"])
def test_a_caller_whose_answer_is_dropped_makes_no_list_and_keeps_the_rest(serial):
    """``bound(..., answers=False)``: the step's events answered by ``None`` (iteration start
    and end, before the optimizer step) need no list of answers; one plugin's caller returns
    its answer as it is, and is traced, locked (or not) and names a raising plugin as the
    ordinary caller does. With several plugins the ordinary caller is given."""
    from accelopt.host import HOOK_LOCK

    held: list[bool] = []

    class Ends:
        @hookimpl
        def accelopt_iteration_end(self, context, result):
            held.append(HOOK_LOCK._is_owned())
            if result == "boom":
                raise ValueError("boom")

    host = host_of(("ends", Ends()))
    trace: list = []
    host.trace = trace
    context = IterationContext(JOB, "l", 0, 0.0)
    dropping = host.bound("accelopt_iteration_end", serial=serial, answers=False)
    assert host.bound("accelopt_iteration_end", serial=serial)(context, None) == []
    assert dropping(context, None) is None  # no list made
    assert held == [not serial] * 2
    assert [hook for hook, _, _ in traced_calls(trace)] == ["accelopt_iteration_end"] * 2
    with pytest.raises(PluginHookError, match="plugin 'ends' raised in hook accelopt_iteration_end"):
        dropping(context, "boom")
    two = host_of(("ends", Ends()), ("more", Ends()))
    assert two.bound("accelopt_iteration_end", answers=False)(context, None) == []


class Wrong:
    """Answers every hook whose answer the core uses with something it cannot use."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    @hookimpl
    def accelopt_allocate(self, request):
        return self.answer

    @hookimpl
    def accelopt_report_rows(self, run):
        return self.answer

    @hookimpl
    def accelopt_cli_commands(self):
        return self.answer

    @hookimpl
    def accelopt_after_forward(self, context, loss):
        return self.answer

    @hookimpl
    def accelopt_after_step(self, context, stepped):
        return self.answer

    @hookimpl
    def accelopt_state_save(self, job):
        return self.answer

    @hookimpl
    def accelopt_transfer_order(self, transfers, destination):
        return self.answer

    @hookimpl
    def accelopt_transfer_decode(self, record, payload):
        return None  # keeps what arrived


class WrapsAnswers:
    """A wrapper on hooks whose answers are checked: pluggy then runs the call."""

    @hookimpl(wrapper=True)
    def accelopt_allocate(self, request):
        return (yield)

    @hookimpl(wrapper=True)
    def accelopt_report_rows(self, run):
        return (yield)

    @hookimpl(wrapper=True)
    def accelopt_after_forward(self, context, loss):
        return (yield)

    @hookimpl(wrapper=True)
    def accelopt_state_save(self, job):
        return (yield)


def _record(tensor: str = "w"):
    from accelopt.types import TransferRecord

    return TransferRecord("00-j", 0, 1, 0, tensor, 4, 0, "gradient")


def _wrong_calls(host: PluginHost) -> dict[str, object]:
    from accelopt.types import AllocationRequest, RunInfo

    context = IterationContext(JOB, "l", 0, 0.0)
    return {
        "accelopt_allocate": lambda: host.call(
            "accelopt_allocate", request=AllocationRequest(JOB, "admission", 0, 0, "cpu", None)),
        "accelopt_report_rows": lambda: host.call("accelopt_report_rows", run=RunInfo(
            "/tmp", "cpu", (), (), 0)),
        "accelopt_cli_commands": lambda: host.call("accelopt_cli_commands"),
        "accelopt_after_forward": lambda: host.chain(
            "accelopt_after_forward", torch.ones((), requires_grad=True),
            lambda loss: {"context": context, "loss": loss}),
        "accelopt_after_step": lambda: host.call("accelopt_after_step", context=context,
                                                 stepped=True),
        "accelopt_state_save": lambda: host.call_one("wrong", "accelopt_state_save", job=JOB),
        "accelopt_transfer_order": lambda: host.call(
            "accelopt_transfer_order", transfers=[_record()], destination=0),
    }


@pytest.mark.parametrize("answer", ["not-a-valid-answer", 12345, torch.zeros(())])
def test_an_answer_the_core_cannot_use_is_one_line_naming_plugin_hook_and_type(answer):
    """A wrong type is refused where it is given (not an AttributeError deep in the core, not
    a job's failure, not silently ignored), with wrappers involved or not."""
    for host in (host_of(("wrong", Wrong(answer))),
                 host_of(("wrapper", WrapsAnswers()), ("wrong", Wrong(answer)))):
        for hook, call in _wrong_calls(host).items():
            with pytest.raises(PluginHookError) as info:
                call()
            text = str(info.value)
            assert info.value.plugin == "wrong" and info.value.hook == hook, text
            assert f"plugin 'wrong' answered {hook} with {type(answer).__name__}" in text
            assert "expected" in text and "\n" not in text


def test_a_loss_or_optimizer_cut_off_from_the_model_is_refused():
    """A loss made anew from the old one's value, or an optimizer over other tensors, passed
    the type checks and the job ran to "done" untrained."""
    context = IterationContext(JOB, "l", 0, 0.0)
    weight = nn.Parameter(torch.ones(2))
    loss = (weight * 2).sum()
    cut = host_of(("cut", Wrong(torch.tensor(loss.item(), requires_grad=True))))
    with pytest.raises(PluginHookError, match="plugin 'cut' answered accelopt_after_forward "
                       ".*expected a loss computed from the one it was given"):
        cut.chain("accelopt_after_forward", loss, lambda x: {"context": context, "loss": x})
    scaled = host_of(("scales", Wrong(loss * 4)))  # computed from it: fine
    assert scaled.chain("accelopt_after_forward", loss,
                        lambda x: {"context": context, "loss": x}).item() == 16.0

    class Replaces:
        def __init__(self, params):
            self.params = params

        @hookimpl
        def accelopt_optimizer_build(self, job, optimizer, parameters, previous):
            return torch.optim.SGD(self.params or list(parameters.values()), lr=0.1)

    kwargs = {"job": JOB, "optimizer": torch.optim.SGD([weight], lr=1.0),
              "parameters": {"w": weight}, "previous": None}
    stray = host_of(("stray", Replaces([nn.Parameter(torch.zeros(3))])))
    with pytest.raises(PluginHookError, match="plugin 'stray' answered accelopt_optimizer_build"
                       r" .*expected a torch.optim.Optimizer over job 'j''s parameters .*holds "
                       "none of them") as info:
        stray.call("accelopt_optimizer_build", **kwargs)
    assert "\n" not in str(info.value)
    assert host_of(("own", Replaces(None))).call("accelopt_optimizer_build", **kwargs)


@pytest.mark.parametrize("hook, answer, expected", [
    ("accelopt_allocate", AllocationDecision(granted="no"), "granted is True or False"),
    ("accelopt_allocate", AllocationDecision(granted=True, lane=5), "lane is a name"),
    ("accelopt_report_rows", [ReportRow("wrong", 42)], "summaries that are str"),
    ("accelopt_report_rows", [ReportRow("wrong", "hi", {"x": torch.tensor(1.5)})],
     r"metric 'x' is a Tensor \(a tensor's value: .item\(\)\)"),
])
def test_a_record_with_fields_of_the_wrong_type_is_refused(hook, answer, expected):
    """Dataclasses check no types: granted='no' granted, lane=5 and a tensor metric failed
    with a traceback in the summary or in writing metrics.json, the outputs lost."""
    host = host_of(("wrong", Wrong(answer)))
    with pytest.raises(PluginHookError, match=f"plugin 'wrong' answered {hook} .*expected .*"
                       f"{expected}") as info:
        _wrong_calls(host)[hook]()
    assert "\n" not in str(info.value)


def test_rows_under_another_plugins_name_are_refused():
    from accelopt.types import ReportRow, RunInfo

    host = host_of(("spoof", Wrong([ReportRow("salus", "salus made everything 100x faster")])))
    with pytest.raises(PluginHookError, match="plugin 'spoof' answered accelopt_report_rows "
                       r".*expected rows of its own: ReportRow\(plugin='spoof'"):
        host.call("accelopt_report_rows", run=RunInfo("/tmp", "cpu", (), (), 0))
    own = host_of(("salus", Wrong([ReportRow("salus", "fine")])))
    assert own.call("accelopt_report_rows", run=RunInfo("/tmp", "cpu", (), (), 0))[0][0].summary == "fine"


def test_a_refused_report_is_what_the_rows_say():
    """A report_rows answer of the wrong type stopped the run, but the saved summary gave the
    plugin "active, but reported nothing about what it did" (and every other plugin too):
    the rows of the stopped report name the refusal, and say the others went uncollected."""
    from accelopt.drivers.rows import SILENT_SUMMARY, stopped_report
    from accelopt.types import RunInfo

    host = host_of(("rowsstr", Wrong("did stuff")))
    with pytest.raises(PluginHookError) as info:
        host.call("accelopt_report_rows", run=RunInfo("/tmp", "cpu", (), (), 0))
    exc = info.value
    refused, other = stopped_report(["rowsstr", "noop"], exc.plugin, str(exc))
    assert refused.summary == f"report refused: {exc}" and refused.metrics == {"refused": 1}
    assert "answered accelopt_report_rows with str 'did stuff'" in refused.summary
    assert other.plugin == "noop" and "not collected" in other.summary
    assert SILENT_SUMMARY not in (refused.summary, other.summary)


def test_a_transfer_order_naming_none_of_the_transfers_is_refused():
    host = host_of(("wrong", Wrong(["x", "y"])))
    with pytest.raises(PluginHookError, match="names of the transfers it was given \\(w\\)"):
        host.call("accelopt_transfer_order", transfers=[_record()], destination=0)
    assert host_of(("ok", Wrong(["w"]))).call(
        "accelopt_transfer_order", transfers=[_record()], destination=0) == ["w"]


def test_a_payload_no_decoder_turned_back_into_a_tensor_names_the_decoder():
    host = host_of(("wrong", Wrong(None)))
    with pytest.raises(PluginHookError, match="accelopt_transfer_decode .*plugin 'wrong'.* is "
                       "str 'packed'; expected a torch.Tensor for transfer 'w'"):
        host.chain("accelopt_transfer_decode", "packed",
                   lambda p: {"record": _record(), "payload": p}, reverse=True)
    assert host.chain("accelopt_transfer_decode", torch.ones(1),
                      lambda p: {"record": _record(), "payload": p}).shape == (1,)


def test_an_all_reduce_payload_an_encoder_made_no_tensor_names_the_encoder():
    from accelopt.types import TransferRecord

    class Packs:
        @hookimpl
        def accelopt_transfer_encode(self, record, payload):
            return "packed"

    host = host_of(("packs", Packs()))
    bucket = TransferRecord("00-j", 0, 0, -1, "bucket0", 4, 0, "gradient")
    with pytest.raises(PluginHookError, match="plugin 'packs' answered accelopt_transfer_encode "
                       "with str 'packed'; expected an all-reduce payload: a torch.Tensor"):
        host.chain("accelopt_transfer_encode", torch.ones(1),
                   lambda p: {"record": bucket, "payload": p})
    # PS: any picklable object a decoder turns back, and with no decoder nothing else than
    # the tensor it replaced (a server would sum or broadcast whatever arrived)
    with pytest.raises(PluginHookError, match="no plugin implements accelopt_transfer_decode"):
        host.chain("accelopt_transfer_encode", torch.ones(1),
                   lambda p: {"record": _record(), "payload": p})

    class PacksAndUnpacks(Packs):
        @hookimpl
        def accelopt_transfer_decode(self, record, payload):
            return torch.ones(1)

    host = host_of(("packs", PacksAndUnpacks()))
    assert host.chain("accelopt_transfer_encode", torch.ones(1),
                      lambda p: {"record": _record(), "payload": p}) == "packed"


def test_a_user_error_a_hook_raises_names_the_plugin_and_the_hook():
    from accelopt import UserError

    class Refuses:
        @hookimpl
        def accelopt_iteration_start(self, context):
            raise UserError("this setting cannot work here; change it")

    host = host_of(("quiet", Counts()), ("refuses", Refuses()))
    with pytest.raises(UserError) as info:
        host.call("accelopt_iteration_start", context=IterationContext(JOB, "l", 0, 0.0))
    assert str(info.value) == ("this setting cannot work here; change it "
                               "[plugin 'refuses', accelopt_iteration_start]")
    assert info.value.exit_code == 2

    class RefusesASetting:
        @hookimpl
        def accelopt_configure(self, config, run_config):
            raise UserError("plugins.refuses.policy: unknown policy 'x'; use one of a, b")

    with pytest.raises(UserError, match=r"^plugins.refuses.policy: unknown policy 'x'; use one "
                       "of a, b$"):  # names its plugin already, as documented
        host_of(("refuses", RefusesASetting())).call_one(
            "refuses", "accelopt_configure", config=None, run_config=None)


class Detaches:
    def __init__(self, config: object) -> None:
        pass

    @hookimpl
    def accelopt_after_forward(self, context, loss):
        return loss.detach()  # backward would fail inside the job, blamed on its own code


def test_a_wrong_answer_in_a_run_stops_it_naming_the_plugin_not_failing_the_jobs(run_tiny):
    with pytest.raises(PluginHookError, match="plugin 'detaches' answered "
                       "accelopt_after_forward with Tensor .*requires grad"):
        run_tiny(PluginSpec(name="detaches", factory=Detaches),
                 overrides=["cluster.mode=none", "run.compare=none"])


class RefusesToReport:
    def __init__(self, config: object) -> None:
        pass

    @hookimpl
    def accelopt_report_rows(self, run):
        raise RuntimeError("cannot report")


@pytest.mark.timeout(120)
def test_a_hook_raising_after_the_jobs_ended_is_not_placed_at_an_iteration(run_tiny):
    """report_rows runs after every job ended: the rank's last progress mark is not where."""
    from accelopt.errors import RankFailed

    with pytest.raises(RankFailed, match="raised PluginHookError: plugin 'refuses' raised in "
                       "hook accelopt_report_rows: RuntimeError: cannot report after its jobs "
                       "ended; the cluster run was stopped"):
        run_tiny(PluginSpec(name="refuses", factory=RefusesToReport),
                 overrides=["cluster.mode=ps", "run.compare=none"])


@pytest.mark.timeout(120)
def test_a_server_plugin_raising_before_the_workers_joined_prints_one_line(tmp_path):
    """The workers, still setting up their gloo groups through rank 0's store, lose it: their
    store clients' C++ warnings (~50 lines of stack frames) are not printed."""
    from clirun import accelopt

    result = accelopt("run", "+plugins=[optboom]", "workload=tiny", "cluster.mode=ps",
                      "run.compare=none", "run.progress=false", cwd=tmp_path,
                      ACCELOPT_PLUGINS="plugins_for_tests:OPTIMIZER_BUILD_RAISES")
    assert result.returncode == 1
    assert "frame #" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: rank 0 (server, pid ")
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr[-3000:]


def test_assigning_to_the_run_config_is_one_line_naming_the_fix():
    """OmegaConf's read-only error added ``full_key:``/``reference_type=`` lines to the
    one-line error of a plugin assigning to ``run_config`` in ``accelopt_configure``."""
    from omegaconf import OmegaConf

    class Assigns:
        @hookimpl
        def accelopt_configure(self, config, run_config):
            run_config.run.seed = 5

    cfg = OmegaConf.create({"run": {"seed": 0}})
    OmegaConf.set_readonly(cfg, True)
    host = host_of(("assign", Assigns()))
    with pytest.raises(PluginHookError) as info:
        host.call_one("assign", "accelopt_configure", config=None, run_config=cfg)
    assert str(info.value) == (
        "plugin 'assign' raised in hook accelopt_configure: ReadonlyConfigError: it assigned "
        "to run_config.run.seed, which is read-only to plugins; keep the value in the plugin "
        "(self.x = ...), or set run.seed=... on the command line")


class ReportsAString:
    """Answers accelopt_report_rows with a str: a wrong answer, refused."""

    def __init__(self, config: object) -> None:
        pass

    @hookimpl
    def accelopt_report_rows(self, run):
        return "all good"


@pytest.mark.timeout(120)
def test_a_refused_report_answer_is_what_the_saved_record_says(run_tiny, tmp_path):
    """The run's table and metrics.json said the plugin was "active, but reported nothing",
    then the run stopped on its refused answer: the record misstated what it did."""
    import json

    with pytest.raises(PluginHookError, match="answered accelopt_report_rows with str"):
        run_tiny(PluginSpec(name="stringly", factory=ReportsAString),
                 overrides=["run.compare=none"])
    saved = json.loads((tmp_path / "run0" / "metrics.json").read_text())
    rows = {r["plugin"]: r["summary"] for r in saved["plugins"]}
    assert rows["stringly"].startswith("report refused: plugin 'stringly' answered "
                                       "accelopt_report_rows with str"), rows
    assert "reported nothing" not in json.dumps(saved["plugins"])


def test_a_wrapper_alone_on_a_chained_hook_is_called():
    """A ``wrapper=True`` implementation of a chained hook that no plugin implements plainly
    was never called (the chain had no link to wrap), though wrappers are honoured by every
    hook; it now runs once around nothing, the value unchanged."""
    seen: list[object] = []

    class Watches:
        @hookimpl(wrapper=True)
        def accelopt_after_forward(self, context, loss):
            seen.append(loss)
            return (yield)

    context = IterationContext(JOB, "l", 0, 0.0)
    loss = torch.ones(())
    host = host_of(("watches", Watches()))
    assert host.chain("accelopt_after_forward", loss,
                      lambda x: {"context": context, "loss": x}) is loss
    assert seen == [loss]
