"""Plugins in a training loop the user writes (``accelopt.attach``, docs/your-model.md): the
documented loop gains offload, gpu_kernels or slide with at most five lines, the same hooks
fire as in ``accelopt run`` on the same model, the same report rows come back, and plugins
that could not act in one loop are refused in one line."""

from __future__ import annotations

import collections
import contextlib
import difflib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accelopt
from accelopt import ConfigError, PluginSpec, Registry, UserError, hookimpl
from accelopt.testing import run_workload

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.timeout(180)
DOC = Path(__file__).resolve().parents[1] / "docs" / "your-model.md"
SLIDE = '["+plugins=[slide]"]'
PLUGINS = {
    "offload": '["+plugins=[offload]"]',
    "gpu_kernels": '["+plugins=[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5"]',
    "slide": SLIDE,
}


def loops() -> tuple[str, str]:
    """The section's plain loop and the same loop with accelopt."""
    section = DOC.read_text().split("## In your own training loop", 1)[1]
    blocks = [b.split("```", 1)[0] for b in section.split("```python")[1:]]
    return blocks[0], blocks[1]


class LoopRecorder:
    """The hooks a loop of one's own can fire, recorded by name."""

    def __init__(self, config: object = None) -> None:
        self.calls: list[str] = []

    def _note(self, name: str) -> None:
        self.calls.append(name)

    @hookimpl
    def accelopt_configure(self, config, run_config):
        self._note("configure")

    @hookimpl
    def accelopt_layer_build(self, layer):
        self._note("layer_build")

    @hookimpl
    def accelopt_job_built(self, run, job):
        self._note("job_built")

    @hookimpl
    def accelopt_run_start(self, run):
        self._note("run_start")

    @hookimpl
    def accelopt_iteration_start(self, context):
        self._note("iteration_start")

    @hookimpl
    def accelopt_iteration_end(self, context, result):
        self._note("iteration_end")

    @hookimpl
    def accelopt_report_rows(self, run):
        self._note("report_rows")

    @hookimpl
    def accelopt_run_end(self, run, metrics):
        self._note("run_end")


RECORDERS: list[LoopRecorder] = []


def _recorder(config: object) -> LoopRecorder:
    RECORDERS.append(LoopRecorder())
    return RECORDERS[-1]


RECORDER = PluginSpec(name="loop_recorder", factory=_recorder, scope="run")


def registry() -> Registry:
    reg = Registry.discover()
    reg.add(RECORDER)
    return reg


