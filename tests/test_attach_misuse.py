"""``accelopt.attach`` when something goes wrong or the loop is not the simple one: a failed
attach leaves the model as it was, a pruning after N iterations reaches every optimizer and
a loop that accumulates gradients, the plugins see the gradients of the optimizer being
stepped, nothing of accelopt stays on the model after ``close()``, and misuse is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import accelopt
from accelopt import ConfigError, PluginSpec, Registry, UserError, hookimpl

pytestmark = pytest.mark.timeout(120)


def hooks_on(model: nn.Module) -> int:
    """The hooks of every kind on every module of ``model`` (forward, backward, state-dict)."""
    return sum(len(table) for m in model.modules() for key, table in vars(m).items()
               if "hooks" in key and isinstance(table, dict))


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_an_unwritable_run_dir_is_refused_before_the_model_is_touched(tmp_path):
    """The run_dir was made after the layers were offered: a FileNotFoundError traceback, the
    offload hooks left on the model, and the corrected retry refused ("the model still
    carries the offloading hooks of an earlier run")."""
    model = mlp()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match="give accelopt.attach a run_dir= you can write"):
        accelopt.attach(model, ["+plugins=[offload]"], run_dir=blocker / "r")
    assert hooks_on(model) == 0
    ao = accelopt.attach(model, ["+plugins=[offload]"], run_dir=tmp_path / "ok")
    ao.close()
    assert hooks_on(model) == 0


def test_an_attach_failing_after_the_layers_were_offered_leaves_the_model_as_it_was(tmp_path):
    """offload installed its hooks on layer 0, then slide refused the job (no lr=): the
    hooks stayed on the model and the retry with lr= was refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4096))
    layers = list(model)
    example = (torch.randn(16, 8), torch.randint(4096, (16,)))
    overrides = ["+plugins=[offload,slide]", "plugins.offload.layers='^0$'"]
    with pytest.raises(ConfigError, match="plugins.slide.lr"):
        accelopt.attach(model, overrides, example=example, optimizer="adam",
                        run_dir=tmp_path / "a")
    assert hooks_on(model) == 0 and list(model) == layers
    del layers  # the replaced layer's Parameters: held, they read as a stale optimizer's
    ao = accelopt.attach(model, overrides, example=example, optimizer="adam", lr=0.01,
                         run_dir=tmp_path / "b")
    ao.close()
    assert hooks_on(model) == 0


class _StartFails:
    def __init__(self, config: object = None) -> None:
        pass

    @hookimpl
    def accelopt_run_start(self, run):
        raise UserError("startfails: refused")


def test_an_attach_failing_at_run_start_puts_back_what_a_plugin_pruned(tmp_path):
    """Build-time pruning replaced the model's Parameters before a plugin's run_start
    failed: the loop got its model back pruned, its optimizer's tensors no longer in it."""
    reg = Registry.discover()
    reg.add(PluginSpec(name="startfails", factory=_StartFails, description="raises"))
    model = mlp()
    weights = [p for p in model.parameters()]
    with pytest.raises(UserError, match="startfails: refused"):
        accelopt.attach(model, ["+plugins=[gpu_kernels,startfails]",
                                "plugins.gpu_kernels.prune_amount=0.5"],
                        example=(torch.randn(4, 8), torch.randint(2, (4,))), registry=reg,
                        run_dir=tmp_path / "r")
    assert all(a is b for a, b in zip(model.parameters(), weights, strict=True))
    assert model[0].out_features == 8 and model[2].in_features == 8
    assert hooks_on(model) == 0
    assert model(torch.randn(3, 8)).shape == (3, 2)


