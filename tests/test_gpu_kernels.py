"""gpu_kernels: node pruning, weight-pruning baseline, conv algorithms + autotuner + cache,
channels_last, the plugin end to end, and (in a subprocess) the numba.cuda kernels on the
CUDA simulator. No test depends on timings except through the synthetic noise-rule cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from accelopt_plugins.gpu_kernels import PLUGIN
from accelopt_plugins.gpu_kernels import autotune as at
from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig
from accelopt_plugins.gpu_kernels.conv_algos import (
    ALGORITHMS,
    AlgoConv2d,
    direct_tile,
    run_algorithm,
    supports,
    valid_algorithms,
    winograd_filter_transform,
    winograd_tile,
)
from accelopt_plugins.gpu_kernels.layout import ChannelsLast
from accelopt_plugins.gpu_kernels.pruning import (
    count_flops,
    count_params,
    node_prune,
    plan_model,
    prune_channels,
)
from accelopt_plugins.gpu_kernels.tiled import TiledLinear
from accelopt_plugins.gpu_kernels.weight_pruning import (
    CSRConv2d,
    CSRLinear,
    MaskedLinear,
    magnitude_mask,
    to_sparse,
    weight_prune,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

from accelopt.errors import ConfigError
from accelopt.workloads import MODEL_NAMES, build_model

REPO = Path(__file__).resolve().parents[1]


def zoo(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name in ("lstm", "transformer"):
        return (build_model(name, input_shape=(12,), num_classes=4, vocab_size=32, width=16),
                torch.randint(32, (3, 12)))
    return build_model(name, input_shape=(1, 8, 8), num_classes=5, width=8), torch.randn(3, 1, 8, 8)


# --------------------------------------------------------------------------------------------
# node pruning


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prune_every_zoo_model_keeps_it_runnable(name: str) -> None:
    model, x = zoo(name)
    before = count_params(model)
    report = node_prune(model, 0.5)
    out = model(x)
    out.sum().backward()
    assert out.shape[0] == x.shape[0]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(reason for reason in report.refused.values())
    if name == "lstm":  # nothing structurally prunable: every refusal says why
        assert report.pruned == {} and "lstm" in report.refused
    else:
        assert report.pruned and count_params(model) < before
        for after, kept in report.pruned.values():
            assert kept == after - after // 2


def test_residual_producers_are_pruned_as_groups_and_the_head_refused() -> None:
    model, _ = zoo("resnet")
    report = node_prune(model, 0.5)
    assert set(report.refused) == {"head"} and "model's outputs" in report.refused["head"]
    # everything writing the same residual stream is one group, pruned to the same channels
    assert set(report.groups["stem.0"]) == {"stem.0", "stages.0.conv2"}
    assert set(report.groups["stages.1.conv2"]) == {"stages.1.conv2", "stages.1.shortcut.0"}
    assert report.pruned["stem.0"] == report.pruned["stages.0.conv2"] == (8, 4)


class TiedHead(nn.Module):
    """A hidden layer feeding an output layer that shares the embedding's weight (as a
    language model's lm_head), plus an untied hidden pair that can be pruned."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.out = nn.Linear(16, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.b(torch.relu(self.a(self.emb(x).mean(1))))))


def test_a_group_holding_a_tied_weight_stays_dense_and_says_why() -> None:
    """Pruning sliced the tied output layer for one of its users: the tie was gone, the
    parameter count went up (3104 -> 3600) and the row still said "node-pruned"."""
    model = TiedHead()
    before = count_params(model)
    report = node_prune(model, 0.5)
    assert report.pruned == {"a": (32, 16)}  # the untied pair is pruned as before
    assert "out.weight is tied to emb.weight" in report.refused["b"]
    assert model.out.weight is model.emb.weight and model.emb.weight.shape == (10, 16)
    assert count_params(model) < before
    model(torch.randint(10, (3, 5))).sum().backward()


