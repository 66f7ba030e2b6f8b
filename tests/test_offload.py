"""offload (vDNN): gradients bitwise identical on real zoo models, parameters never offloaded,
policies, prefetch ahead of need, feature maps released from the device, CPU accounting."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from accelopt_plugins.offload import PLUGIN
from accelopt_plugins.offload.engine import OffloadEngine, dense_layout, install_on
from torch import nn

from accelopt.errors import ConfigError
from accelopt.workloads import build_model

pytestmark = pytest.mark.timeout(60)

# (input shape per sample, vocab size, batch)
ZOO = {
    "mlp": ((1, 8, 8), None, 16),
    "cnn": ((1, 8, 8), None, 8),
    "resnet": ((3, 16, 16), None, 4),
    "inception": ((3, 16, 16), None, 4),
    "lstm": ((12,), 50, 4),
    "transformer": ((12,), 50, 4),
}


def zoo_model(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    shape, vocab, batch = ZOO[name]
    torch.manual_seed(0)
    model = build_model(name, input_shape=shape, num_classes=10, vocab_size=vocab, width=8)
    gen = torch.Generator().manual_seed(1)
    if vocab:
        x = torch.randint(0, vocab, (batch, *shape), generator=gen)
    else:
        x = torch.randn((batch, *shape), generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return model, x, y


def train_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 2):
    """A few SGD steps (so BatchNorm statistics and weights move); the last step's grads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["all", "conv", "size"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_gradients_are_bitwise_identical_on_zoo_models(name, policy):
    model, x, y = zoo_model(name)
    plain = copy.deepcopy(model)
    engine = OffloadEngine(policy=policy, min_bytes=1024)
    install_on(model, engine)
    got, want = train_grads(model, x, y), train_grads(plain, x, y)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    engine.close_pass()
    s = engine.totals.stats
    assert engine.totals.passes == 2
    if policy == "all":
        assert s.offloaded_bytes > 0 and s.resident_bytes == 0
    if policy == "conv" and name in ("mlp", "lstm", "transformer"):
        assert s.offloaded_bytes == 0 and s.resident_bytes > 0


def test_parameters_are_never_offloaded():
    model, x, y = zoo_model("mlp")
    engine = OffloadEngine(policy="all")
    install_on(model, engine)
    handles = []
    pack = engine.pack

    def spy(t):
        out = pack(t)
        handles.append((t, out))
        return out

    engine.pack = spy  # type: ignore[method-assign]
    nn.functional.cross_entropy(model(x), y).backward()
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_params = [out for t, out in handles if t.untyped_storage().data_ptr() in param_ptrs]
    # Linear saves its weight (and addmm the transposed view weight.t())
    assert saved_params, "the mlp's linear layers save their weights"
    assert all(isinstance(out, torch.Tensor) for out in saved_params)
    assert engine.current.param_bytes == sum(o.numel() * o.element_size() for o in saved_params)
    offloaded = [out for t, out in handles if not isinstance(out, torch.Tensor)]
    assert offloaded and all(h.host.untyped_storage().data_ptr() not in param_ptrs
                             for h in offloaded)


def test_conv_policy_offloads_only_what_convolutions_save():
    model, x, y = zoo_model("cnn")  # three conv layers, BN, ReLU, pools, linear head
    engine = OffloadEngine(policy="conv")
    install_on(model, engine)
    nn.functional.cross_entropy(model(x), y).backward()
    s = engine.current
    assert s.offloaded_tensors == 3  # each convolution's input
    assert s.resident_bytes > 0


def test_size_policy_keeps_small_tensors_resident():
    engine = OffloadEngine(policy="size", min_bytes=4096)
    small, large = torch.randn(100), torch.randn(2000)
    assert engine.pack(small) is small
    handle = engine.pack(large)
    assert not isinstance(handle, torch.Tensor)
    assert torch.equal(engine.unpack(handle), large)
    assert engine.current.resident_bytes == 400 and engine.current.offloaded_bytes == 8000


def test_layouts_that_cannot_be_copied_exactly_stay_resident():
    base = torch.randn(4, 1)
    expanded = base.expand(4, 8)  # stride 0: overlapping memory
    assert not dense_layout(expanded)
    assert dense_layout(torch.randn(3, 4).t()) and dense_layout(torch.randn(2, 3, 4, 5)[:, :, :, :])
    assert not dense_layout(torch.randn(4, 6)[:, ::2])
    engine = OffloadEngine(policy="all")
    assert engine.pack(expanded) is expanded
    t = torch.randn(3, 4).t()
    out = engine.unpack(engine.pack(t))
    assert torch.equal(out, t) and out.stride() == t.stride()


def deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_backward_prefetches_ahead_of_need(ahead):
    model = deep_mlp()
    engine = OffloadEngine(policy="all", prefetch_layers=ahead)
    install_on(model, engine)
    model(torch.randn(8, 32)).sum().backward()
    s = engine.current
    unpacks = s.prefetched + s.fetched_on_demand
    assert unpacks == s.offloaded_tensors == 7  # 6 layer inputs + the last Tanh output
    if ahead == 0:  # save_on_cpu behaviour: every unpack copies on demand
        assert s.prefetched == 0
    else:  # vDNN: every feature map is back before backward reaches its layer
        assert s.fetched_on_demand == 0 and s.prefetched == unpacks


