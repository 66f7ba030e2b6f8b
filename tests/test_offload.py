"""offload (vDNN): gradients bitwise identical on real zoo models, parameters never offloaded,
policies, prefetch ahead of need, feature maps released from the device, CPU accounting."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from accelopt_plugins.offload import PLUGIN
from accelopt_plugins.offload.engine import OffloadEngine, _Handle, dense_layout, install_on
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


def spy_pack(engine: OffloadEngine) -> list[tuple[torch.Tensor, object]]:
    """Every (saved tensor, what the engine's pack hook made of it), as the engine packs."""
    saves: list[tuple[torch.Tensor, object]] = []
    pack = engine.pack

    def spy(t):
        out = pack(t)
        saves.append((t, out))
        return out

    engine.pack = spy  # type: ignore[method-assign]
    return saves


def test_parameters_are_never_offloaded():
    model, x, y = zoo_model("mlp")
    engine = OffloadEngine(policy="all")
    install_on(model, engine)
    handles = spy_pack(engine)
    nn.functional.cross_entropy(model(x), y).backward()
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_params = [out for t, out in handles if t.untyped_storage().data_ptr() in param_ptrs]
    # Linear saves its weight (and addmm the transposed view weight.t())
    assert saved_params, "the mlp's linear layers save their weights"
    assert not any(isinstance(out, _Handle) for out in saved_params)
    # each parameter's storage once, however many views of it were saved
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t, _ in handles if t.untyped_storage().data_ptr() in param_ptrs}
    assert engine.current.param_bytes == sum(storages.values())
    offloaded = [out for t, out in handles if isinstance(out, _Handle)]
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
    kept = engine.pack(small)
    assert not isinstance(kept, _Handle) and engine.unpack(kept).data_ptr() == small.data_ptr()
    handle = engine.pack(large)
    assert isinstance(handle, _Handle)
    assert torch.equal(engine.unpack(handle), large)
    assert engine.current.resident_bytes == 400 and engine.current.offloaded_bytes == 8000


def test_layouts_that_cannot_be_copied_exactly_stay_resident():
    base = torch.randn(4, 1)
    expanded = base.expand(4, 8)  # stride 0: overlapping memory
    assert not dense_layout(expanded)
    assert dense_layout(torch.randn(3, 4).t()) and dense_layout(torch.randn(2, 3, 4, 5)[:, :, :, :])
    assert not dense_layout(torch.randn(4, 6)[:, ::2])
    engine = OffloadEngine(policy="all")
    kept = engine.pack(expanded)
    assert not isinstance(kept, _Handle) and engine.unpack(kept).data_ptr() == expanded.data_ptr()
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
    # one worker's bytes (its 4 of the batch's 8 rows), said so: not the job's
    assert all("figures per worker (each of the 2 workers training 4 of the batch's 8 rows)"
               in r.summary for r in rows), [r.summary for r in rows]
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


# -- policy=conv decides by class ------------------------------------------------------------


class StdConv2d(nn.Conv2d):
    """timm's weight-standardised convolution: a Conv2d subclass, so still a convolution."""


