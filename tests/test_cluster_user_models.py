"""Models as users write them, in the cluster modes, against one process: parameters read
outside their module's forward (parameter server), complex parameters and float64 gradients
(all-reduce, with and without gradcomm), a plugin that replaces a parameter object.

The models (and the plugin) are defined here at module level: the ranks import this module
by its reference (``test_cluster_user_models:first_functional``). Tiny sizes, 2 workers,
a few iterations: each cluster run costs a few seconds, mostly process start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - as users write it
from omegaconf import OmegaConf
from torch import nn

from accelopt import OptimizerRebuild, PluginSpec, hookimpl
from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import RankFailed, run_cluster
from accelopt.drivers.cluster.ddp_hook import slot_size
from accelopt.errors import UserError
from accelopt.job import Job

pytestmark = pytest.mark.timeout(120)
ITERATIONS = 4
ATOL, RTOL = 1e-5, 1e-4  # docs/distributed.md: the modes agree with one process within 1e-5
HERE = "test_cluster_user_models"

# -- the models ----------------------------------------------------------------------------


class FirstFunctional(nn.Module):
    """Reads ``a``'s parameters without calling ``a``'s forward."""

    def __init__(self, input_shape, num_classes, h: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(input_shape[0], h)
        self.b = nn.Linear(h, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(F.linear(x, self.a.weight, self.a.bias)))


class BothFunctional(FirstFunctional):
    """Calls no parameter-owning module's forward at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(F.linear(x, self.a.weight, self.a.bias))
        return F.linear(h, self.b.weight, self.b.bias)


