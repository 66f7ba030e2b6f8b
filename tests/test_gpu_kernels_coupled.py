"""gpu_kernels coupled-channel pruning: residual groups (ResNet-18-like), depthwise-separable
blocks (MobileNet-like), HF GPT-2/BERT feed-forward blocks and attention heads, and pruning
after N iterations of a run (optimizer rebuilt over exactly the new parameters).

Correctness is checked without trusting the planner: pruning nothing through the group path
must reproduce the outputs exactly, and channels/heads made dead by hand (zero weights) must
prune away without changing the function."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from accelopt_plugins.gpu_kernels import PLUGIN
from accelopt_plugins.gpu_kernels import plugin as gk
from accelopt_plugins.gpu_kernels.pruning import (
    count_flops,
    count_params,
    node_prune,
    plan_model,
    prune_channels,
    record_lineage,
    slice_like,
)
from torch import fx, nn

from accelopt import PluginSpec, hookimpl
from accelopt.errors import ConfigError
from accelopt.workloads import MODEL_NAMES, build_model

# --------------------------------------------------------------------------------------------
# models (torchvision is not a dependency: written here, small)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                         nn.BatchNorm2d(c_out))
                           if stride != 1 or c_in != c_out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18's layout (2-2-2-2 BasicBlocks, 20 convs + fc), at width ``w``."""

    def __init__(self, w: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        layers, c = [], w
        for i, mult in enumerate((1, 2, 4, 8)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(c, w * mult, stride),
                                        BasicBlock(w * mult, w * mult, 1)))
            c = w * mult
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class InvertedResidual(nn.Module):
    """MobileNet-v2 block: 1x1 expand, 3x3 depthwise, 1x1 project (+ residual)."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int = 2) -> None:
        super().__init__()
        hidden = c_in * expand
        self.expand = nn.Sequential(nn.Conv2d(c_in, hidden, 1, bias=False),
                                    nn.BatchNorm2d(hidden), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden,
                                          bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False),
                                     nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.dw(self.expand(x)))
        return x + out if self.residual else out


class MobileNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU6())
        self.sep = nn.Sequential(  # depthwise-separable: dw directly after the stem
            nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=True), nn.BatchNorm2d(8), nn.ReLU6(),
            nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.blocks = nn.Sequential(InvertedResidual(8, 8, 1), InvertedResidual(8, 16, 2),
                                    InvertedResidual(16, 16, 1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.sep(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=100,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg).eval()


def _with_stats(model: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics, eval mode: slicing errors then show in the output."""
    gen = torch.Generator().manual_seed(5)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=gen) * 2 - 1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model.eval()


def _out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = model(x)
    return y if isinstance(y, torch.Tensor) else y[0]


# --------------------------------------------------------------------------------------------
# groups


def test_resnet18_prunes_every_conv_in_residual_groups() -> None:
    torch.manual_seed(0)
    model, x = _with_stats(ResNet18()), torch.randn(2, 3, 16, 16)
    report = node_prune(model, 0.5)
    assert set(report.refused) == {"fc"}  # before: 13 of 21 refused
    assert len(report.pruned) == 20
    stream1 = set(report.groups["conv1"])
    assert stream1 == {"conv1", "layer1.0.conv2", "layer1.1.conv2"}
    assert {"layer2.0.conv2", "layer2.0.downsample.0", "layer2.1.conv2"} == set(
        report.groups["layer2.0.conv2"])
    assert _out(model, x).shape == (2, 5) and torch.isfinite(_out(model, x)).all()
    assert model.fc.in_features == 16 and model.layer4[1].bn2.num_features == 16


def test_a_compiled_model_is_pruned_through_the_module_it_compiles() -> None:
    """torch.fx cannot trace torch.compile's wrapper: every layer of a compiled model was
    refused as "not torch.fx-traceable" and nothing was pruned."""
    torch.manual_seed(0)
    inner, x = _with_stats(ResNet18()), torch.randn(2, 3, 16, 16)
    compiled = torch.compile(inner, backend="eager")  # eager: no C++ compiler needed
    compiled(x)  # compiled once at the dense shapes: the pruned ones must compile afresh
    report = node_prune(compiled, 0.5)
    assert set(report.refused) == {"fc"} and len(report.pruned) == 20  # as uncompiled
    assert inner.fc.in_features == 16
    out = compiled(x)
    assert out.shape == (2, 5) and torch.equal(out, inner(x))