class Conv1D(nn.Module):
    """HF GPT-2's ``Conv1D``: despite its name, a linear layer (x @ W + b)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)


def autotuned_conv(cin: int, cout: int, kernel: int) -> nn.Module:
    """What gpu_kernels' conv_autotune puts in a convolution's place (forced to the direct
    algorithm: no timing in a test)."""
    from accelopt_plugins.gpu_kernels.autotune import AutotunedConv2d, ConvAutotuner

    conv = AutotunedConv2d.from_tuner(nn.Conv2d(cin, cout, kernel), ConvAutotuner())
    conv.override = "direct"
    return conv


@pytest.mark.parametrize("make", [nn.Conv2d, StdConv2d, autotuned_conv])
def test_conv_policy_recognises_convolutions_by_class_not_name(make):
    torch.manual_seed(0)
    model = nn.Sequential(make(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    engine = OffloadEngine(policy="conv")
    install_on(model, engine)
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()
    s = engine.current
    # the convolution's input, only: the Tanh output and the Linear input stay
    assert s.offloaded_tensors == 1 and s.offloaded_bytes == x.numel() * 4
    assert s.resident_bytes > 0


def test_conv_policy_leaves_a_linear_layer_named_conv1d_resident():
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(8, 8), nn.Tanh(), Conv1D(2, 8))
    engine = OffloadEngine(policy="conv")
    install_on(model, engine)
    model(torch.randn(4, 8)).sum().backward()
    assert engine.current.offloaded_tensors == 0 and engine.current.resident_bytes > 0


@pytest.mark.timeout(120)
def test_conv_policy_offloads_gpu_kernels_autotuned_convolutions(run_tiny):
    from accelopt_plugins.gpu_kernels import PLUGIN as GPU_KERNELS

    from accelopt.types import INERT

    record = run_tiny(PLUGIN, GPU_KERNELS, workload="single", overrides=[
        "workload.jobs.0.model=cnn", "workload.jobs.0.width=4", "workload.jobs.0.batch_size=4",
        "workload.jobs.0.iterations=2", "run.profile=false",
        "plugins.offload.policy=conv", "plugins.gpu_kernels.conv_autotune=true",
        "plugins.gpu_kernels.conv_cache=''", "plugins.gpu_kernels.autotune_reps=3"])
    kernels, offload = ([r for r in record.plugin_rows if r.plugin == name]
                        for name in ("gpu_kernels", "offload"))
    assert "autotuned 3 convs" in kernels[0].summary
    # it read "nothing offloaded, so this job ran as without the plugin"
    assert INERT not in offload[0].metrics, offload[0].summary
    assert offload[0].metrics["offloaded_bytes_per_iteration"] > 0


# -- counting: the memory behind the saved tensors -------------------------------------------


class Masked(nn.Module):
    """A Linear whose output is multiplied by an expanded 1 KiB buffer (mul saves the
    expanded view: 64 KiB of elements, 1 KiB of memory), then a ReLU feeding the next
    Linear (one tensor saved by both), and a weight used twice (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 256)
        self.register_buffer("mask", torch.rand(1, 256))
        self.act = nn.ReLU()
        self.out = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x) * self.mask.expand(64, 256))
        return self.out(self.out(h))