def test_the_documented_loop_gains_a_plugin_with_at_most_five_lines():
    plain, attached = loops()
    assert len(plain.strip().splitlines()) <= 21  # a short loop of one's own
    diff = [line for line in difflib.unified_diff(plain.splitlines(), attached.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added = [line for line in diff if line.startswith("+") and line[1:].strip()]
    removed = [line for line in diff if line.startswith("-") and line[1:].strip()]
    assert len(added) <= 5 and len(removed) <= 1, diff  # one line changed, four added
    assert SLIDE in attached


def run_documented_loop(name: str, tmp_path: Path, monkeypatch) -> tuple[list, list[str], str]:
    """The documented loop with ``name`` instead of slide (and the recorder): its rows, the
    hooks it fired, and what it printed."""
    import io

    from rich.console import Console

    _, attached = loops()
    overrides = PLUGINS[name].replace(f"+plugins=[{name}]", f"+plugins=[{name},loop_recorder]")
    code = attached.replace(SLIDE, overrides).replace(
        "optimizer=\"adam\", lr=1e-3)",
        "optimizer=\"adam\", lr=1e-3, run_dir=RUN_DIR, registry=REGISTRY, console=CONSOLE)")
    assert code != attached
    out = io.StringIO()
    namespace = {"RUN_DIR": tmp_path / "loop", "REGISTRY": registry(),
                 "CONSOLE": Console(file=out, width=200)}
    RECORDERS.clear()
    exec(compile(code, str(DOC), "exec"), namespace)
    rows = namespace["ao"].close()  # the second call returns the rows the first printed
    return rows, RECORDERS[-1].calls, out.getvalue()


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_the_documented_loop_fires_the_hooks_and_reports_the_rows_of_accelopt_run(
        name, tmp_path, monkeypatch, capsys):
    rows, loop_calls, printed = run_documented_loop(name, tmp_path, monkeypatch)
    assert "train accuracy" in capsys.readouterr().out
    rows = [r for r in rows if r.plugin != RECORDER.name]
    assert [r.plugin for r in rows] == [name] and name in printed
    assert (tmp_path / "loop" / "report.json").exists()
    # the same model and data through `accelopt run` (the test's own factories)
    overrides = [o.strip('"') for o in PLUGINS[name].strip("[]").split(", ")][1:]
    RECORDERS.clear()
    record = run_workload(
        [name, RECORDER], [*overrides, "workload.jobs.0.name=model",
                           "workload.jobs.0.model=byo_models:doc_loop_model",
                           "workload.jobs.0.dataset=byo_models:doc_loop_data",
                           "workload.jobs.0.batch_size=128", "workload.jobs.0.iterations=48",
                           "workload.jobs.0.optimizer=adam", "workload.jobs.0.lr=0.001",
                           "cluster.mode=none", "run.profile=false"],
        tmp_path=tmp_path, workload="single", registry=registry())
    run_calls = RECORDERS[-1].calls
    ours = [r for r in record.plugin_rows if r.plugin == name]

    def counts(calls: list[str]) -> collections.Counter:
        return collections.Counter(c for c in calls if c != "configure")  # validation: twice

    assert counts(loop_calls) == counts(run_calls)
    assert loop_calls.count("iteration_start") == 48 and "configure" in loop_calls
    assert [sorted(r.metrics) for r in rows] == [sorted(r.metrics) for r in ours]
    shape_facts = {"offload": ("offloaded_bytes_per_iteration", "param_bytes_per_iteration"),
                   "gpu_kernels": ("params_before", "params_after", "layers_pruned")}
    for key in shape_facts.get(name, ()):
        assert rows[0].metrics[key] == ours[0].metrics[key], key
    if name == "slide":  # the same layer replaced, named the same way
        assert rows[0].summary.split(" trained")[0] == ours[0].summary.split(" trained")[0]
        # a scheduler of the loop never reaches the layer (it updates itself): the row says
        # at which rate it trains; accelopt run's job follows its own lr_schedule instead
        assert "sparse Adam runs at lr 0.001 throughout" in rows[0].summary
        assert "throughout" not in ours[0].summary


def test_the_step_and_backward_events_fire_in_a_loop_and_clipping_acts(tmp_path):
    """The gradient-clipping example plugin, on ``ao.step``: a tiny max_norm changes what
    the optimizer applies exactly as clipping the gradients by hand would."""
    pytest.importorskip("accelopt_clip")

    def trained(with_plugin: bool, run_dir: Path) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        x, y = torch.randn(16, 8), torch.randint(3, (16,))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ao = accelopt.attach(model, ["+plugins=[clip]", "plugins.clip.max_norm=0.01"]
                             if with_plugin else [], run_dir=run_dir)
        for _ in ao.loop(range(3)):
            loss = torch.nn.functional.cross_entropy(ao.model(x), y)
            opt.zero_grad()
            ao.backward(loss)
            if not with_plugin:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            ao.step(opt)
        rows = ao.close()
        assert [r.plugin for r in rows] == (["clip"] if with_plugin else [])
        return model.weight.detach().clone()

    clipped = trained(True, tmp_path / "plugin")
    torch.testing.assert_close(clipped, trained(False, tmp_path / "by-hand"))
    torch.manual_seed(0)
    assert not torch.allclose(clipped, torch.nn.Linear(8, 3).weight)  # it did train


@pytest.mark.parametrize("overrides, words", [
    (["+plugins=[salus]"], "plugin 'salus' acts through accelopt_allocate"),
    (["+plugins=[gradcomm]"], "plugin 'gradcomm' acts through accelopt_transfer.* in your own "
                              r"DDP script through a DDP communication hook "
                              r"\(accelopt_plugins.gradcomm.comm_hook"),
    (["cluster.mode=allreduce"], "cluster.mode=allreduce needs accelopt's ranks"),
    # it looks at the built job and its iterations and acts on transfers only: it was
    # accepted (after asking for example=) and did nothing
    (["+plugins=[tictac]"], "plugin 'tictac' acts through accelopt_transfer_done, "
                            "accelopt_transfer_order"),
    (["+plugins=[nope]"], "nope"),
    ("+plugins=[slide]", "takes a list of overrides"),
    # accepted and silently without effect: the plugins read lr= from attach, not these
    (["+plugins=[offload]", "workload.jobs.0.lr=5"], r"'workload.jobs.0.lr=5' has no effect "
     "in your own loop .* give attach name=, optimizer=, lr= and iterations="),
    (["workload=lm"], "'workload=lm' has no effect in your own loop"),
    (["run.compare=each"], r"'run.compare=each' has no effect in your own loop \(run.compare "
                           "is for a run accelopt drives"),
])
def test_what_cannot_act_in_one_loop_is_refused_in_one_line(overrides, words, tmp_path):
    with pytest.raises(UserError, match=words) as info:
        accelopt.attach(torch.nn.Linear(4, 2), overrides, run_dir=tmp_path / "r")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "r").exists()  # refused before anything was written


@pytest.mark.parametrize("kwargs, words", [
    ({"optimizer": "bogus"}, "optimizer must be one of sgd, adam, adamw .*got 'bogus'"),
    ({"lr": -1e-3}, r"lr must be your optimizer's learning rate \(> 0; 0: not given\)"),
    ({"lr": "0.1"}, "lr must be"),
    ({"lr": float("nan")}, "lr must be"),  # slide then trained at a nan rate
    ({"lr": float("inf")}, "lr must be"),
    ({"iterations": -5}, "iterations must be how many your loop runs"),
    ({"example": torch.zeros(8, 4)}, r"example takes one \(inputs, labels\) batch .*got Tensor"),
])
def test_the_jobs_record_attach_is_given_is_checked(kwargs, words, tmp_path):
    """attach took optimizer='bogus', a negative lr or iterations, and a bare tensor as the
    example (recording half its rows as the batch), where a run refuses the same job."""
    with pytest.raises(ConfigError, match=words) as info:
        accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "r", **kwargs)
    assert "\n" not in str(info.value) and not (tmp_path / "r").exists()