def _late_pruned(tmp_path: Path, at: int, iterations: int, step_every: int = 1,
                 two_optimizers: bool = False) -> tuple:
    """Linear(16,64)-ReLU-Linear(64,64)-ReLU-Linear(64,4), pruned by half at ``at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randint(4, (32,))
    ao = accelopt.attach(model, ["+plugins=[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5",
                                 f"plugins.gpu_kernels.prune_at_iteration={at}"],
                         lr=0.1, run_dir=tmp_path / "r")
    m = ao.model
    if two_optimizers:
        opts = [torch.optim.SGD(m[0].parameters(), lr=0.1),
                torch.optim.SGD(list(m[2].parameters()) + list(m[4].parameters()), lr=0.1)]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1)]
    for i in ao.loop(range(iterations)):
        ao.backward(torch.nn.functional.cross_entropy(m(x), y) / step_every)
        if (i + 1) % step_every == 0:
            for opt in opts:
                ao.step(opt)
                opt.zero_grad()
    return ao, opts


def test_a_pruning_after_n_iterations_repoints_every_optimizer_the_loop_steps(tmp_path):
    """Only the optimizer whose ao.step the pruning followed was repointed: the head's
    went on holding 3 tensors no longer in the model, which never changed again."""
    ao, (body, head) = _late_pruned(tmp_path, at=2, iterations=4, two_optimizers=True)
    ao.close()
    in_model = {id(p) for p in ao.model.parameters()}
    for opt in (body, head):
        held = [p for g in opt.param_groups for p in g["params"]]
        assert all(id(p) in in_model for p in held), [tuple(p.shape) for p in held]
    assert ao.model[0].out_features < 64
    assert len([p for g in head.param_groups for p in g["params"]]) == 4


def test_a_pruning_after_n_iterations_happens_in_a_loop_accumulating_gradients(tmp_path):
    """ao.step every 2nd iteration never stepped at iteration 3: the model stayed dense and
    the row said "not reached: the job stopped first" after 8 iterations."""
    ao, _ = _late_pruned(tmp_path, at=3, iterations=8, step_every=2)
    rows = ao.close()
    (row,) = [r for r in rows if r.plugin == "gpu_kernels"]
    assert ao.model[0].out_features < 64, row.summary
    assert "at iteration 4 (prune_at_iteration=3: the first optimizer step at or after it)" \
        in row.summary, row.summary
    assert row.metrics["pruned_at_iteration"] == 4 and row.metrics["fine_tuned_iterations"] == 4


def test_after_close_the_model_carries_no_hook_of_a_pruning_never_reached(tmp_path):
    """gpu_kernels' input-capturing pre-hook stayed on the loop's model after close(),
    keeping its latest input alive."""
    ao, _ = _late_pruned(tmp_path, at=10, iterations=2)
    assert hooks_on(ao.model) > 0  # the capture, until the pruning or the run's end
    rows = ao.close()
    assert any("not reached" in r.summary for r in rows if r.plugin == "gpu_kernels")
    assert hooks_on(ao.model) == 0


def test_the_plugins_see_the_gradients_of_the_optimizer_being_stepped(tmp_path):
    """A GAN: the discriminator's step was clipped by a norm that held the generator's
    stale gradients, and the clip row counted 6 steps as 6 "iterations" of 3."""
    pytest.importorskip("accelopt_clip")
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Linear(4, 4), "D": nn.Linear(4, 1)})
    o_d = torch.optim.SGD(gan["D"].parameters(), lr=0.0)
    o_g = torch.optim.SGD(gan["G"].parameters(), lr=0.0)
    ao = accelopt.attach(gan, ["+plugins=[clip]", "plugins.clip.max_norm=0.1"],
                         run_dir=tmp_path / "r")
    for _ in ao.loop(range(3)):
        for p in gan["G"].parameters():
            p.grad = torch.full_like(p, 100.0)  # the generator's, stale at D's step
        for p in gan["D"].parameters():
            p.grad = torch.full_like(p, 1.0)
        ao.step(o_d)
        d_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten()
                                                     for p in gan["D"].parameters()]))
        torch.testing.assert_close(d_norm, torch.tensor(0.1))
        ao.step(o_g)
    rows = ao.close()
    (row,) = [r for r in rows if r.plugin == "clip"]
    assert "clipped 6 of 6 optimizer steps" in row.summary and row.metrics["steps"] == 6


def test_misuse_of_attach_and_its_calls_is_one_line(tmp_path):
    """Raw Python errors: a ValueError from float() for a per-sample loss, a TypeError for
    overrides=None, an AttributeError for ao.step("opt")."""
    with pytest.raises(ConfigError, match="takes a list of overrides, got NoneType"):
        accelopt.attach(mlp(), None, run_dir=tmp_path / "n")  # type: ignore[arg-type]
    model = mlp()
    ao = accelopt.attach(model, [], run_dir=tmp_path / "r")
    x, y = torch.randn(4, 8), torch.randint(2, (4,))
    with ao.iteration():
        per_sample = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with pytest.raises(UserError, match=r"shape \(4,\); reduce it first"):
            ao.backward(per_sample)
        with pytest.raises(UserError, match="ao.step\\(opt\\) takes your torch.optim.Optimizer, "
                                            "got str"):
            ao.step("opt")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="ao.optimizer\\(opt\\) takes your torch.optim"):
        ao.optimizer(model)  # type: ignore[arg-type]
    ao.close()
    assert json.loads((tmp_path / "r" / "report.json").read_text())["iterations"] == 1