def test_feature_maps_leave_the_device_during_forward():
    """The autograd graph holds the host copy, not the layer output: after forward the
    output of layer 1 is freed with offloading and kept alive without it."""

    def hidden_alive(model: nn.Module) -> bool:
        refs: list[weakref.ref[torch.Tensor]] = []
        hook = model[1].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
        loss = model(torch.randn(8, 32)).sum()
        gc.collect()
        alive = refs[0]() is not None
        hook.remove()
        loss.backward()
        return alive

    assert hidden_alive(deep_mlp())
    offloaded = deep_mlp()
    install_on(offloaded, OffloadEngine(policy="all"))
    assert not hidden_alive(offloaded)


def test_plugin_in_a_real_run_reports_cpu_accounting(run_tiny):
    record = run_tiny(PLUGIN)
    rows = [r for r in record.plugin_rows if r.plugin == "offload"]
    assert len(rows) == 2  # one per training job of the tiny workload
    for row in rows:
        assert "offloaded to host" in row.summary
        assert "a CPU has no device memory to save" in row.summary
        assert row.metrics["offloaded_bytes_per_iteration"] > 0
        assert row.metrics["prefetch_hit_rate"] > 0.5
    assert all(j.status == "done" for j in record.jobs)


def test_a_job_nothing_was_offloaded_from_is_an_inert_row(run_tiny):
    """policy=conv on an MLP offloads nothing: its row said "0.00 MiB ... (0%)" without
    the inert mark, so run.compare credited it with the run-to-run difference."""
    from accelopt.types import INERT

    record = run_tiny(PLUGIN, overrides=["plugins.offload.policy=conv"])
    rows = {r.metrics.get("job"): r for r in record.plugin_rows if r.plugin == "offload"}
    assert rows["00-tiny-mlp"].metrics.get(INERT) == 1
    assert "nothing offloaded" in rows["00-tiny-mlp"].summary
    assert INERT not in rows["01-tiny-cnn"].metrics  # its convolutions' maps were offloaded


def test_plugin_layers_option_offloads_only_matching_layers(run_tiny):
    record = run_tiny(PLUGIN, overrides=["plugins.offload.layers='^features'"])
    rows = {r.metrics.get("job"): r for r in record.plugin_rows if r.plugin == "offload"}
    cnn = rows["01-tiny-cnn"]
    assert cnn.metrics["offloaded_bytes_per_iteration"] > 0
    assert "nothing to do" in rows["00-tiny-mlp"].summary  # the mlp has no 'features'


@pytest.mark.parametrize("override, key", [
    ("plugins.offload.policy=fast", "plugins.offload.policy"),
    ("plugins.offload.prefetch_layers=-1", "plugins.offload.prefetch_layers"),
    ("plugins.offload.layers='('", "plugins.offload.layers"),
    ("plugins.offload.min_kib=inf", "plugins.offload.min_kib"),  # raised in layer_build
    ("plugins.offload.min_kib=100", "plugins.offload.min_kib=100.0 has no effect with "
                                    "policy=all"),  # ignored in silence
])
def test_bad_options_are_one_line_errors(run_tiny, override, key):
    with pytest.raises(ConfigError) as info:
        run_tiny(PLUGIN, overrides=[override])
    message = str(info.value)
    assert key in message and "\n" not in message


@pytest.mark.timeout(120)
def test_offload_is_active_on_every_worker_of_an_allreduce_run(tmp_path):
    # cluster ranks build their model through accelopt_layer_build like a single-process
    # run, so the engine is installed on each worker and reports what it moved
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig, JobConfig
    from accelopt.drivers.cluster import run_cluster

    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="c", model="cnn", width=8, batch_size=8, iterations=3, seed=0))]
    cfg.cluster.mode = "allreduce"
    cfg.cluster.workers = 2
    cfg.cluster.timeout_s = 30
    cfg.plugins = {"offload": {"policy": "all"}}
    out = run_cluster(cfg, run_dir=tmp_path)
    rows = [r for r in out.plugin_rows if r.plugin == "offload"]
    assert rows, [r.plugin for r in out.plugin_rows]
    assert any("offloaded" in r.summary for r in rows), [r.summary for r in rows]
    assert len(out.results[0].losses) == 3


def test_offload_hooks_the_model_after_gpu_kernels_replaced_its_layers(run_tiny):
    from accelopt_plugins.gpu_kernels import PLUGIN as GPU_KERNELS

    from accelopt.plugin import Registry, resolve

    registry = Registry.discover()
    order = [s.name for s in resolve(["offload", "gpu_kernels"], registry)]
    assert order == ["gpu_kernels", "offload"]  # whatever the command-line order
    # gpu_kernels swaps every Linear for a TiledLinear at the whole-model offer; offload,
    # coming after, hooks those new leaves, so prefetch still serves the unpacks
    record = run_tiny(PLUGIN, GPU_KERNELS, overrides=["plugins.gpu_kernels.tiled_linear=tiled"])
    rows = {r.metrics.get("job"): r for r in record.plugin_rows if r.plugin == "offload"}
    assert rows["00-tiny-mlp"].metrics["prefetch_hit_rate"] > 0.5
    assert rows["00-tiny-mlp"].metrics["offloaded_bytes_per_iteration"] > 0