class _Sees:
    """Records the loss after_forward is given and the gradient norm the step hooks see."""

    def __init__(self, config: object = None) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    @hookimpl
    def accelopt_after_forward(self, context, loss):
        self.losses.append(float(loss.detach()))

    @hookimpl
    def accelopt_before_optimizer_step(self, context, gradients):
        self.norms.append(float(torch.linalg.vector_norm(
            torch.cat([g.flatten() for g in gradients.values()]))))

    @hookimpl
    def accelopt_report_rows(self, run):
        return [accelopt.ReportRow("sees", f"{len(self.losses)} losses")]


SEEN: list[_Sees] = []


def _sees(config: object) -> _Sees:
    SEEN.append(_Sees())
    return SEEN[-1]


def test_a_loop_with_a_grad_scaler_shows_the_plugins_the_true_loss_and_gradients(tmp_path):
    """``ao.backward(scaler.scale(loss))`` gave the plugins the loss times the scale, and
    ``ao.step(opt)`` stepped past the scaler's skip of a step with inf gradients: with the
    scaler given, the plugins see the loss and the unscaled gradients, and the weights are
    those of the same loop written with the scaler by hand."""
    reg = Registry.discover()
    reg.add(PluginSpec(name="sees", factory=_sees, scope="run", description="records"))

    hand_norms: list[float] = []

    def trained(attached: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        x, y = torch.randn(16, 8), torch.randint(3, (16,))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        ao = accelopt.attach(model, ["+plugins=[sees]"] if attached else [],
                             run_dir=tmp_path / str(attached), registry=reg)
        for _ in ao.loop(range(3)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            if attached:
                ao.backward(loss, scaler)
                assert ao.step(opt, scaler)
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                hand_norms.append(float(torch.linalg.vector_norm(torch.cat(
                    [p.grad.flatten() for p in model.parameters()]))))  # type: ignore[union-attr]
                scaler.step(opt)
                scaler.update()
        ao.close()
        return model.weight.detach().clone()

    by_hand = trained(False)
    torch.testing.assert_close(trained(True), by_hand, rtol=0, atol=0)
    seen = SEEN[-1]
    assert all(0.1 < loss < 10 for loss in seen.losses)  # the loss, not 1,024 times it
    assert seen.norms == pytest.approx(hand_norms)  # unscaled before the plugins see them


def _pruned_after_2_of_4(tmp_path: Path, through_accelopt: bool) -> tuple[torch.nn.Module, Any]:
    """A 4-iteration loop with gpu_kernels pruning half of an MLP after iteration 2, stepping
    through ``ao.backward``/``ao.step`` or (``through_accelopt=False``) past them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    x, y = torch.randn(16, 8), torch.randint(3, (16,))
    ao = accelopt.attach(model, ["+plugins=[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5",
                                 "plugins.gpu_kernels.prune_at_iteration=2"], example=(x, y),
                         iterations=4, lr=0.1, run_dir=tmp_path / "r")
    _train_on_one_batch(ao, torch.optim.SGD(ao.model.parameters(), lr=0.1), x, y, 4,
                        through_ao=through_accelopt)
    return model, ao


def _train_on_one_batch(ao: Any, opt: torch.optim.Optimizer, x: torch.Tensor,
                        y: torch.Tensor, iterations: int, *, through_ao: bool) -> torch.Tensor:
    """``iterations`` of ``ao.loop`` on one batch, stepping through ``ao.backward``/``ao.step``
    or past them (``loss.backward()``/``opt.step()``); the last loss."""
    for _ in ao.loop(range(iterations)):
        loss = torch.nn.functional.cross_entropy(ao.model(x), y)
        opt.zero_grad()
        if through_ao:
            ao.backward(loss)
            ao.step(opt)
        else:
            loss.backward()
            opt.step()
    return loss.detach()


def test_a_plugin_listening_where_the_loop_never_calls_accelopt_is_said(tmp_path):
    """A loop stepping with opt.step() never fires the step hooks: gpu_kernels' pruning
    after N iterations never ran, and its row said the job had stopped first."""
    import json

    model, ao = _pruned_after_2_of_4(tmp_path, through_accelopt=False)
    (row,) = ao.close()
    assert "accelopt_after_step never ran, where it prunes (a loop of your own: step with " \
        "ao.step(opt))" in row.summary
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["warnings"] == [
        "plugin 'gpu_kernels' listens to accelopt_after_step, which fires in ao.step(opt); this "
        "loop never called it in 4 iterations, so the plugin did nothing there"]
    # the model's parameters counted as a reader counts them (it said 4: the tensors)
    assert report["job"]["parameters"] == sum(p.numel() for p in model.parameters()) == 387
    assert report["job"]["parameter_tensors"] == 4


def test_report_counts_the_parameters_of_the_model_at_close_after_a_late_prune(tmp_path):
    """Pruned after 2 iterations: report.json counted the dense model's parameters (those at
    attach), beside a row saying it pruned."""
    import json

    _, ao = _pruned_after_2_of_4(tmp_path, through_accelopt=True)
    ao.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    pruned = sum(p.numel() for p in ao.model.parameters())
    assert pruned < 387  # the dense model's
    assert report["job"]["parameters"] == pruned


def test_slide_in_a_loop_without_a_learning_rate_is_refused(tmp_path):
    """Without lr= slide's layer trained at rate 0, its row saying it trained."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4096))
    example = (torch.randn(16, 8), torch.randint(0, 4096, (16,)))
    with pytest.raises(ConfigError, match="plugins.slide.lr: job 'model' gives no learning "
                       r"rate .*accelopt.attach\(..., lr=<rate>\)"):
        accelopt.attach(model, ["+plugins=[slide]"], example=example, optimizer="adam",
                        run_dir=tmp_path / "r")


def test_two_loops_open_on_one_run_dir_are_refused(tmp_path):
    """Two attaches with the same run_dir: the second close() replaced the first's
    report.json in silence."""
    first = accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "r", name="first")
    with pytest.raises(ConfigError, match="is the run_dir of an attach not closed yet"):
        accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "r", name="second")
    first.close()
    import json

    assert json.loads((tmp_path / "r" / "report.json").read_text())["job"]["name"] == "first"
    late = accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "s")
    (tmp_path / "s" / "report.json").write_text("{}")  # another process's, meanwhile
    with pytest.raises(ConfigError, match="was written since this attach began"):
        late.close()
    assert (tmp_path / "s" / "report.json").read_text() == "{}"