class FlatCat(nn.Module):
    """Two conv branches concatenated on channels, then flatten of 2x2 maps into a Linear:
    exercises concat offsets and the channel -> (channel*H*W) mapping."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 5, 3, padding=1)
        self.bn_a = nn.BatchNorm2d(5)
        self.b = nn.Conv2d(2, 3, 1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(8 * 4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.relu(self.bn_a(self.a(x))), self.b(x)], dim=1)
        return self.out(F.relu(self.fc(torch.flatten(self.pool(y), 1))))


def _kill_channels(model: nn.Module, keep: dict[str, torch.Tensor]) -> None:
    """Make the dropped channels output exactly zero (producer rows zero; a BatchNorm that
    directly follows gets running_mean 0 and beta 0), found without the code under test."""
    modules = dict(model.named_modules())
    graph = fx.symbolic_trace(model).graph
    with torch.no_grad():
        for node in graph.nodes:
            if node.op != "call_module" or str(node.target) not in keep:
                continue
            prod = modules[str(node.target)]
            n = prod.weight.shape[0]
            dead = torch.ones(n, dtype=torch.bool)
            dead[keep[str(node.target)]] = False
            prod.weight[dead] = 0
            if prod.bias is not None:
                prod.bias[dead] = 0
            for user in node.users:
                bn = modules.get(str(user.target))
                if isinstance(bn, nn.BatchNorm2d | nn.BatchNorm1d):
                    bn.running_mean[dead] = 0
                    bn.bias[dead] = 0


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet", "inception", "flatcat"])
def test_slicing_dead_channels_leaves_the_function_unchanged(name: str) -> None:
    """If the removed channels carry zeros, the physically pruned model must compute the
    same function: this catches any wrong index in the consumers (concat offsets, flatten
    blocks, BatchNorm slices)."""
    if name == "flatcat":
        torch.manual_seed(1)
        model, x = FlatCat(), torch.randn(4, 2, 4, 4)
    else:
        model, x = zoo(name)
    for m in model.modules():  # non-trivial running statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    gen = torch.Generator().manual_seed(3)
    keep: dict[str, torch.Tensor] = {}
    by_group: dict[str, torch.Tensor] = {}
    for plan in plan_model(model):
        if not plan.refused:  # coupled producers (one group) lose the same channels
            if plan.group not in by_group:
                k = max(1, plan.channels // 2)
                by_group[plan.group] = torch.randperm(plan.channels, generator=gen)[:k].sort().values
            keep[plan.path] = by_group[plan.group]
    assert keep
    model.eval()
    _kill_channels(model, keep)
    reference = model(x)
    prune_channels(model, keep)
    torch.testing.assert_close(model(x), reference, rtol=1e-5, atol=1e-5)


def test_pruning_whole_layer_or_bad_amount_is_refused() -> None:
    model, _ = zoo("mlp")
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"outside \[0, 1\)"):
            node_prune(model, bad)
    with pytest.raises(ValueError, match="100%"):
        node_prune(model, {"net.1": 1.0})
    with pytest.raises(ValueError, match="100%"):
        prune_channels(model, {"net.1": torch.tensor([], dtype=torch.long)})
    with pytest.raises(ValueError, match="cannot be pruned"):
        prune_channels(model, {"net.5": torch.tensor([0])})
    with pytest.raises(ConfigError, match="prune_amount"):
        GpuKernelsConfig(prune_amount=1.0).validate()


def test_iterative_rounds_reach_the_target_and_fine_tune_between_rounds() -> None:
    model, x = zoo("cnn")
    rounds: list[int] = []
    report = node_prune(model, 0.75, rounds=3, fine_tune=lambda m, r: rounds.append(r))
    assert rounds == [1, 2, 3]
    assert report.pruned["features.0.0"] == (8, 2)
    assert report.pruned["features.2.0"] == (16, 4)
    model(x).sum().backward()


def test_taylor_criterion_needs_data_and_keeps_informative_channels() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():  # channels 0..2 disconnected from the loss: zero Taylor score
        model[2].weight[:, :3] = 0
    x, y = torch.randn(32, 4), torch.randint(2, (32,))
    with pytest.raises(ValueError, match="calibration"):
        node_prune(model, 0.5, criterion="taylor")
    report = node_prune(model, 0.5, criterion="taylor", calibration=(x, y))
    assert report.pruned == {"0": (6, 3)}
    assert torch.count_nonzero(model[2].weight) == model[2].weight.numel()


class _SelfAttention(torch.nn.Module):
    def __init__(self, embed: int, heads: int) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(embed, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_flops_count_the_products_no_layer_holds(mode: str) -> None:
    """The FLOP bound of a pruned transformer must count attention's products and the fused
    input projection (no Linear module holds them), in eval mode without autograd too, where
    torch runs the layer as one fused kernel, and inside an inference job's forward (the
    plugin's probe runs there)."""
    batch, seq, embed = 2, 5, 8
    model = _SelfAttention(embed, heads=2).eval()
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
               "inference": torch.inference_mode}[mode]
    with context():
        x = torch.randn(batch, seq, embed)
        flops = count_flops(model, x)
    projections = 2 * batch * seq * embed * (3 * embed + embed)  # in_proj (q, k, v) + out_proj
    attention = 2 * 2 * batch * seq * seq * embed  # QK^T and AV over every head
    assert flops == projections + attention


