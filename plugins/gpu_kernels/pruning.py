"""Node (structured) pruning: remove whole neurons/channels and *physically* slice the layers.

Why physical slicing: ``torch.nn.utils.prune.ln_structured`` only multiplies by a mask, so the
layer does exactly the same dense work as before. Speed comes from the layer (and every layer
that reads its output: BatchNorm, the next Linear/Conv2d, through pooling, flatten and concat)
becoming genuinely smaller dense layers (Scalpel, Yu et al. ISCA 2017: node pruning keeps
dense hardware busy, weight pruning does not).

How: the model is traced with ``torch.fx`` (the zoo models are traceable by design) and,
for each Linear / Conv2d (groups=1) "producer", its output channel dimension is followed
through channel-preserving ops (activations, pooling, BatchNorm, flatten, ``torch.cat`` on
channels) to the layers that consume it. A producer whose channels reach anything that
cannot be sliced consistently (a residual ``add``, the model output, an LSTM, attention,
a view/reshape) is *refused* with the reason, never pruned wrongly. The feed-forward block
inside ``nn.TransformerEncoderLayer`` (linear1 -> activation -> linear2) is handled directly.

The original modules are modified in place (new, smaller ``nn.Parameter`` objects), so the
model keeps its class and forward; build the optimizer *after* pruning.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

Criterion = str  # "l1" | "l2" | "taylor"

_ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Hardswish, nn.Identity, nn.Dropout, nn.Dropout2d,
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
)
_ELEMENTWISE_FUNCTIONS: set[Any] = {
    F.relu, torch.relu, F.relu6, F.gelu, F.silu, torch.sigmoid, torch.tanh, F.leaky_relu,
    F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.dropout,
}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh", "contiguous", "relu_"}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


# --------------------------------------------------------------------------------------------
# Plans


@dataclass
class _Use:
    """Producer channel c occupies indices ``(base + c)*mult + [0, mult)`` of a consumer's
    input dimension: ``base`` is its channel offset in a concat, ``mult`` > 1 after a
    flatten of spatial positions (channel-major, as NCHW flattens)."""

    path: str
    kind: str  # "linear_in" | "conv_in" | "bn"
    base: int
    mult: int


@dataclass
class _Plan:
    path: str
    channels: int
    uses: list[_Use] = field(default_factory=list)
    refused: str | None = None


@dataclass
class PruneReport:
    """What one pruning pass did: per-layer channel counts and the refused layers' reasons."""

    pruned: dict[str, tuple[int, int]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    params_before: int = 0
    params_after: int = 0

    def summary(self) -> str:
        layers = ", ".join(f"{p or '<root>'} {a}->{b}" for p, (a, b) in self.pruned.items())
        return (
            f"node-pruned {len(self.pruned)} layers ({layers or 'none'}); params "
            f"{self.params_before} -> {self.params_after}; refused {len(self.refused)}"
        )


class _Refuse(Exception):
    """Internal: this producer cannot be pruned; the message says why."""


def _target(node: fx.Node, modules: Mapping[str, nn.Module]) -> nn.Module | None:
    return modules.get(str(node.target)) if node.op == "call_module" else None


def _is_producer(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return isinstance(module, nn.Conv2d) and module.groups == 1


def _channels_of(node: fx.Node, modules: Mapping[str, nn.Module]) -> int | None:
    """Size of the channel dimension of ``node``'s output when it can be known statically."""
    mod = _target(node, modules)
    if isinstance(mod, nn.Linear):
        return mod.out_features
    if isinstance(mod, nn.Conv2d):
        return mod.out_channels
    if isinstance(mod, _BATCHNORMS) or isinstance(mod, _ELEMENTWISE_MODULES):
        return _channels_of(node.args[0], modules) if isinstance(node.args[0], fx.Node) else None
    if node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
        return _channels_of(node.args[0], modules) if isinstance(node.args[0], fx.Node) else None
    if node.op == "call_function" and node.target in (torch.cat, torch.concat):
        if _cat_dim(node) != 1:
            return None
        sizes = [_channels_of(n, modules) for n in node.args[0]]  # type: ignore[union-attr]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[arg-type]
    return None


def _cat_dim(node: fx.Node) -> int:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return int(dim)  # type: ignore[arg-type]


def _flatten_start(node: fx.Node, mod: nn.Module | None) -> int | None:
    """start_dim of a flatten node (module, function or method), ``None`` if not a flatten."""
    if isinstance(mod, nn.Flatten):
        return mod.start_dim if mod.end_dim == -1 else -99
    if node.op == "call_function" and node.target is torch.flatten:
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        return int(start) if end == -1 else -99  # type: ignore[arg-type]
    if node.op == "call_method" and node.target == "flatten":
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        return int(start)  # type: ignore[arg-type]
    return None


def _plan_producer(
    node: fx.Node, path: str, modules: Mapping[str, nn.Module], calls: Mapping[str, int]
) -> _Plan:
    """Follow ``node``'s channels to every consumer; refuse on anything unsliceable."""
    producer = modules[path]
    channels = producer.out_features if isinstance(producer, nn.Linear) else producer.out_channels
    plan = _Plan(path=path, channels=int(channels))
    channel_dim_is_1 = isinstance(producer, nn.Conv2d)
    # work items: (node, base, width, flattened, channel_dim_is_1)
    work: list[tuple[fx.Node, int, int, bool, bool]] = [
        (node, 0, plan.channels, False, channel_dim_is_1)
    ]
    try:
        if calls.get(path, 0) != 1:
            raise _Refuse(f"module is called {calls.get(path, 0)} times (shared weights)")
        seen: set[tuple[str, int]] = set()
        while work:
            cur, base, width, flat, cdim1 = work.pop()
            if (cur.name, base) in seen:
                continue
            seen.add((cur.name, base))
            for user in cur.users:
                _follow(user, cur, base, width, flat, cdim1, plan, modules, calls, work)
    except _Refuse as why:
        plan.refused = str(why)
        plan.uses.clear()
    return plan


def _follow(
    user: fx.Node,
    cur: fx.Node,
    base: int,
    width: int,
    flat: bool,
    cdim1: bool,
    plan: _Plan,
    modules: Mapping[str, nn.Module],
    calls: Mapping[str, int],
    work: list[tuple[fx.Node, int, int, bool, bool]],
) -> None:
    mod = _target(user, modules)
    where = f"'{user.target}'" if user.op == "call_module" else f"node '{user.name}'"
    if user.op == "output":
        raise _Refuse("its outputs are the model's outputs (e.g. the classifier head)")
    if isinstance(mod, nn.Linear):
        if user.args[0] is not cur or cdim1:
            raise _Refuse(f"feeds Linear {where} along a non-feature dimension")
        if calls.get(str(user.target), 0) != 1:
            raise _Refuse(f"consumer {where} is called several times (shared weights)")
        if flat:
            if mod.in_features % width:
                raise _Refuse(f"cannot map flattened channels onto {where}")
            plan.uses.append(_Use(str(user.target), "linear_in", base, mod.in_features // width))
        else:
            if mod.in_features != width:
                raise _Refuse(f"channel count {width} != in_features of {where}")
            plan.uses.append(_Use(str(user.target), "linear_in", base, 1))
        return
    if isinstance(mod, nn.Conv2d):
        if mod.groups != 1:
            raise _Refuse(f"feeds grouped/depthwise Conv2d {where} (groups={mod.groups})")
        if flat or not cdim1 or user.args[0] is not cur or mod.in_channels != width:
            raise _Refuse(f"feeds Conv2d {where} with a channel layout that does not match")
        if calls.get(str(user.target), 0) != 1:
            raise _Refuse(f"consumer {where} is called several times (shared weights)")
        plan.uses.append(_Use(str(user.target), "conv_in", base, 1))
        return
    if isinstance(mod, _BATCHNORMS):
        if flat or mod.num_features != width:
            raise _Refuse(f"feeds BatchNorm {where} whose features do not match")
        plan.uses.append(_Use(str(user.target), "bn", base, 1))
        work.append((user, base, width, flat, cdim1))
        return
    if isinstance(mod, _ELEMENTWISE_MODULES):
        work.append((user, base, width, flat, cdim1))
        return
    start = _flatten_start(user, mod)
    if start is not None:
        if flat:
            work.append((user, base, width, flat, cdim1))
            return
        if start != 1 or not cdim1:
            raise _Refuse(f"flatten {where} does not flatten from the channel dimension")
        work.append((user, base, width, True, False))
        return
    if user.op == "call_function" and user.target in _ELEMENTWISE_FUNCTIONS:
        if user.args[0] is not cur:
            raise _Refuse(f"reaches {where} as a non-input argument")
        work.append((user, base, width, flat, cdim1))
        return
    if user.op == "call_method" and user.target in _ELEMENTWISE_METHODS:
        work.append((user, base, width, flat, cdim1))
        return
    if user.op == "call_function" and user.target in (torch.cat, torch.concat):
        if flat or not cdim1 or _cat_dim(user) != 1:
            raise _Refuse(f"concatenated by {where} along a dimension other than channels")
        inputs = list(user.args[0])  # type: ignore[arg-type]
        offset = 0
        for other in inputs:
            if other is cur:
                break
            size = _channels_of(other, modules)  # type: ignore[arg-type]
            if size is None:
                raise _Refuse(f"concat {where} has an input whose channel count is unknown")
            offset += size
        total = _channels_of(user, modules)
        if total is None or inputs.count(cur) != 1:
            raise _Refuse(f"concat {where} has inputs whose channel counts are unknown")
        work.append((user, base + offset, total, flat, cdim1))
        return
    if user.op == "call_function" and user.target in (operator.add, operator.iadd, torch.add,
                                                       operator.sub, operator.mul, torch.mul):
        others = [a for a in user.args if a is not cur]
        if any(isinstance(a, fx.Node) for a in others):
            raise _Refuse(
                f"merged with another tensor by {where} (residual connection): both operands "
                "would need the same channels removed; refused rather than mis-sliced"
            )
        work.append((user, base, width, flat, cdim1))
        return
    kind = type(mod).__name__ if mod is not None else f"{user.op} {getattr(user.target, '__name__', user.target)}"
    raise _Refuse(f"feeds {kind} {where}, which cannot be sliced")


def plan_model(model: nn.Module) -> list[_Plan]:
    """Trace ``model`` and plan every Linear/Conv2d producer (prunable or refused)."""
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception as exc:  # an untraceable model: nothing can be planned safely
        return [
            _Plan(path, 0, refused=f"model is not torch.fx-traceable ({type(exc).__name__})")
            for path, m in model.named_modules()
            if _is_producer(m) and not _inside_transformer(model, path)
        ]
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    plans = []
    for node in graph.nodes:
        mod = _target(node, modules)
        if mod is not None and isinstance(mod, (nn.Linear, nn.Conv2d)):
            if not _is_producer(mod):
                plans.append(_Plan(str(node.target), 0, refused="grouped/depthwise Conv2d"))
                continue
            plans.append(_plan_producer(node, str(node.target), modules, calls))
    # leaf modules fx does not enter (LSTM, attention): say why they are left alone
    for path, m in model.named_modules():
        if isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)):
            plans.append(_Plan(path, 0, refused=f"{type(m).__name__} gates interleave "
                               "hidden units in fused weights; recurrent layers are not pruned"))
        elif isinstance(m, nn.MultiheadAttention):
            plans.append(_Plan(path, 0, refused="attention heads are not pruned (fused "
                               "in_proj and head split); only the feed-forward block is"))
    return plans


def _inside_transformer(model: nn.Module, path: str) -> bool:
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return isinstance(dict(model.named_modules()).get(parent), nn.TransformerEncoderLayer)


# --------------------------------------------------------------------------------------------
# Importance


def channel_importance(
    module: nn.Module, criterion: Criterion, taylor: torch.Tensor | None = None
) -> torch.Tensor:
    """Score of each output neuron/channel of a Linear/Conv2d: the L1 or L2 norm of its
    weights (Li et al. 2017), or a precomputed first-order Taylor score (Molchanov et al.
    2017, ``|mean(activation * gradient)|``)."""
    if criterion == "taylor":
        if taylor is None:
            raise ValueError("criterion 'taylor' needs calibration data (inputs, targets)")
        return taylor
    w = module.weight.detach().flatten(1)
    if criterion == "l1":
        return w.abs().sum(1)
    if criterion == "l2":
        return w.pow(2).sum(1).sqrt()
    raise ValueError(f"unknown criterion {criterion!r}; use l1, l2 or taylor")


def taylor_scores(
    model: nn.Module,
    paths: list[str],
    calibration: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """First-order Taylor importance of every output channel of the modules at ``paths``:
    mean over the batch of |sum over positions of activation * dLoss/dactivation|."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    modules = dict(model.named_modules())
    outputs: dict[str, torch.Tensor] = {}

    def keep(path: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            outputs[path] = out
        return hook

    handles = [modules[p].register_forward_hook(keep(p)) for p in paths]
    was_training = model.training
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(model(calibration[0]), calibration[1]).backward()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    scores = {}
    for path, out in outputs.items():
        prod = (out * out.grad).detach()
        # channel dimension: 1 for conv maps, last for Linear outputs
        if isinstance(modules[path], nn.Conv2d):
            per = prod.flatten(2).sum(2)
        else:
            per = prod.reshape(-1, prod.shape[-1])
        scores[path] = per.abs().mean(0)
    model.zero_grad(set_to_none=True)
    return scores


# --------------------------------------------------------------------------------------------
# Slicing


def _set_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(value.clone(), requires_grad=old.requires_grad))
    else:
        module.register_buffer(name, value.clone())


def _slice_out(module: nn.Module, keep: torch.Tensor) -> None:
    _set_param(module, "weight", module.weight.data[keep])
    if getattr(module, "bias", None) is not None:
        _set_param(module, "bias", module.bias.data[keep])
    if isinstance(module, nn.Linear):
        module.out_features = int(keep.numel())
    else:
        module.out_channels = int(keep.numel())


def _slice_in(module: nn.Module, keep: torch.Tensor) -> None:
    _set_param(module, "weight", module.weight.data[:, keep])
    if isinstance(module, nn.Linear):
        module.in_features = int(keep.numel())
    else:
        module.in_channels = int(keep.numel())


def _slice_bn(module: nn.Module, keep: torch.Tensor) -> None:
    for name in ("weight", "bias"):
        if getattr(module, name, None) is not None:
            _set_param(module, name, getattr(module, name).data[keep])
    for name in ("running_mean", "running_var"):
        if getattr(module, name, None) is not None:
            _set_param(module, name, getattr(module, name).data[keep])
    module.num_features = int(keep.numel())


def _keep_count(n: int, amount: float) -> int:
    return n - int(math.floor(amount * n + 1e-9))


def _check_amount(amount: float, where: str) -> float:
    amount = float(amount)
    if not 0.0 <= amount < 1.0:
        raise ValueError(
            f"{where}: pruning amount {amount} is outside [0, 1); pruning 100% of a layer "
            "would remove it (and everything that reads it), so it is refused"
        )
    return amount


def prune_channels(model: nn.Module, keep: Mapping[str, torch.Tensor]) -> PruneReport:
    """Keep only the given output channels (sorted index tensors) of the producers at the
    mapping's paths, slicing every consumer. Paths that are refused raise ``ValueError``."""
    plans = {p.path: p for p in plan_model(model)}
    modules = dict(model.named_modules())
    report = PruneReport(params_before=count_params(model))
    in_masks: dict[tuple[str, str], torch.Tensor] = {}
    for path, idx in keep.items():
        plan = plans.get(path)
        if plan is None:
            raise ValueError(f"{path!r} is not a Linear/Conv2d layer of this model")
        if plan.refused:
            raise ValueError(f"layer {path!r} cannot be pruned: {plan.refused}")
        idx = torch.as_tensor(idx, dtype=torch.long).sort().values
        if idx.numel() == 0:
            raise ValueError(f"pruning 100% of layer {path!r} is refused: keep at least one")
        if idx.numel() > plan.channels or int(idx.max()) >= plan.channels or int(idx.min()) < 0:
            raise ValueError(f"keep indices for {path!r} out of range 0..{plan.channels - 1}")
        dropped = torch.ones(plan.channels, dtype=torch.bool)
        dropped[idx] = False
        for use in plan.uses:
            size = _input_size(modules[use.path], use.kind)
            mask = in_masks.setdefault((use.path, use.kind), torch.ones(size, dtype=torch.bool))
            for c in dropped.nonzero().flatten().tolist():
                start = (use.base + c) * use.mult
                mask[start:start + use.mult] = False
        _slice_out(modules[path], idx)
        report.pruned[path] = (plan.channels, int(idx.numel()))
    for (path, kind), mask in in_masks.items():
        kept = mask.nonzero().flatten()
        if kind == "bn":
            _slice_bn(modules[path], kept)
        else:
            _slice_in(modules[path], kept)
    report.params_after = count_params(model)
    return report


def _input_size(module: nn.Module, kind: str) -> int:
    if kind == "bn":
        return int(module.num_features)
    return int(module.in_features if isinstance(module, nn.Linear) else module.in_channels)


def prune_transformer_ffn(
    layer: nn.TransformerEncoderLayer, amount: float, criterion: Criterion = "l1"
) -> tuple[int, int]:
    """Remove hidden units of a Transformer encoder layer's feed-forward block (rows of
    linear1, columns of linear2): the one place inside attention blocks that slices cleanly."""
    lin1, lin2 = layer.linear1, layer.linear2
    n = lin1.out_features
    k = _keep_count(n, amount)
    scores = channel_importance(lin1, "l1" if criterion == "taylor" else criterion)
    idx = scores.topk(k).indices.sort().values
    _slice_out(lin1, idx)
    _slice_in(lin2, idx)
    return n, k


def node_prune(
    model: nn.Module,
    amount: float | Mapping[str, float],
    *,
    criterion: Criterion = "l1",
    rounds: int = 1,
    calibration: tuple[torch.Tensor, torch.Tensor] | None = None,
    fine_tune: Callable[[nn.Module, int], None] | None = None,
) -> PruneReport:
    """Prune ``amount`` of the neurons/channels of every prunable layer (or per-layer
    amounts by path), by importance, in ``rounds`` iterative rounds (equal ratio per round,
    ``fine_tune(model, round)`` called after each). Refused layers are listed with reasons.

    ``criterion``: ``l1``/``l2`` weight norms, or ``taylor`` (needs ``calibration`` =
    (inputs, targets); scores recomputed every round on the current model).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    if criterion not in ("l1", "l2", "taylor"):
        raise ValueError(f"unknown criterion {criterion!r}; use l1, l2 or taylor")
    if criterion == "taylor" and calibration is None:
        raise ValueError("criterion 'taylor' needs calibration=(inputs, targets)")
    if isinstance(amount, Mapping):
        amounts = {p: _check_amount(a, f"layer {p!r}") for p, a in amount.items()}
        default = 0.0
    else:
        default = _check_amount(amount, "node_prune")
        amounts = {}
    report = PruneReport(params_before=count_params(model))
    original: dict[str, int] = {}
    for r in range(1, rounds + 1):
        plans = plan_model(model)
        modules = dict(model.named_modules())
        taylor = (
            taylor_scores(model, [p.path for p in plans if not p.refused], calibration)
            if criterion == "taylor" and calibration is not None else {}
        )
        keep: dict[str, torch.Tensor] = {}
        for plan in plans:
            if plan.refused:
                report.refused[plan.path] = plan.refused
                continue
            a = amounts.get(plan.path, default)
            n0 = original.setdefault(plan.path, plan.channels)
            target = _keep_count(n0, a) if r == rounds else max(
                1, round(n0 * (1.0 - a) ** (r / rounds)))
            target = min(target, plan.channels)
            if target == plan.channels:
                continue
            scores = channel_importance(modules[plan.path], criterion, taylor.get(plan.path))
            keep[plan.path] = scores.topk(target).indices.sort().values
        step = prune_channels(model, keep) if keep else PruneReport()
        for path, (_, after) in step.pruned.items():
            report.pruned[path] = (original[path], after)
        for path, m in model.named_modules():
            if isinstance(m, nn.TransformerEncoderLayer):
                a = amounts.get(f"{path}.linear1", default)
                n0 = original.setdefault(f"{path}.linear1", m.linear1.out_features)
                target = _keep_count(n0, a) if r == rounds else max(
                    1, round(n0 * (1.0 - a) ** (r / rounds)))
                if target < m.linear1.out_features:
                    frac = 1.0 - target / m.linear1.out_features
                    _, after = prune_transformer_ffn(m, frac + 1e-9, criterion)
                    report.pruned[f"{path}.linear1"] = (n0, after)
        if fine_tune is not None:
            fine_tune(model, r)
    for path in report.pruned:
        report.refused.pop(path, None)
    report.params_after = count_params(model)
    return report


# --------------------------------------------------------------------------------------------
# Accounting


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, example: torch.Tensor) -> int:
    """Multiply-add FLOPs (2 per MAC) of Conv2d and Linear layers for one forward of
    ``example``; measured with forward hooks so spatial sizes are the real ones."""
    total = 0

    def conv_hook(m: nn.Conv2d, _i: Any, out: torch.Tensor) -> None:
        nonlocal total
        k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
        total += 2 * out.numel() * k

    def linear_hook(m: nn.Linear, _i: Any, out: torch.Tensor) -> None:
        nonlocal total
        total += 2 * out.numel() * m.in_features

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    return total