def test_misuse_of_the_handle_is_one_line(tmp_path):
    ao = accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "r")
    with pytest.raises(UserError, match="outside `with ao.iteration"):
        ao.step(torch.optim.SGD(ao.model.parameters(), lr=0.1))
    assert ao.close() == [] and (tmp_path / "r" / "report.json").exists()
    with pytest.raises(UserError, match="after close"):
        with ao.iteration():
            pass
    with pytest.raises(ConfigError, match="already holds a report"):
        accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="needs one batch of your data"):  # job_built
        accelopt.attach(torch.nn.Linear(4, 2), ["+plugins=[loop_recorder]"],
                        run_dir=tmp_path / "s", registry=registry())


def test_a_rebuild_a_plugin_asks_for_repoints_the_loops_own_optimizer(tmp_path):
    """A plugin that changes the model mid-run (pruning after N iterations) asks for an
    optimizer rebuild; a loop's optimizer is the loop's own object, and it used to go on
    stepping the old tensors (a RuntimeWarning the only sign) while the model trained none."""
    from plugins_for_tests import SHRINK

    from accelopt.workloads import build_model

    reg = Registry.discover()
    reg.add(SHRINK)
    torch.manual_seed(0)
    model = build_model("mlp", input_shape=(16,), num_classes=4, vocab_size=None, width=16)
    x, y = torch.randn(32, 16), torch.randint(4, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ao = accelopt.attach(model, ["+plugins=[shrink]"], run_dir=tmp_path / "r", registry=reg,
                         example=(x, y))
    head = ao.model.net[5].weight
    snapshots = []
    for _ in ao.loop(range(6)):
        loss = torch.nn.functional.cross_entropy(ao.model(x), y)
        opt.zero_grad()
        ao.backward(loss)
        ao.step(opt)
        snapshots.append(ao.model.net[1].weight.detach().clone())
    ao.close()
    # counted from 1 like the plugins' own text: SHRINK acts after the third iteration (2
    # counted from 0); the label read "iteration 2" beside gpu_kernels' "at iteration 3"
    assert ao.rebuild_requests == ["iteration 3: hidden width halved to 8"]
    held = [p for group in opt.param_groups for p in group["params"]]
    assert [id(p) for p in held] == [id(p) for p in ao.model.parameters()]
    assert snapshots[3].shape == (8, 16) and not torch.equal(snapshots[3], snapshots[5])
    assert "momentum_buffer" in opt.state[head]  # an unchanged parameter keeps its state


class _Ticks:
    """Notes each iteration's start and end; raises in the end of iteration ``fail_at``."""

    fail_at = -1

    def __init__(self, config: object = None) -> None:
        self.events: list[tuple[str, int]] = []

    @hookimpl
    def accelopt_iteration_start(self, context):
        self.events.append(("start", context.iteration))

    @hookimpl
    def accelopt_iteration_end(self, context, result):
        self.events.append(("end", context.iteration))
        if context.iteration == self.fail_at:
            raise RuntimeError("ticks end boom")


def _ticks_attach(tmp_path: Path, fail_at: int = -1) -> tuple[accelopt.Attached, _Ticks]:
    made: list[_Ticks] = []

    def factory(config: object) -> _Ticks:
        made.append(_Ticks())
        made[-1].fail_at = fail_at
        return made[-1]

    reg = Registry.discover()
    reg.add(PluginSpec(name="ticks", factory=factory, description="notes iterations"))
    ao = accelopt.attach(torch.nn.Linear(4, 2), ["+plugins=[ticks]"], run_dir=tmp_path / "r",
                         registry=reg)
    return ao, made[0]


def test_a_plugin_error_at_the_end_of_the_iteration_a_break_left_is_raised(tmp_path):
    """A plugin raising in accelopt_iteration_end on the iteration the loop breaks out of:
    the generator's finalisation only printed "Exception ignored in: <generator ...>" and
    the script exited 0. The error is kept and raised by the next accelopt call, or by
    close() (once the run is closed: its report kept)."""
    from accelopt.errors import PluginHookError

    ao, ticks = _ticks_attach(tmp_path, fail_at=1)
    for i in ao.loop(range(5)):
        if i == 1:
            break
    assert ticks.events == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    with pytest.raises(PluginHookError, match="plugin 'ticks' raised in hook "
                       "accelopt_iteration_end: RuntimeError: ticks end boom"):
        ao.close()
    assert (tmp_path / "r" / "report.json").exists()
    assert [r.plugin for r in ao.close()] == ["ticks"]  # raised once; the rows kept

    ao, ticks = _ticks_attach(tmp_path / "next", fail_at=0)
    for _ in ao.loop(range(3)):
        break
    with pytest.raises(PluginHookError, match="ticks end boom"):  # the next call raises it
        ao.backward(torch.zeros((), requires_grad=True))
    ao.close()


def test_the_with_block_of_an_attach_raises_the_error_a_break_left(tmp_path):
    from accelopt.errors import PluginHookError

    ao, _ = _ticks_attach(tmp_path, fail_at=0)
    with pytest.raises(PluginHookError, match="ticks end boom"), ao:
        for _ in ao.loop(range(3)):
            break


@pytest.mark.parametrize("nesting", ["loop", "with", "loop in with"])
def test_nested_iterations_are_refused_in_one_line(nesting, tmp_path):
    """An ao.loop inside an ao.loop (or one `with ao.iteration()` inside another): plugins
    saw start 0, start 0, end 0, ... and the outer body's ao.backward was refused."""
    ao, ticks = _ticks_attach(tmp_path)
    with pytest.raises(UserError, match="an iteration began while iteration 0 is still open"
                       ".* iterations do not nest") as info:
        if nesting == "loop":
            for _ in ao.loop(range(2)):
                for _ in ao.loop(range(2)):
                    pass
        elif nesting == "with":
            with ao.iteration(), ao.iteration():
                pass
        else:
            with ao.iteration():
                for _ in ao.loop(range(2)):
                    pass
    assert "\n" not in str(info.value)
    # the outer iteration ended by its exception (an ao.loop's with _end, a `with` block's
    # without); the next one begins as usual
    for _ in ao.loop(range(1)):
        ao.backward(ao.model(torch.randn(3, 4)).sum())
    ao.close()
    starts = [n for kind, n in ticks.events if kind == "start"]
    assert starts == ([0, 1] if nesting == "loop" else [0, 0])
    assert ao.iterations == (2 if nesting == "loop" else 1)


def test_an_iteration_start_that_raises_leaves_no_iteration_open(tmp_path):
    """A plugin raising in accelopt_iteration_start: the iteration never began, so the next
    one is not refused as nested."""
    from accelopt.errors import PluginHookError

    class StartFails:
        calls = 0

        def __init__(self, config: object = None) -> None:
            pass

        @hookimpl
        def accelopt_iteration_start(self, context):
            StartFails.calls += 1
            if StartFails.calls == 1:
                raise RuntimeError("start boom")

    reg = Registry.discover()
    reg.add(PluginSpec(name="startfails", factory=StartFails, description="raises once"))
    ao = accelopt.attach(torch.nn.Linear(4, 2), ["+plugins=[startfails]"],
                         run_dir=tmp_path / "r", registry=reg)
    with pytest.raises(PluginHookError, match="start boom"):
        for _ in ao.loop(range(2)):
            pass
    for _ in ao.loop(range(2)):
        pass
    assert ao.iterations == 2
    ao.close()


def test_a_repointed_optimizer_keeps_out_the_layers_the_loop_left_out():
    """A loop fine-tuning a head (``SGD(model.head.parameters())``) whose body a plugin
    pruned: every pruned name was "new" to the optimizer, so after the rebuild it stepped
    the whole body too (165 -> 565 parameters in the report's case), nothing said. Only a
    name new to the model joins; a parameter from outside the model stays."""
    from accelopt.your_loop import repoint_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([*model[1].parameters(), temperature], lr=0.1)
    before = dict(model.named_parameters())
    model[0].weight = torch.nn.Parameter(torch.zeros(3, 4))  # "pruned": a new Parameter
    model[0].extra = torch.nn.Parameter(torch.zeros(2))      # a name new to the model
    repoint_optimizer(opt, before, dict(model.named_parameters()))
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert held == {id(model[1].weight), id(model[1].bias), id(temperature),
                    id(model[0].extra)}


def _pruned_mlp_loop(tmp_path: Path, overrides: list[str], *, through_ao: bool,
                     iterations: int = 12) -> tuple[accelopt.your_loop.Attached,
                                                   torch.optim.Optimizer, dict, torch.Tensor]:
    """An MLP whose SGD (with momentum) is made BEFORE attach prunes it, trained for
    ``iterations`` with ``ao.step(opt)`` or plain ``opt.step()``."""
    torch.manual_seed(0)
    x = torch.randn(64, 20)
    y = x[:, :5].argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="optimizer made before attach") if not any(
            "prune_at_iteration" in o for o in overrides) else contextlib.nullcontext():
        ao = accelopt.attach(model, ["+plugins=[gpu_kernels]",
                                     "plugins.gpu_kernels.prune_amount=0.5", *overrides],
                             example=(x, y), optimizer="sgd", lr=0.1, run_dir=tmp_path / "r")
    before = {n: p.detach().clone() for n, p in ao.model.named_parameters()}
    return ao, opt, before, _train_on_one_batch(ao, opt, x, y, iterations, through_ao=through_ao)