def test_flops_shrink_with_pruning() -> None:
    model, x = zoo("inception")
    before = count_flops(model, x)
    node_prune(model, 0.5)
    assert count_flops(model, x) < 0.5 * before


# --------------------------------------------------------------------------------------------
# weight pruning baseline


def test_magnitude_mask_and_csr_execution_match_dense() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    mask = magnitude_mask(lin.weight, 0.75)
    assert int(mask.sum()) == 32
    assert lin.weight[mask].abs().min() >= lin.weight[~mask].abs().max()
    masked = MaskedLinear.from_dense(lin, 0.75)
    x = torch.randn(5, 16)
    csr = CSRLinear(masked.weight * masked.mask, masked.bias)
    torch.testing.assert_close(csr(x), masked(x), rtol=1e-5, atol=1e-6)
    assert abs(csr.density - 0.25) < 1e-9
    opt = torch.optim.SGD(masked.parameters(), lr=0.1)
    masked(x).sum().backward()
    opt.step()
    assert torch.count_nonzero(masked.weight[~masked.mask]) == 0  # pruned weights stay pruned


def test_csr_conv_and_whole_model_to_sparse() -> None:
    model, x = zoo("cnn")
    model.eval()
    assert weight_prune(model, 0.5, skip=("head",)) == 3
    reference = model(x)
    to_sparse(model)
    assert any(isinstance(m, CSRConv2d) for m in model.modules())
    torch.testing.assert_close(model(x), reference, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# convolution algorithms


@st.composite
def conv_cases(draw: st.DrawFn) -> tuple[nn.Conv2d, torch.Tensor]:
    groups = draw(st.sampled_from([1, 1, 2]))
    c = groups * draw(st.integers(1, 3))
    o = groups * draw(st.integers(1, 3))
    k = draw(st.sampled_from([1, 2, 3, 3, 5]))
    stride = draw(st.sampled_from([1, 1, 2]))
    dilation = draw(st.sampled_from([1, 1, 2]))
    padding = draw(st.integers(0, 2))
    span = dilation * (k - 1) + 1
    h = draw(st.integers(max(1, span - 2 * padding), 9))
    w = draw(st.integers(max(1, span - 2 * padding), 9))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    conv = nn.Conv2d(c, o, k, stride, padding, dilation, groups,
                     bias=draw(st.booleans())).double()
    x = torch.randn(draw(st.integers(1, 3)), c, h, w, dtype=torch.float64)
    if draw(st.booleans()):
        x = x.contiguous(memory_format=torch.channels_last)
    return conv, x


@settings(max_examples=40, deadline=None)
@given(conv_cases())
def test_every_valid_algorithm_matches_torch_conv2d(case: tuple[nn.Conv2d, torch.Tensor]) -> None:
    conv, x = case
    reference = conv(x)
    for algo in valid_algorithms(conv):
        torch.testing.assert_close(run_algorithm(algo, conv, x), reference, rtol=1e-9, atol=1e-9)


def test_gradients_match_direct_for_every_algorithm() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64, requires_grad=True)
    grads = {}
    for algo in valid_algorithms(conv):
        assert algo in ALGORITHMS
        conv.zero_grad()
        x.grad = None
        run_algorithm(algo, conv, x).pow(2).sum().backward()
        grads[algo] = (x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone())
    assert set(grads) == set(ALGORITHMS)
    for algo, g in grads.items():
        for a, b in zip(g, grads["direct"], strict=False):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=algo)