class ReadBeforeCall(FirstFunctional):
    """Reads ``b``'s weight before ``b``'s forward runs (its pre-hook fires too late)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        scale = self.b.weight.abs().mean()
        return self.b(h) * scale


class ComplexWeights(nn.Module):
    """A complex weight (DDP lays its gradient into the bucket as two floats per element)
    next to a real layer."""

    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(input_shape[0], 8, dtype=torch.cfloat) * 0.1)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((x.to(torch.cfloat) @ self.w).abs())


class Float64(nn.Module):
    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.a = nn.Linear(input_shape[0], 16, dtype=torch.float64)
        self.b = nn.Linear(16, num_classes, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x.double()))).float()


def first_functional(*, input_shape, num_classes) -> nn.Module:
    return FirstFunctional(input_shape, num_classes)


def both_functional(*, input_shape, num_classes) -> nn.Module:
    return BothFunctional(input_shape, num_classes)


def read_before_call(*, input_shape, num_classes) -> nn.Module:
    return ReadBeforeCall(input_shape, num_classes)


def complex_weights(*, input_shape, num_classes) -> nn.Module:
    return ComplexWeights(input_shape, num_classes)


def float64(*, input_shape, num_classes) -> nn.Module:
    return Float64(input_shape, num_classes)


# -- a plugin that replaces a parameter object -------------------------------------------


@dataclass
class ReplaceConfig:
    at: int = 1
    rebuild: bool = True


class ReplacesWeight:
    """After step ``at``: the first Linear's weight becomes a new Parameter of the same name,
    shape and values (an identity re-init), and the optimizer is asked to follow."""

    def __init__(self, config: ReplaceConfig) -> None:
        self.config = config
        self.model: nn.Module | None = None

    @hookimpl
    def accelopt_layer_build(self, layer):
        if layer.path == "":
            self.model = layer.module

    @hookimpl
    def accelopt_after_step(self, context, stepped):
        if context.iteration != self.config.at or self.model is None:
            return None
        lin = next(m for m in self.model.modules() if isinstance(m, nn.Linear))
        lin.weight = nn.Parameter(lin.weight.detach().clone())
        return OptimizerRebuild("identity re-init") if self.config.rebuild else None


REPLACES = PluginSpec(name="replaces_weight", factory=ReplacesWeight, config=ReplaceConfig,
                      description="replaces a parameter object mid-run (test)")

# -- helpers --------------------------------------------------------------------------------


def make_cfg(model: str, mode: str, plugins: dict | None = None):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="m", model=f"{HERE}:{model}", dataset="synthetic_vectors", batch_size=16,
        iterations=ITERATIONS, seed=0))]
    cfg.cluster.mode = mode
    cfg.cluster.workers = 2
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 20
    cfg.run.profile = False
    if plugins:
        cfg.plugins = plugins
    return cfg


def one_process(cfg) -> tuple[Job, list[float]]:
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               cfg.workload.jobs[0]))
    job = Job(spec, job_id="single", device=torch.device("cpu"))
    return job, [job.step().loss for _ in range(ITERATIONS)]


def assert_like_one_process(cfg, tmp_path, atol: float = ATOL, rtol: float = RTOL):
    out = run_cluster(cfg, run_dir=tmp_path)
    job, losses = one_process(cfg)
    for name, param in job.model.named_parameters():
        torch.testing.assert_close(out.state[name], param.detach(), atol=atol, rtol=rtol)
    assert out.results[0].losses == pytest.approx(losses, abs=max(atol, 1e-5))
    return out


# -- parameter server: reads outside a module's forward ----------------------------------


@pytest.mark.parametrize("model", ["first_functional", "both_functional", "read_before_call"])
def test_ps_matches_one_process_when_forward_reads_parameters_outside_their_module(
        model, tmp_path):
    """The per-layer pre-hooks wait only when a module's forward runs: a parameter read
    without it (or before it) was read stale, or copied into while autograd held it
    ("modified by an inplace operation"). Now such layers are waited for first."""
    assert_like_one_process(make_cfg(model, "ps"), tmp_path)


# -- all-reduce: complex parameters, float64 gradients -----------------------------------


def test_a_complex_gradient_takes_two_elements_of_a_bucket():
    assert slot_size(torch.zeros(3, 4, dtype=torch.cfloat)) == 24
    assert slot_size(torch.zeros(3, 4)) == 12


@pytest.mark.parametrize("plugins", [None, {"gradcomm": {}}, {"gradcomm": {"dtype": "bf16"}}],
                         ids=["plain", "gradcomm", "gradcomm-bf16"])
def test_allreduce_reduces_complex_parameters_like_one_process(plugins, tmp_path):
    """A complex parameter's slot in a logical bucket was sized by its numel: the bucket's
    first iteration (cut into logical buckets) read half its gradient from the wrong place."""
    lossy = plugins is not None and "dtype" in plugins["gradcomm"]
    assert_like_one_process(make_cfg("complex_weights", "allreduce", plugins), tmp_path,
                            atol=1e-3 if lossy else ATOL, rtol=0 if lossy else RTOL)


def test_gradcomm_leaves_float64_gradients_float64_and_names_their_dtype(tmp_path):
    """At its default (dtype=fp32, dense) gradcomm is lossless: a float64 model's gradients
    went through float32 (3.9e-9 off one process; 2.8e-17 without the plugin) under a row
    saying 'fp32 dense all-reduce (no compression)'."""
    out = assert_like_one_process(make_cfg("float64", "allreduce", {"gradcomm": {}}),
                                  tmp_path, atol=1e-12, rtol=0)
    rows = [r.summary for r in out.plugin_rows if r.plugin == "gradcomm"]
    assert rows and all(row.startswith("fp64 dense all-reduce (no compression)")
                        for row in rows), rows


# -- a plugin replacing a parameter object ------------------------------------------------


def _run_replacing(tmp_path, mode: str, rebuild: bool = True) -> str:
    from accelopt.testing import run_workload

    jobs = (f"workload.jobs=[{{name: m, model: mlp, width: 16, batch_size: 8, "
            f"iterations: {ITERATIONS}}}]")
    with pytest.raises((RankFailed, UserError)) as info:
        run_workload([REPLACES], [jobs, f"cluster.mode={mode}", "cluster.timeout_s=20",
                                  f"plugins.replaces_weight.rebuild={rebuild}"],
                     tmp_path=tmp_path)
    return str(info.value)


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_parameter_replaced_by_a_plugin_in_a_cluster_run_is_refused_naming_both(
        mode, tmp_path):
    """Same name and shape, new object: the exchanges kept moving the old Parameter, so the
    layer silently stopped training under PS, and all-reduce blamed the loss and pointed at
    cluster.mode=ps."""
    line = _run_replacing(tmp_path, mode)
    assert "plugin 'replaces_weight' replaced parameter 'net.1.weight' by a new Parameter " \
           "object" in line, line
    assert "param.copy_(new)" in line and "cluster.mode=ps" not in line
    assert "\n" not in line


def test_allreduce_says_a_parameter_was_replaced_not_that_the_loss_misses_it(tmp_path):
    """Without an optimizer rebuild nothing is asked of the core: DDP then gets no gradient
    for the old Parameter, and the line says why."""
    line = _run_replacing(tmp_path, "allreduce", rebuild=False)
    assert "net.1.weight replaced by a new Parameter object" in line, line
    assert "cluster.mode=ps" not in line and "\n" not in line