def distinct_saved(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Independent count: (non-parameter, parameter) bytes of the distinct storages the
    forward saves for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return (sum(n for p, n in seen.items() if p not in params),
            sum(n for p, n in seen.items() if p in params))


def test_resident_bytes_are_the_storages_a_saved_tensor_keeps():
    """Each kept storage once, at its size: the ReLU output saved twice and the expanded
    1 KiB mask counted 2x and 64x before (this model's resident figure was 3x too big)."""
    torch.manual_seed(0)
    model, x = Masked(), torch.randn(64, 16)
    want_resident, want_params = distinct_saved(model, x)
    engine = OffloadEngine(policy="size", min_bytes=2**40)  # keeps everything resident
    install_on(model, engine)
    model(x).sum().backward()
    s = engine.current
    assert s.offloaded_bytes == 0
    assert s.resident_bytes == want_resident
    assert s.param_bytes == want_params  # out.weight, saved by two calls, once


def test_saves_outside_the_offloaded_layers_are_counted_as_resident():
    """With only some layers installed the others' saved maps stay on the device: the
    offloaded share is of the whole model's (it read 100% before: they were never seen)."""
    model = deep_mlp()
    engine = OffloadEngine(policy="all")
    install_on(model, engine, paths=["0"])
    x = torch.randn(8, 32)
    model(x).sum().backward()
    s = engine.current
    want_resident, _ = distinct_saved(deep_mlp(), x)
    assert s.offloaded_tensors == 1  # layer 0's input (no other layer saves it)
    assert s.offloaded_bytes + s.resident_bytes == want_resident
    assert s.resident_bytes > s.offloaded_bytes


def test_plugin_row_with_layers_reports_the_share_of_the_whole_model(run_tiny):
    record = run_tiny(PLUGIN, overrides=["plugins.offload.layers='^features.0'"])
    rows = {r.metrics.get("job"): r for r in record.plugin_rows if r.plugin == "offload"}
    cnn = rows["01-tiny-cnn"]
    assert 0 < cnn.metrics["offloaded_fraction"] < 1, cnn.summary
    assert cnn.metrics["resident_bytes_per_iteration"] > 0
    assert "the other layers included" in cnn.summary


# -- per iteration, not per forward pass ------------------------------------------------------


def attached_offload_row(tmp_path, micro_batches: int, use_loop: bool = True):
    """A loop of one's own under ``accelopt.attach``: 3 iterations of a 32-row batch, in
    ``micro_batches`` forward/backward passes each (gradient accumulation)."""
    import accelopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    data, labels = torch.randn(96, 16), torch.randint(0, 4, (96,))
    ao = accelopt.attach(model, ["+plugins=[offload]"], run_dir=tmp_path / f"m{micro_batches}")
    opt = torch.optim.SGD(ao.model.parameters(), lr=0.1)
    for i in (ao.loop(range(3)) if use_loop else range(3)):
        x, y = data[32 * i:32 * (i + 1)], labels[32 * i:32 * (i + 1)]
        opt.zero_grad()
        for part in torch.arange(32).chunk(micro_batches):
            nn.functional.cross_entropy(ao.model(x[part]), y[part]).backward()
        opt.step()
    rows = [r for r in ao.close() if r.plugin == "offload"]
    assert len(rows) == 1
    return rows[0]


def test_figures_are_per_iteration_under_gradient_accumulation(tmp_path):
    whole, halves = attached_offload_row(tmp_path, 1), attached_offload_row(tmp_path, 2)
    assert halves.metrics["iterations"] == 3 and halves.metrics["forward_passes"] == 6
    # two half-batches move what one whole batch moves (it read half before)
    assert (halves.metrics["offloaded_bytes_per_iteration"]
            == whole.metrics["offloaded_bytes_per_iteration"] > 0)
    assert "MiB/iteration" in halves.summary


def test_a_loop_without_iteration_boundaries_is_counted_per_forward_pass(tmp_path):
    row = attached_offload_row(tmp_path, 2, use_loop=False)
    assert "MiB/forward pass" in row.summary and "no iteration boundary" in row.summary
    assert row.metrics["forward_passes"] == 6 and "offloaded_bytes_per_iteration" not in row.metrics
    assert row.metrics["offloaded_bytes_per_forward_pass"] > 0


# -- in-place modification of a saved tensor ------------------------------------------------


class ModifiesSaved(nn.Module):
    """sigmoid saves its output; ``add_`` then changes it before backward reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.fc(x))
        y.add_(1)
        return self.fc2(y)


@pytest.mark.parametrize("policy, min_bytes", [("all", 0), ("size", 2**40)])
def test_a_saved_tensor_modified_in_place_raises_as_without_offload(policy, min_bytes):
    """Torch raises; the hooks switched its check off and backward ran on (with offload:
    on the values copied before the change; on CUDA, racing the copy)."""
    torch.manual_seed(0)
    plain = ModifiesSaved()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain(torch.randn(3, 4)).sum().backward()
    model = ModifiesSaved()
    install_on(model, OffloadEngine(policy=policy, min_bytes=min_bytes))
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        model(torch.randn(3, 4)).sum().backward()
    message = str(info.value)
    assert "shape [3, 4]" in message and "modified in place after being saved" in message
    assert "\n" not in message


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_a_loops_model_is_left_without_hooks_at_close_and_never_stacked(tmp_path):
    """The engine kept no handles: a loop's model (``accelopt.attach``) kept offloading
    after ``close()``, and attach/close/attach stacked a second engine's hooks on it. Its
    hooks come off at the run's end; an attach over one not closed is refused in one line."""
    import accelopt
    from accelopt.errors import UserError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    for k in range(2):
        ao = accelopt.attach(model, ["+plugins=[offload]"], run_dir=tmp_path / f"r{k}")
        assert _hooks(ao.model) > 0
        for _ in ao.loop(range(2)):
            torch.nn.functional.cross_entropy(ao.model(x), y).backward()
        (row,) = ao.close()
        assert "offloaded to host" in row.summary and _hooks(ao.model) == 0
    accelopt.attach(model, ["+plugins=[offload]"], run_dir=tmp_path / "open")
    with pytest.raises(UserError, match=r"offload: job '.*': the model still carries the "
                                        r"offloading hooks of an earlier run") as info:
        accelopt.attach(model, ["+plugins=[offload]"], run_dir=tmp_path / "again")
    assert "\n" not in str(info.value)