def test_validity_rules() -> None:
    assert supports("winograd", nn.Conv2d(2, 2, 3, padding=1))
    assert not supports("winograd", nn.Conv2d(2, 2, 3, stride=2))
    assert not supports("winograd", nn.Conv2d(2, 2, 5))
    assert not supports("winograd", nn.Conv2d(2, 2, 3, dilation=2))
    assert not supports("winograd", nn.Conv2d(2, 2, 3, groups=2))
    assert valid_algorithms(nn.Conv2d(2, 2, 3, padding="same")) == ["direct"]
    assert valid_algorithms(nn.Conv2d(2, 2, 3, padding_mode="reflect")) == ["direct"]
    with pytest.raises(ValueError, match="does not support"):
        AlgoConv2d.from_conv(nn.Conv2d(2, 2, 5), "winograd")


class Counted:
    """A number that counts the multiplications performed on it (additions are free)."""

    muls = 0

    def __init__(self, v: float) -> None:
        self.v = v

    def _val(self, o: object) -> float:
        return o.v if isinstance(o, Counted) else float(o)  # type: ignore[arg-type]

    def __mul__(self, o: object) -> Counted:
        Counted.muls += 1
        return Counted(self.v * self._val(o))

    __rmul__ = __mul__

    def __add__(self, o: object) -> Counted:
        return Counted(self.v + self._val(o))

    __radd__ = __add__

    def __neg__(self) -> Counted:
        return Counted(-self.v)


def test_winograd_uses_16_multiplies_per_2x2_tile_instead_of_36() -> None:
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(4, 4, generator=gen).tolist()
    g = torch.randn(3, 3, generator=gen).tolist()
    u = winograd_filter_transform(g)  # once per filter, amortised over all tiles
    Counted.muls = 0
    wino = winograd_tile([[Counted(v) for v in row] for row in d], u)
    wino_muls = Counted.muls
    Counted.muls = 0
    direct = direct_tile([[Counted(v) for v in row] for row in d], g)
    direct_muls = Counted.muls
    assert (wino_muls, direct_muls) == (16, 36)
    expected = F.conv2d(torch.tensor(d)[None, None], torch.tensor(g)[None, None])[0, 0]
    for i in range(2):
        for j in range(2):
            assert abs(wino[i][j].v - float(expected[i, j])) < 1e-4
            assert abs(direct[i][j].v - float(expected[i, j])) < 1e-4


# --------------------------------------------------------------------------------------------
# autotuner and cache


def test_noise_rule() -> None:
    base = [1.0, 1.01, 0.99, 1.02, 0.98]
    assert at.pick({"direct": base, "fft": [0.97, 0.98, 0.96, 0.99, 0.97]}, 0.05) == "direct"
    assert at.pick({"direct": base, "fft": [0.7, 0.71, 0.69, 0.7, 0.72]}, 0.05) == "fft"
    overlapping = [0.5, 0.5, 0.5, 1.2, 1.3]  # median faster, but the spread overlaps direct
    assert at.pick({"direct": base, "fft": overlapping}, 0.05) == "direct"
    assert at.pick({"direct": base, "fft": [0.7] * 5, "im2col": [0.6] * 5}, 0.05) == "im2col"