def test_an_optimizer_made_before_attach_is_repointed_by_ao_step(tmp_path):
    """Build-time pruning replaces the sliced layers' parameters; an optimizer made before
    attach went on stepping the dense ones, so 5 of the 6 parameters never changed while the
    row said "trained at the pruned size". ao.step now points it at the current ones."""
    ao, opt, before, _ = _pruned_mlp_loop(tmp_path, [], through_ao=True)
    ao.close()
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert held == {id(p) for p in ao.model.parameters()}
    changed = {n: not torch.equal(p, before[n]) for n, p in ao.model.named_parameters()}
    assert all(changed.values()), changed
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert any("pointed at the model's current ones" in w for w in report["warnings"])


def test_an_optimizer_made_before_attach_and_stepped_plainly_is_warned_about(tmp_path):
    """With opt.step() the loop never hands accelopt its optimizer: attach warns, and close()
    says that the replaced parameters never changed and how to fix the loop."""
    ao, _, before, _ = _pruned_mlp_loop(tmp_path, [], through_ao=False)
    ao.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert any("never changed in 12 iterations" in w and "ao.step(opt)" in w
               for w in report["warnings"]), report["warnings"]


def test_an_optimizer_made_after_attach_gets_no_stale_warning(tmp_path):
    """The documented order (optimizer over ao.model's parameters) trains every parameter:
    neither attach (nothing holds the replaced parameters) nor close() warns."""
    import warnings

    torch.manual_seed(0)
    x, y = torch.randn(32, 20), torch.randint(5, (32,))
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ao = accelopt.attach(model, ["+plugins=[gpu_kernels]",
                                     "plugins.gpu_kernels.prune_amount=0.5"],
                             example=(x, y), run_dir=tmp_path / "r")
    opt = torch.optim.SGD(ao.model.parameters(), lr=0.1)
    for _ in ao.loop(range(3)):
        loss = torch.nn.functional.cross_entropy(ao.model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ao.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert not any("replaced" in w for w in report["warnings"]), report["warnings"]


def test_pruning_after_n_iterations_in_a_loop_carries_the_momentum(tmp_path):
    """gpu_kernels' README says nothing is dropped at a pruning after N iterations; under
    attach the row said "state of 0 sliced params carried": ao.step repointed the optimizer
    without offering it to accelopt_optimizer_build, so every sliced momentum restarted."""
    ao, opt, _, _ = _pruned_mlp_loop(tmp_path, ["plugins.gpu_kernels.prune_at_iteration=4"],
                                     through_ao=True, iterations=4)
    rows = ao.close()
    (row,) = [r for r in rows if r.plugin == "gpu_kernels"]
    assert "state of 5 sliced params carried" in row.summary, row.summary
    first = ao.model[0].weight
    assert first.shape == (16, 20) and opt.state[first]["momentum_buffer"].shape == (16, 20)
    assert torch.count_nonzero(opt.state[first]["momentum_buffer"]) > 0