def test_mobilenet_depthwise_convs_follow_their_producers() -> None:
    torch.manual_seed(0)
    model, x = _with_stats(MobileNet()), torch.randn(2, 3, 16, 16)
    report = node_prune(model, 0.5)
    assert set(report.refused) == {"fc"}
    dw = model.blocks[1].dw[0]
    assert dw.groups == dw.in_channels == dw.out_channels == 8  # hidden 16 -> 8
    assert report.pruned["sep.0"] == (8, 4)  # the depthwise after the stem
    assert report.groups["stem.0"] == ("stem.0",)  # its depthwise consumer moves with it
    # the separable block's projection and block 0's projection write one residual stream
    assert set(report.groups["sep.3"]) == {"sep.3", "blocks.0.project.0"}
    out = _out(model, x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()


def _group_keep(model: nn.Module, fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """Random kept indices, one set per group (given for one member of each)."""
    gen = torch.Generator().manual_seed(seed)
    keep: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for plan in plan_model(model):
        if plan.refused or plan.group in seen:
            continue
        seen.add(plan.group)
        k = max(1, int(plan.channels * fraction))
        keep[plan.path] = torch.randperm(plan.channels, generator=gen)[:k].sort().values
    return keep


@pytest.mark.parametrize("make", [ResNet18, MobileNet, gpt2, bert])
def test_pruning_nothing_through_the_group_path_is_exact(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = make()
    model = _with_stats(model) if isinstance(model, (ResNet18, MobileNet)) else model
    x = (torch.randn(2, 3, 16, 16) if isinstance(model, (ResNet18, MobileNet))
         else torch.randint(100, (2, 12)))
    reference = _out(model, x)
    full = {p.path: torch.arange(p.channels) for p in plan_model(model) if not p.refused}
    assert full
    report = prune_channels(model, full)
    assert report.params_after == report.params_before
    assert torch.equal(_out(model, x), reference)


def _dead_channels(model: nn.Module, keep: dict[str, torch.Tensor]) -> None:
    """Zero the dropped channels' producer rows and make every BatchNorm and depthwise conv
    the zeros pass through output zero again, following the fx graph (not the planner)."""
    modules = dict(model.named_modules())
    graph = fx.symbolic_trace(model).graph
    groups = {p.path: p.group for p in plan_model(model)}
    by_group = {groups[p]: idx for p, idx in keep.items()}
    dead_of: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            mod = modules[str(node.target)]
            group = groups.get(str(node.target))
            if group in by_group:  # a producer of a pruned group
                dead = torch.ones(mod.weight.shape[0], dtype=torch.bool)
                dead[by_group[group]] = False
                mod.weight[dead] = 0
                if mod.bias is not None:
                    mod.bias[dead] = 0
                dead_of[node.name] = dead
            elif isinstance(mod, nn.BatchNorm2d | nn.Conv2d) and node.args[0].name in dead_of:
                dead = dead_of[node.args[0].name]  # BN or depthwise right after dead channels
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_mean[dead], mod.bias[dead] = 0, 0
                elif mod.bias is not None:
                    mod.bias[dead] = 0
                dead_of[node.name] = dead
            elif isinstance(mod, nn.ReLU6 | nn.ReLU) and node.args[0].name in dead_of:
                dead_of[node.name] = dead_of[node.args[0].name]


@pytest.mark.parametrize("make", [ResNet18, MobileNet])
def test_dead_channels_prune_away_without_changing_the_function(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model, x = _with_stats(make()), torch.randn(2, 3, 16, 16)
    keep = _group_keep(model, 0.5, seed=1)
    _dead_channels(model, keep)
    reference = _out(model, x)
    report = prune_channels(model, keep)
    assert report.params_after < report.params_before
    torch.testing.assert_close(_out(model, x), reference, rtol=1e-5, atol=1e-5)


def test_coupled_members_must_agree() -> None:
    model = ResNet18()
    with pytest.raises(ValueError, match="coupled"):
        prune_channels(model, {"conv1": torch.tensor([0, 1]), "layer1.0.conv2": torch.tensor([0, 2])})
    with pytest.raises(ValueError, match="model's outputs"):
        prune_channels(model, {"fc": torch.tensor([0])})


# --------------------------------------------------------------------------------------------
# HF models: Conv1D feed-forward blocks and attention heads by module rules


def test_gpt2_mlp_and_heads_prune_and_dead_heads_change_nothing() -> None:
    model, x = gpt2(), torch.randint(100, (2, 12))
    attn = model.transformer.h[0].attn
    with torch.no_grad():  # heads 1 and 3 output zeros: their v columns (c_attn's third part)
        for h in (1, 3):
            cols = slice(2 * 64 + h * 16, 2 * 64 + (h + 1) * 16)
            attn.c_attn.weight[:, cols] = 0
            attn.c_attn.bias[cols] = 0
    reference = _out(model, x)
    report = prune_channels(model, {"transformer.h.0.attn": torch.tensor([0, 2])})
    assert attn.num_heads == 2 and attn.split_size == 32 and attn.c_proj.weight.shape[0] == 32
    torch.testing.assert_close(_out(model, x), reference, rtol=1e-5, atol=1e-5)
    assert report.pruned == {"transformer.h.0.attn": (4, 2)}
    report = node_prune(model, 0.5)
    assert report.pruned["transformer.h.1.mlp.c_fc"] == (256, 128)
    assert model.transformer.h[1].mlp.c_fc.nf == 128 and model.transformer.h[1].mlp.c_proj.nx == 128
    assert "lm_head" in report.refused and "not torch.fx-traceable" in report.refused["lm_head"]
    out = _out(model, x)
    assert out.shape == (2, 12, 100) and torch.isfinite(out).all()


def test_the_pruning_probe_measures_gpt2_called_with_keywords() -> None:
    """An HF model in a run gets its batch as keywords (``input_ids=..., labels=...``,
    loss=model): the probe read only ``args[0]``, so the row had params but no FLOPs, no
    latency and no first-forward check of the pruned model."""
    model = gpt2()
    dense = copy.deepcopy(model)
    record = gk._JobRecord(prune=node_prune(model, 0.5))
    gk._PruneProbe(model, dense, record)
    ids = torch.randint(100, (2, 12))
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    probe = record.probe
    assert 0 < probe["flops_pruned"] < probe["flops_dense"], record.notes
    assert probe["latency_dense_ms"] > 0 and probe["latency_pruned_ms"] > 0


def test_bert_ffn_and_heads_prune() -> None:
    model, x = bert(), torch.randint(100, (2, 12))
    report = node_prune(model, 0.5)
    layer = model.encoder.layer[0]
    assert report.pruned["encoder.layer.0.intermediate.dense"] == (128, 64)
    assert report.pruned["encoder.layer.0.attention"] == (4, 2)
    assert layer.attention.self.num_attention_heads == 2
    assert layer.attention.self.all_head_size == 32 == layer.attention.output.dense.in_features
    out = _out(model, x)
    assert out.shape == (2, 12, 64) and torch.isfinite(out).all()


def vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg).eval()


def test_vit_heads_and_mlp_prune_and_dead_units_change_nothing() -> None:
    """HF ViT (q/k/v/o_proj attention, fc1/fc2 MLP): heads 1 and 3 output zeros (their v_proj
    rows) and half the MLP's hidden units are dead (fc1 rows and bias zero, GELU(0) = 0):
    pruning exactly those leaves the logits unchanged; the head count the model reads
    follows."""
    model, x = vit(), torch.randn(2, 3, 16, 16)
    layer = model.vit.layers[0] if hasattr(model.vit, "layers") else model.vit.encoder.layer[0]
    attn = layer.attention
    if not hasattr(attn, "q_proj"):
        pytest.skip("this transformers version's ViT has no q/k/v/o_proj attention")
    with torch.no_grad():
        for h in (1, 3):
            attn.v_proj.weight[h * 16:(h + 1) * 16] = 0
            attn.v_proj.bias[h * 16:(h + 1) * 16] = 0
        layer.mlp.fc1.weight[64:] = 0
        layer.mlp.fc1.bias[64:] = 0
    reference = _out(model, x)
    path = next(p for p, m in model.named_modules() if m is attn)
    mlp = next(p for p, m in model.named_modules() if m is layer.mlp.fc1)
    report = prune_channels(model, {path: torch.tensor([0, 2]), mlp: torch.arange(64)})
    assert attn.num_attention_heads == 2 and attn.q_proj.out_features == 32
    assert attn.o_proj.in_features == 32 and layer.mlp.fc2.in_features == 64
    torch.testing.assert_close(_out(model, x), reference, rtol=1e-5, atol=1e-5)
    assert report.pruned[path] == (4, 2)
    report = node_prune(model, 0.5)
    assert any(k.endswith("mlp.fc1") for k in report.pruned), report.pruned
    out = _out(model, x)
    assert out.shape == (2, 3) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_zoo_models_prune_more_and_still_train(name: str) -> None:
    torch.manual_seed(0)
    if name in ("lstm", "transformer"):
        model = build_model(name, input_shape=(12,), num_classes=4, vocab_size=32, width=16)
        x = torch.randint(32, (3, 12))
    else:
        model = build_model(name, input_shape=(1, 8, 8), num_classes=5, width=8)
        x = torch.randn(3, 1, 8, 8)
    flops = count_flops(model, x)
    report = node_prune(model, 0.5)
    model(x).sum().backward()
    expected_refused = {"mlp": 1, "cnn": 1, "resnet": 1, "inception": 1, "lstm": 2,
                        "transformer": 3}[name]
    assert len(report.refused) == expected_refused, report.refused
    if name != "lstm":
        assert count_flops(model, x) < flops


def test_lineage_maps_new_parameters_to_sliced_originals() -> None:
    torch.manual_seed(0)
    model = ResNet18()
    before = {id(p): p.detach().clone() for p in model.parameters()}
    originals = {id(p) for p in model.parameters()}
    with record_lineage() as lineage:
        node_prune(model, 0.5)
    conv = model.layer2[0].conv1.weight  # sliced on both dims
    orig, steps = lineage[conv]
    assert id(orig) in originals and len(steps) == 2
    assert torch.equal(slice_like(before[id(orig)], steps), conv.detach())


# --------------------------------------------------------------------------------------------
# pruning after N iterations in a run


class _Watch:
    """Test-only plugin: keeps each job's model and its latest optimizer."""

    def __init__(self, config: object) -> None:
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    @hookimpl
    def accelopt_job_built(self, run, job) -> None:  # type: ignore[no-untyped-def]
        self.models[job.job.job_id] = job.model

    @hookimpl
    def accelopt_optimizer_build(self, job, optimizer, parameters, previous):  # type: ignore[no-untyped-def]
        self.optimizers[job.job_id] = optimizer


@pytest.mark.timeout(60)
def test_prune_after_three_iterations_then_fine_tune(run_tiny) -> None:  # type: ignore[no-untyped-def]
    watch = _Watch(None)
    spec = PluginSpec(name="watch", factory=lambda _c: watch, after=("gpu_kernels",))
    record = run_tiny(PLUGIN, spec, overrides=[
        "+plugins=[gpu_kernels,watch]",
        "plugins.gpu_kernels.prune_amount=0.5", "plugins.gpu_kernels.prune_at_iteration=3",
        "workload.jobs.0.iterations=6", "workload.jobs.1.iterations=6",
        "workload.jobs.0.optimizer=adam"])
    assert [j.status for j in record.jobs] == ["done", "done"]
    rows = {r.metrics["job"]: r for r in record.plugin_rows if r.plugin == "gpu_kernels"}
    for job in record.jobs:
        jid = job.job.job_id
        row = rows[jid]
        assert "iteration 3" in row.summary and row.metrics["pruned_at_iteration"] == 3
        assert row.metrics["params_after"] < row.metrics["params_before"]
        assert row.metrics["flops_after"] < row.metrics["flops_before"]
        assert len(job.losses) == 6 and all(torch.isfinite(torch.tensor(job.losses)))
        model, opt = watch.models[jid], watch.optimizers[jid]
        held = [p for g in opt.param_groups for p in g["params"]]
        assert {id(p) for p in held} == {id(p) for p in model.parameters()}
        assert len(held) == len(list(model.parameters()))
        assert all(any(s is p for p in held) for s in opt.state)  # no stale state
        assert count_params(model) == row.metrics["params_after"]
    adam = watch.optimizers["00-tiny-mlp"]  # sliced state carried, not dropped
    assert all(adam.state[p]["exp_avg"].shape == p.shape for p in adam.state)
    assert len(adam.state) == len(list(watch.models["00-tiny-mlp"].parameters()))


@pytest.mark.timeout(60)
def test_taylor_pruning_at_an_iteration_uses_its_gradients(run_tiny) -> None:  # type: ignore[no-untyped-def]
    """The trial copy pruned first was a deepcopy, which drops .grad: taylor, documented
    for this mode, was always "skipped: ... needs gradients from a backward pass"."""
    record = run_tiny(PLUGIN, overrides=[
        "plugins.gpu_kernels.prune_amount=0.5", "plugins.gpu_kernels.prune_at_iteration=3",
        "plugins.gpu_kernels.prune_criterion=taylor", "workload.jobs.0.iterations=5",
        "workload.jobs.1.iterations=5"])
    rows = [r for r in record.plugin_rows if r.plugin == "gpu_kernels"]
    assert rows and all("skipped" not in r.summary for r in rows), [r.summary for r in rows]
    assert all(r.metrics["pruned_at_iteration"] == 3 and "taylor" in r.summary for r in rows)


def test_prune_at_iteration_refuses_cluster_modes(run_tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="cluster.mode=none"):
        run_tiny(PLUGIN, overrides=["plugins.gpu_kernels.prune_amount=0.5",
                                    "plugins.gpu_kernels.prune_at_iteration=3",
                                    "cluster.mode=ps"])
    with pytest.raises(ConfigError, match="prune_amount"):
        run_tiny(PLUGIN, overrides=["plugins.gpu_kernels.prune_at_iteration=3"])


def _pruning_job(prune_at: int = 3, plugin: bool = True):  # type: ignore[no-untyped-def]
    """A job with gpu_kernels pruning after ``prune_at`` iterations (Adam: its moments are
    sliced at the pruning, so they must come back from the checkpoint too)."""
    from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig
    from accelopt_plugins.gpu_kernels.plugin import GpuKernelsPlugin

    from accelopt.activation import PluginSet
    from accelopt.config import JobConfig
    from accelopt.job import Job, StepEvents

    spec = JobConfig(name="p", model="mlp", width=16, batch_size=8, iterations=6, seed=0,
                     optimizer="adam")
    kernels = GpuKernelsPlugin(GpuKernelsConfig(prune_amount=0.5, prune_at_iteration=prune_at))
    plugins = PluginSet.of([(PLUGIN, kernels)] if plugin else [])
    job = Job(spec, job_id="p", device=torch.device("cpu"), host=plugins.for_job("p"))
    return job, StepEvents(job.host), kernels


def _saved(state: dict) -> dict:  # type: ignore[type-arg]
    """``state`` as a checkpoint file gives it back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", [2, 3, 5])
def test_a_job_pruned_after_n_iterations_resumes_bitwise(stop: int) -> None:
    """A checkpoint written after the pruning holds pruned shapes: the plugin's state says
    which units each group kept, so the resume (which builds the job dense) prunes the same
    units before the weights and the optimizer's sliced moments load. Before the pruning
    (stop=2) the checkpoint is dense and the resumed run prunes at iteration 3 itself."""
    reference, events, _ = _pruning_job()
    while not reference.done:
        reference.step(events)
    first, events, _ = _pruning_job()
    for _ in range(stop):
        first.step(events)
    state = _saved(first.state_dict())
    assert ("gpu_kernels" in state["plugins"]) is (stop >= 3)
    resumed, events, kernels = _pruning_job()
    resumed.load_state_dict(state)
    resumed.restore_plugin_states()
    while not resumed.done:
        resumed.step(events)
    want, got = reference.state_dict(), resumed.state_dict()
    assert want["model"].keys() == got["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(value, got["model"][key]), key  # bitwise
    for index, moments in want["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, got["optimizer"]["state"][index][name]), (index, name)
    (row,) = kernels.accelopt_report_rows(run=None)
    assert row.metrics["pruned_at_iteration"] == 3
    assert row.metrics["params_after"] < row.metrics["params_before"]


def test_a_pruned_checkpoint_in_a_run_that_does_not_prune_late_is_one_line() -> None:
    from accelopt.errors import UserError

    first, events, _ = _pruning_job()
    for _ in range(4):
        first.step(events)
    state = _saved(first.state_dict())
    for job in (_pruning_job(prune_at=0)[0], _pruning_job(plugin=False)[0]):
        with pytest.raises(UserError) as info:
            job.load_state_dict(state, source="ck.pt")
            job.restore_plugin_states()
        assert "\n" not in str(info.value)
        assert "node-pruned at iteration 3" in str(info.value) or \
            "plugin 'gpu_kernels', which is not active" in str(info.value)
    # the plugin's state restored, the weights still do not fit: one line naming the file
    state["model"]["net.1.weight"] = state["model"]["net.1.weight"][:, :1]
    job = _pruning_job()[0]
    with pytest.raises(UserError, match="checkpoint ck.pt does not fit job 'p'") as info:
        job.load_state_dict(state, source="ck.pt")
        job.restore_plugin_states()
    assert "\n" not in str(info.value)


def test_taylor_weight_form_uses_the_gradients_the_model_holds() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():  # channels 0..2 disconnected from the loss: zero gradient
        model[2].weight[:, :3] = 0
    x, y = torch.randn(32, 4), torch.randint(2, (32,))
    nn.functional.cross_entropy(model(x), y).backward()
    report = node_prune(model, 0.5, criterion="taylor")
    assert report.pruned == {"0": (6, 3)}
    assert torch.count_nonzero(model[2].weight) == model[2].weight.numel()