def _tiny_conv() -> tuple[nn.Conv2d, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Conv2d(2, 3, 3, padding=1), torch.randn(2, 2, 6, 6)


def test_autotuned_conv_is_the_same_layer_and_caches_on_disk(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cache.json"
    conv, x = _tiny_conv()
    tuner = at.ConvAutotuner(at.DecisionCache.load(path), reps=3)
    model = nn.Sequential(conv)
    assert at.autotune_model(model, tuner) == ["0"]
    tuned = model[0]
    assert tuned.weight is conv.weight and isinstance(tuned, at.AutotunedConv2d)
    torch.testing.assert_close(tuned(x), conv(x))
    (decision,) = tuner.decisions.values()
    assert set(decision.median_ms) == set(valid_algorithms(conv)) and not decision.from_cache
    data = json.loads(path.read_text())
    assert data["version"] == at.CACHE_VERSION and len(data["entries"]) == 1

    def no_timing(*_a: object, **_k: object) -> None:
        raise AssertionError("a cached decision must not be re-measured")

    monkeypatch.setattr(at, "time_callables", no_timing)
    again = at.ConvAutotuner(at.DecisionCache.load(path), reps=3)
    assert again.choose(conv, x).from_cache


def test_corrupted_cache_is_detected_rebuilt_and_warned(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    path.write_text('{"version": 1, "entries": {"k": ')  # truncated write
    with pytest.warns(at.CacheCorruptedWarning, match="corrupted"):
        cache = at.DecisionCache.load(path)
    conv, x = _tiny_conv()
    decision = at.ConvAutotuner(cache, reps=3).choose(conv, x)
    assert decision.algorithm in valid_algorithms(conv)
    assert len(json.loads(path.read_text())["entries"]) == 1  # rebuilt, valid JSON again
    # an entry naming an algorithm invalid for its layer is dropped and re-measured
    data = json.loads(path.read_text())
    key = next(iter(data["entries"]))
    data["entries"][key]["algorithm"] = "winograd_9000"
    path.write_text(json.dumps(data))
    with pytest.warns(at.CacheCorruptedWarning, match="not valid"):
        fresh = at.ConvAutotuner(at.DecisionCache.load(path), reps=3).choose(conv, x)
    assert not fresh.from_cache
    path.write_text("[1, 2, 3]")
    with pytest.warns(at.CacheCorruptedWarning):
        assert at.DecisionCache.load(path).entries == {}


# --------------------------------------------------------------------------------------------
# layout, tiled Linear fallback


def test_channels_last_on_converts_and_keeps_outputs() -> None:
    model, x = zoo("cnn")
    model.eval()
    reference = model(x)
    params = list(model.parameters())
    layout = ChannelsLast(model, "on")
    torch.testing.assert_close(model(x), reference, rtol=1e-5, atol=1e-6)
    assert layout.decision is not None and layout.decision.channels_last
    assert model.features[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=False))


def test_channels_last_auto_measures_and_skips_non_images() -> None:
    model, x = zoo("cnn")
    layout = ChannelsLast(model, "auto", reps=3)
    model(x).sum().backward()
    assert layout.decision is not None and layout.decision.reason == "measured"
    assert set(layout.decision.median_ms) == {"contiguous", "channels_last"}
    mlp, v = zoo("mlp")
    flat = ChannelsLast(mlp, "auto")
    mlp(v.flatten(1))
    assert flat.decision is not None and not flat.decision.channels_last


class _PixelValuesModel(nn.Module):
    """An image model called as HF's are: ``model(pixel_values=x)``, returning an output
    object whose ``logits`` the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)
        self.layouts: list[bool] = []

    def forward(self, *, pixel_values: torch.Tensor) -> SimpleNamespace:
        self.layouts.append(pixel_values.is_contiguous(memory_format=torch.channels_last))
        return SimpleNamespace(logits=self.head(torch.relu(self.conv(pixel_values)).mean((2, 3))))


def test_channels_last_and_the_conv_guard_read_keyword_image_inputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # reading only args[0], a model taking pixel_values= was "input is not 4-D" for the
    # layout and its tuned convs were never checked by the whole-model guard
    from accelopt_plugins.gpu_kernels.plugin import _ConvGuard, _JobRecord

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    forced = _PixelValuesModel()
    layout = ChannelsLast(forced, "on")
    forced(pixel_values=x)
    assert layout.decision is not None and layout.decision.channels_last
    assert forced.layouts == [True] and forced.conv.weight.is_contiguous(
        memory_format=torch.channels_last)
    measured = _PixelValuesModel()
    auto = ChannelsLast(measured, "auto", reps=3)
    measured(pixel_values=x).logits.sum().backward()
    assert auto.decision is not None and auto.decision.reason == "measured"

    guarded = _PixelValuesModel()
    at.autotune_model(guarded, at.ConvAutotuner(at.DecisionCache(None), reps=3))
    record = _JobRecord()
    _ConvGuard(guarded, reps=3, min_gain=0.05, record=record)
    conv = guarded.conv
    monkeypatch.setattr(conv, "_chosen", {"any": "im2col"}, raising=False)
    monkeypatch.setattr(at, "time_callables",
                        lambda fns, *a, **k: {n: [1.0, 1.0, 1.0] for n, f in fns.items() if f() or True})
    guarded(pixel_values=x)
    assert record.conv_guard in {"kept", "all direct"}, record.notes


class _Conv2dThen3d(nn.Module):
    """A 2-D conv feeding a Conv3d (a 5-D weight), as a volume or video head."""

    def __init__(self) -> None:
        super().__init__()
        self.c2 = nn.Conv2d(3, 4, 3, padding=1)
        self.c3d = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c3d(torch.relu(self.c2(x)).unsqueeze(1)).mean((2, 3, 4))


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_channels_last_leaves_5d_parameters_in_the_default_layout(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.to(memory_format=channels_last)`` raises on a Conv3d's 5-D weight ("required
    rank 4 tensor"): the hook failed the whole job, blamed on its inputs. Now the 4-D
    parameters convert (what torch converts in a 2-D conv model), the Conv3d keeps the
    default layout, and the reason names it."""
    import accelopt_plugins.gpu_kernels.layout as layout_mod

    monkeypatch.setattr(layout_mod, "pick", lambda *a, **k: "channels_last")  # no timing luck
    torch.manual_seed(0)
    model, x = _Conv2dThen3d(), torch.randn(2, 3, 6, 6)
    reference = model(x)
    params = list(model.parameters())
    layout = ChannelsLast(model, mode, reps=1)
    torch.testing.assert_close(model(x), reference, rtol=1e-5, atol=1e-6)
    model(x).sum().backward()
    d = layout.decision
    assert d is not None and d.channels_last
    assert "5-D parameters of c3d left in the default layout" in d.reason
    assert model.c2.weight.is_contiguous(memory_format=torch.channels_last)
    assert model.c2.weight.stride() != model.c2.weight.contiguous().stride()
    assert model.c3d.weight.is_contiguous()
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))


def test_tiled_linear_is_linear_off_gpu() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    tiled = TiledLinear.from_linear(lin, "register_blocked")
    x = torch.randn(4, 5)
    torch.testing.assert_close(tiled(x), lin(x))
    assert tiled.weight is lin.weight and tiled.last_path == "torch"
    with pytest.raises(ValueError, match="unknown kernel"):
        TiledLinear.from_linear(lin, "warp_tiled")


@pytest.mark.timeout(240)
def test_cuda_kernels_on_the_simulator_in_a_subprocess() -> None:
    """NUMBA_ENABLE_CUDASIM is read when numba's config is imported, so the simulator runs
    in its own interpreter and cannot leak into other tests. ``-n 0``: in that one
    interpreter, not in xdist workers of its own (the project's addopts say ``-n auto``:
    more interpreters to start, each importing numba and torch, for one short file)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         str(REPO / "tests" / "test_gpu_kernels_cudasim.py")],
        env=env, capture_output=True, text=True, timeout=230, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


# --------------------------------------------------------------------------------------------
# the plugin in a run


def test_plugin_in_a_run(run_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    record = run_tiny(PLUGIN, overrides=[
        "plugins.gpu_kernels.prune_amount=0.5",
        "plugins.gpu_kernels.conv_autotune=true",
        "plugins.gpu_kernels.autotune_reps=3",
        f"plugins.gpu_kernels.conv_cache={tmp_path / 'conv.json'}",
        "plugins.gpu_kernels.channels_last=auto",
    ])
    assert [j.status for j in record.jobs] == ["done", "done"]
    rows = {r.metrics["job"]: r for r in record.plugin_rows if r.plugin == "gpu_kernels"}
    mlp, cnn = rows["00-tiny-mlp"], rows["01-tiny-cnn"]
    assert "node-pruned 2 layers" in mlp.summary and "fresh weights" in mlp.summary
    assert mlp.metrics["params_after"] < mlp.metrics["params_before"]
    assert mlp.metrics["flops_pruned"] < mlp.metrics["flops_dense"]
    assert "autotuned 3 convs" in cnn.summary and "channels_last" in cnn.summary
    assert "whole-model guard" in cnn.summary
    assert "refused 1" in cnn.summary and (tmp_path / "conv.json").exists()


def test_plugin_with_nothing_enabled_says_so(run_tiny) -> None:  # type: ignore[no-untyped-def]
    record = run_tiny(PLUGIN)
    (row,) = [r for r in record.plugin_rows if r.plugin == "gpu_kernels"]
    assert "nothing enabled" in row.summary
    # marked inert, so run.compare calls a difference noise instead of crediting it as the
    # plugin's gain (it did: "measured gain ... 1.44x" for a plugin that did nothing)
    from accelopt.types import INERT

    assert row.metrics == {INERT: 1}


def test_noop_is_marked_inert_with_or_without_its_counts() -> None:
    from accelopt_plugins.noop.plugin import NoopPlugin
    from omegaconf import OmegaConf

    from accelopt.types import INERT

    for record in (True, False):
        (row,) = NoopPlugin(OmegaConf.create({"record": record})).accelopt_report_rows(run=None)
        assert row.metrics[INERT] == 1 and "changes nothing" in row.summary


def test_plugin_rejects_bad_config(run_tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="prune_amount"):
        run_tiny(PLUGIN, overrides=["plugins.gpu_kernels.prune_amount=1.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="channels_last"):
            run_tiny(PLUGIN, overrides=["plugins.gpu_kernels.channels_last=maybe"])


def test_timing_the_candidates_leaves_an_outer_plugins_saved_tensor_hooks_out() -> None:
    """offload's hooks, active around the model's forward, saw the tuner's candidate runs
    too: a CNN's first iteration copied 54.6 MB where each later one copied 0.7 MB."""
    conv = nn.Conv2d(3, 4, 3).train()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decision = at.ConvAutotuner(at.DecisionCache(None), reps=3).choose(conv, x)
    assert len(decision.median_ms) > 1 and packed == []


def test_whole_model_guard_reverts_choices_that_do_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = zoo("cnn")
    tuner = at.ConvAutotuner(at.DecisionCache(None), reps=3)
    at.autotune_model(model, tuner)
    model(x)
    convs = [m for m in model.modules() if isinstance(m, at.AutotunedConv2d)]
    for m in convs:  # pretend the per-layer rule picked im2col everywhere
        m._chosen = {k: "im2col" for k in m._chosen}
    fake = {"direct": [1.0, 1.0, 1.0], "tuned": [1.5, 1.5, 1.5]}
    monkeypatch.setattr(at, "time_callables", lambda *a, **k: fake)
    assert not at.verify_model(model, x, training=True, reps=3)
    assert all(m.override == "direct" for m in convs)
    fake.update(tuned=[0.5, 0.5, 0.5])
    assert at.verify_model(model, x, training=True, reps=3)
    assert all(m.override is None for m in convs)


@pytest.mark.timeout(120)
def test_pruning_in_a_parameter_server_run_agrees_on_every_rank(tmp_path) -> None:
    # server and workers each build the model through accelopt_layer_build; node pruning is
    # deterministic from the seeded weights, so every rank holds the same pruned shapes and
    # the parameter server trains the pruned model
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig, JobConfig
    from accelopt.drivers.cluster import run_cluster
    from accelopt.job import Job

    spec = JobConfig(name="m", model="mlp", width=32, batch_size=16, iterations=3, seed=0)
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(spec)]
    cfg.cluster.mode = "ps"
    cfg.cluster.workers = 2
    cfg.cluster.timeout_s = 30
    cfg.plugins = {"gpu_kernels": {"prune_amount": 0.5}}
    out = run_cluster(cfg, run_dir=tmp_path)
    dense = Job(spec, job_id="dense", device=torch.device("cpu")).model
    dense_sizes = {n: p.numel() for n, p in dense.named_parameters()}
    pruned = {n: v.numel() for n, v in out.state.items() if n in dense_sizes}
    assert pruned and sum(pruned.values()) < sum(dense_sizes.values())
    rows = [r.summary for r in out.plugin_rows if r.plugin == "gpu_kernels"]
    assert rows and any("prun" in r for r in rows), rows
    per_rank = {rank.rank: [r.metrics.get("params_after") for r in rank.plugin_rows
                            if r.plugin == "gpu_kernels"] for rank in out.ranks}
    assert len(per_rank) == 3, per_rank  # the server and both workers pruned, alike
    assert len({tuple(v) for v in per_rank.values()}) == 1 and None not in per_rank[0]
    assert len(out.results[0].losses) == 3


def test_a_frozen_layer_is_left_unpruned_and_said() -> None:
    """Fine-tuning a head over a frozen body: pruning cut the frozen 16-unit layer to 8 (and
    sliced the next layer's inputs), and the row said "trained at the pruned size" though
    nothing trained it. A group that slices a frozen layer stays dense, with the reason;
    the trainable layers beside it are pruned as before."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    report = node_prune(model, 0.5)
    assert torch.equal(model[0].weight, frozen) and model[2].in_features == 16
    assert report.refused["0"] == ("0.weight is frozen (requires_grad=False): a frozen layer "
                                   "is left as it is")
    assert report.pruned["2"] == (16, 8) and model[4].in_features == 8
