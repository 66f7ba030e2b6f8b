"""Node (structured) pruning: remove whole neurons/channels/heads and *physically* slice the layers.

Why physical slicing: ``torch.nn.utils.prune.ln_structured`` only multiplies by a mask, so the
layer does exactly the same dense work as before. Speed comes from the layer (and every layer
that reads its output: BatchNorm, depthwise convs, the next Linear/Conv2d, through pooling,
flatten and concat) becoming genuinely smaller dense layers (Scalpel, Yu et al. ISCA 2017:
node pruning keeps dense hardware busy, weight pruning does not).

How: the units are found two ways, and every unit is pruned as a *group* that moves together.

* ``channel_graph``: the model is traced with ``torch.fx`` and a union-find over the channel
  dimension couples every producer (Linear, groups=1 Conv2d, HF ``Conv1D``) whose outputs meet
  at a residual ``add``/``sub``/``mul`` or pass through a depthwise conv; one index set is
  removed from all of them and from every consumer. A group whose channels reach anything
  that cannot be sliced consistently (the model output, a LayerNorm, a view/reshape) is
  *refused* with the reason, never pruned wrongly.
* ``module_rules``: blocks whose forward is known (GPT-2/BERT/``nn.TransformerEncoderLayer``
  feed-forward hidden units, GPT-2/BERT attention heads) are pruned by structure, which also
  covers models torch.fx cannot trace.

A group's importance is the sum of its producers' channel importances (L1/L2 of weights, or
first-order Taylor). The original modules are modified in place (new, smaller
``nn.Parameter`` objects), so the model keeps its class and forward; an optimizer built
before pruning must be rebuilt (in a run the plugin asks the core to; ``record_lineage``
tells which old parameter and indices each new one came from, so its state can be sliced).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from accelopt_plugins.gpu_kernels.channel_graph import (
    Group,
    Use,
    channel_groups,
    foreign_plugin,
    is_conv1d,
    is_producer,
    out_channels,
)
from accelopt_plugins.gpu_kernels.module_rules import RuleGroup, module_rules
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

Criterion = str  # "l1" | "l2" | "taylor"
_Use = Use  # the consumer record (kept under its old name)


# --------------------------------------------------------------------------------------------
# Plans


@dataclass
class _Plan:
    """One prunable (or refused) layer: ``channels`` units of its group ``group`` (the
    group's key), the group's consumer uses, or the reason it is refused."""

    path: str
    channels: int
    uses: list[Use] = field(default_factory=list)
    refused: str | None = None
    group: str = ""
    unit: str = "channel"


@dataclass
class PruneReport:
    """What one pruning pass did: per-layer unit counts (channels; heads for attention),
    the coupled groups, and the refused layers' reasons."""

    pruned: dict[str, tuple[int, int]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    params_before: int = 0
    params_after: int = 0
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per group key, the indices of the units kept, into the group's units before any
    round: ``prune_channels(dense_copy, report.kept)`` repeats the pruning exactly."""
    floored: dict[str, int] = field(default_factory=dict)
    """Groups (key -> units) the amount would have emptied: one unit kept instead."""
    unremoved: dict[str, int] = field(default_factory=dict)
    """Prunable groups (key -> units) left whole because their amount rounds down to no
    unit (``amount * units < 1``): why an amount of 0.05 pruned nothing."""

    def summary(self) -> str:
        layers = ", ".join(f"{p or '<root>'} {a}->{b}" for p, (a, b) in self.pruned.items())
        coupled = sum(1 for members in self.groups.values() if len(members) > 1)
        floored = (f"; {self.floored_note()}" if self.floored else "")
        return (
            f"node-pruned {len(self.pruned)} layers ({layers or 'none'}) in {len(self.groups)} "
            f"groups ({coupled} coupled); params {self.params_before} -> {self.params_after}; "
            f"refused {len(self.refused)}{floored}"
        )

    def unremoved_note(self, amount: float) -> str:
        """One line on why nothing was pruned when every prunable group's amount rounded to
        no unit, with the smallest amount that removes one unit of the widest group."""
        sizes = sorted(set(self.unremoved.values()))
        shown = ", ".join(map(str, sizes[:4])) + (", ..." if len(sizes) > 4 else "")
        widest = sizes[-1]
        return (f"prune_amount={amount:g} removes no unit of any of the {len(self.unremoved)} "
                f"prunable layers: it rounds to 0 of {shown} units (amount x units, rounded "
                f"down; the model stays dense); an amount >= {1 / widest:.4g} removes one "
                f"unit of the widest ({widest})")

    def floored_note(self) -> str:
        """One line on the groups the amount would have emptied."""
        names = ", ".join(f"{k or '<root>'} ({n})" for k, n in list(self.floored.items())[:3])
        more = f" and {len(self.floored) - 3} more" if len(self.floored) > 3 else ""
        return (f"the amount would remove every unit of {names}{more}: one unit of each kept "
                "(a lower amount keeps more)")


@dataclass
class _Analysis:
    graph: dict[str, Group]  # key -> group
    rules: dict[str, RuleGroup]  # key -> group
    refused: dict[str, str]  # layers outside any group, with the reason
    owner: dict[str, str]  # producer path (or rule key) -> group key


def _analyse(model: nn.Module, interfaces: Collection[str] = ()) -> _Analysis:
    """The groups, rule blocks and refused layers of ``model``. ``interfaces``: paths of
    sub-modules called on their own (outside the root module's forward), whose input and
    output widths must stay: a group crossing one's boundary is refused."""
    rules, refused = module_rules(model)
    rule_map = {r.key: r for r in rules}
    covered = {m for r in rules for m in r.members}
    blocks = {r.block for r in rules if r.block}
    groups: list[Group] = []
    not_producers: dict[str, str] = {}
    if any(not r.block for r in rules):  # the model is itself a block a rule prunes: its
        why = "the model is a known block: only its rule prunes it"  # rule is the graph
    else:
        try:
            groups, not_producers = channel_groups(model, blocks)
            why = ""
        except Exception as exc:  # untraceable: only the module rules can prune safely
            why = (f"model is not torch.fx-traceable ({type(exc).__name__}); only known "
                   "blocks (feed-forward, attention heads) are pruned")
    if why:
        for path, m in model.named_modules():
            if is_producer(m) and path not in covered:
                refused[path] = why
    refused.update(not_producers)
    known = {*refused, *covered, *blocks}
    for path, reason in unhandled_layers(model, known).items():
        refused.setdefault(path, reason)
    holders = _holders(model)
    for g in [*groups, *rules]:
        g.refused = (g.refused or _tied_reason(model, g.members, holders)
                     or _frozen_reason(model, g.members)
                     or _interface_reason(g.members, interfaces))
    graph = {g.key: g for g in groups}
    owner = {p: g.key for g in groups for p in g.producers}
    owner.update({k: k for k in rule_map})
    return _Analysis(graph, rule_map, refused, owner)


NOT_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.Embedding,
    nn.EmbeddingBag)
"""Modules with parameters that are never themselves a pruning candidate, so not listed as
refused: norms follow the channels of the layer before them (sliced with it, or that layer's
group is refused naming the norm), and an embedding table is the model's input."""


def unhandled_layers(model: nn.Module, known: set[str]) -> dict[str, str]:
    """Layers holding parameters of a type the pruner has no rule for (Conv1d, Conv3d,
    ConvTranspose2d, a custom layer with its own weight), path -> why, in model order. They
    were left out of the refused layers, so a model of two Conv1d read "no prunable layer;
    refused 1: fc" as if the convs had been looked at and found fine. ``known``: paths
    already accounted for (refused with a reason, or pruned by a module rule), whose
    submodules are skipped too; parameter-free modules and the root are never listed."""
    out: dict[str, str] = {}
    skip: list[str] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(f"{s}.") for s in skip):
            continue
        if path in known:
            skip.append(path)
            continue
        if is_producer(module) or isinstance(module, (nn.Conv2d, *NOT_LAYERS)):
            continue  # Conv2d: every kind (grouped, depthwise) has its own rule or reason
        opaque = foreign_plugin(module) is not None  # one call of the trace: its insides
        if opaque:  # are its plugin's, the layer is listed as a whole
            skip.append(path)
        if next(module.parameters(recurse=opaque), None) is not None:
            out[path] = f"not a prunable layer type: {type(module).__name__}"
    return out


def _holders(model: nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> every name it has (several for a tied weight)."""
    holders: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(name)
    return holders


def _tied_reason(model: nn.Module, members: list[str],
                 holders: dict[int, list[str]]) -> str | None:
    """Why a group whose modules hold a tied weight (an output layer sharing the embedding's)
    stays dense: slicing it for one of its users replaced it with an untied copy, the
    parameter count went up and the row still said "pruned"."""
    modules = dict(model.named_modules())
    for member in members:
        for name, param in modules[member].named_parameters(recurse=False):
            full = f"{member}.{name}" if member else name  # member "": the root
            others = [h for h in holders[id(param)] if h != full]
            if others:
                return (f"{member}.{name} is tied to {others[0]} (a shared weight cannot be "
                        "sliced for one of its users)")
    return None


def _frozen_reason(model: nn.Module, members: list[str]) -> str | None:
    """Why a group that slices a frozen layer (a parameter with ``requires_grad=False``: a
    body held fixed while a head is fine-tuned) stays dense: pruning changes what that
    layer computes, which the user froze it not to; a frozen 16-unit layer was cut to 8 and
    the row said "trained at the pruned size" though nothing trained it."""
    modules = dict(model.named_modules())
    for member in members:
        for name, param in modules[member].named_parameters(recurse=False):
            if not param.requires_grad:
                full = f"{member}.{name}" if member else name
                return (f"{full} is frozen (requires_grad=False): a frozen layer is left as "
                        "it is")
    return None


def _interface_reason(members: list[str], interfaces: Collection[str]) -> str | None:
    """Why a group whose modules lie both inside and outside a sub-module called on its own
    stays dense. Why: the channels are traced through the root module's forward only, so a
    GAN container whose forward is ``D(G(z))`` had G's 4 outputs and D's 4 inputs cut to 2,
    and the loop's own ``model.D(real)`` on 4-feature data failed with a shape error."""
    for sub in interfaces:
        inside = [m for m in members if m == sub or m.startswith(f"{sub}.")]
        if inside and len(inside) < len(members):
            return (f"its channels cross the boundary of {sub}, which the loop calls on its "
                    f"own (outside the model's forward): {sub} keeps its input and output "
                    "widths")
    return None


def plan_model(model: nn.Module, interfaces: Collection[str] = ()) -> list[_Plan]:
    """Every prunable unit owner of ``model`` (graph producers, rule blocks) and every
    refused layer, each with its group key and, if refused, why (``interfaces``: as
    :func:`node_prune`'s)."""
    a = _analyse(model, interfaces)
    plans = [_Plan(p, g.channels, g.uses, g.refused, g.key)
             for g in a.graph.values() for p in g.producers]
    plans += [_Plan(r.key, r.units, [], r.refused, r.key, r.unit) for r in a.rules.values()]
    plans += [_Plan(p, 0, refused=why) for p, why in a.refused.items()]
    return plans


# --------------------------------------------------------------------------------------------
# Importance


def _weight_rows(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped like the weight) with one row per output channel."""
    return t.t().flatten(1) if is_conv1d(module) else t.flatten(1)


def channel_importance(
    module: nn.Module, criterion: Criterion, taylor: torch.Tensor | None = None
) -> torch.Tensor:
    """Score of each output channel of a Linear/Conv2d/Conv1D: the L1 or L2 norm of its
    weights (Li et al. 2017), or first-order Taylor (Molchanov et al.): a precomputed
    activation score ``|mean(activation * gradient)|``, else, when the weights hold a
    gradient (after a backward: in a run, that of the current batch), the weight form
    ``|sum over the channel's weights of w * dL/dw|``."""
    if criterion == "taylor":
        if taylor is not None:
            return taylor
        grad = module.weight.grad
        if grad is None:
            raise ValueError("criterion 'taylor' needs calibration data (inputs, targets) or "
                             "gradients from a backward pass")
        score = _weight_rows(module, module.weight.detach() * grad).sum(1)
        bias = getattr(module, "bias", None)
        if bias is not None and bias.grad is not None:
            score = score + bias.detach() * bias.grad
        return score.abs()
    w = _weight_rows(module, module.weight.detach())
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
    mean over the batch of |sum over positions of activation * dLoss/dactivation|. Buffers
    (BatchNorm statistics) are restored afterwards: scoring must not change the model."""
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    modules = dict(model.named_modules())
    outputs: dict[str, torch.Tensor] = {}
    buffers = {k: b.clone() for k, b in model.named_buffers()}

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
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    scores = {}
    for path, out in outputs.items():
        prod = (out * out.grad).detach()
        # channel dimension: 1 for conv maps, last for Linear/Conv1D outputs
        if isinstance(modules[path], nn.Conv2d):
            per = prod.flatten(2).sum(2)
        else:
            per = prod.reshape(-1, prod.shape[-1])
        scores[path] = per.abs().mean(0)
    model.zero_grad(set_to_none=True)
    return scores


def _group_scores(g: Group | RuleGroup, modules: Mapping[str, nn.Module], criterion: Criterion,
                  taylor: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sum of the members' importances, per unit (a head sums its q/k/v channels)."""
    if isinstance(g, Group):
        return sum(channel_importance(modules[p], criterion, taylor.get(p))  # type: ignore[return-value]
                   for p in g.producers)
    total = torch.zeros(g.units)
    for p, cols in g.producers.items():
        per = channel_importance(modules[p], criterion, taylor.get(p)).float().cpu()
        total += per[cols].sum(1)
    return total


# --------------------------------------------------------------------------------------------
# Slicing

Lineage = dict[nn.Parameter, tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]]
_LINEAGE: list[Lineage] = []


@contextlib.contextmanager
def record_lineage() -> Iterator[Lineage]:
    """While active, every parameter the slicing replaces is recorded as
    ``new -> (original, [(dim, kept indices), ...])`` (the index_selects that turn the
    original into the new one, in order), so a caller can slice optimizer state the same way
    instead of starting it fresh."""
    table: Lineage = {}
    _LINEAGE.append(table)
    try:
        yield table
    finally:
        _LINEAGE.remove(table)


def slice_like(t: torch.Tensor, steps: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Apply a lineage's index_selects to ``t`` (a state tensor shaped like the original)."""
    for dim, idx in steps:
        t = t.index_select(dim, idx.to(t.device))
    return t


def _set_param(module: nn.Module, name: str, dim: int, keep: torch.Tensor) -> None:
    old = getattr(module, name)
    value = old.data.index_select(dim, keep.to(old.device))
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        setattr(module, name, new)
        for table in _LINEAGE:
            orig, steps = table.pop(old, (old, []))
            table[new] = (orig, [*steps, (dim, keep)])
    else:
        module.register_buffer(name, value)


def _slice_out(module: nn.Module, keep: torch.Tensor) -> None:
    conv1d = is_conv1d(module)
    _set_param(module, "weight", 1 if conv1d else 0, keep)
    if getattr(module, "bias", None) is not None:
        _set_param(module, "bias", 0, keep)
    if isinstance(module, nn.Linear):
        module.out_features = int(keep.numel())
    elif conv1d:
        module.nf = int(keep.numel())
    else:
        module.out_channels = int(keep.numel())


def _slice_in(module: nn.Module, keep: torch.Tensor) -> None:
    conv1d = is_conv1d(module)
    _set_param(module, "weight", 0 if conv1d else 1, keep)
    if isinstance(module, nn.Linear):
        module.in_features = int(keep.numel())
    elif conv1d:
        module.nx = int(keep.numel())
    else:
        module.in_channels = int(keep.numel())


def _slice_per_channel(module: nn.Module, keep: torch.Tensor) -> None:
    """BatchNorm (affine + running statistics) or a depthwise conv (one filter per channel,
    ``groups`` follows the channel count)."""
    for name in ("weight", "bias", "running_mean", "running_var"):
        if getattr(module, name, None) is not None:
            _set_param(module, name, 0, keep)
    n = int(keep.numel())
    if isinstance(module, nn.Conv2d):
        module.in_channels = module.out_channels = module.groups = n
    else:
        module.num_features = n


def _keep_count(n: int, amount: float) -> int:
    """Units kept of ``n`` at ``amount``, at least one: an amount just under 1
    (0.99999999999) rounded to none and left a 0-wide layer (params 3466 -> 10, FLOPs 0)."""
    return max(1, _raw_keep(n, amount))


def _raw_keep(n: int, amount: float) -> int:
    return n - int(math.floor(amount * n + 1e-9))


def _check_amount(amount: float, where: str) -> float:
    amount = float(amount)
    if not 0.0 <= amount < 1.0:
        raise ValueError(
            f"{where}: pruning amount {amount} is outside [0, 1); pruning 100% of a layer "
            "would remove it (and everything that reads it), so it is refused"
        )
    return amount


def _resolve_keep(a: _Analysis, keep: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep indices per group key; every path must own a prunable group, members of one
    group must agree, and at least one unit must stay."""
    out: dict[str, torch.Tensor] = {}
    for path, idx in keep.items():
        key = a.owner.get(path)
        if key is None:
            if path in a.refused:
                raise ValueError(f"layer {path!r} cannot be pruned: {a.refused[path]}")
            raise ValueError(f"{path!r} is not a prunable layer or block of this model")
        g = a.graph.get(key) or a.rules[key]
        n = g.channels if isinstance(g, Group) else g.units
        if g.refused:
            raise ValueError(f"layer {path!r} cannot be pruned: {g.refused}")
        idx = torch.as_tensor(idx, dtype=torch.long).sort().values
        if idx.numel() == 0:
            raise ValueError(f"pruning 100% of layer {path!r} is refused: keep at least one")
        if int(idx.max()) >= n or int(idx.min()) < 0 or idx.unique().numel() != idx.numel():
            raise ValueError(f"keep indices for {path!r} out of range 0..{n - 1} or repeated")
        if key in out and not torch.equal(out[key], idx):
            raise ValueError(f"{path!r} is coupled with {key!r} (same channel group): give "
                             "them the same indices, or only one of them")
        out[key] = idx
    return out


def _apply(model: nn.Module, a: _Analysis, keep: Mapping[str, torch.Tensor],
           report: PruneReport) -> None:
    modules = dict(model.named_modules())
    in_masks: dict[tuple[str, str], torch.Tensor] = {}
    sizes = {"bn": lambda m: m.num_features, "dw": lambda m: m.in_channels}
    for key, idx in keep.items():
        if key in a.rules:
            _apply_rule(modules, a.rules[key], idx, report)
            continue
        g = a.graph[key]
        dropped = torch.ones(g.channels, dtype=torch.bool)
        dropped[idx] = False
        dead = dropped.nonzero().flatten().tolist()
        for use in g.uses:
            mod = modules[use.path]
            size = sizes.get(use.kind, lambda m: _input_size(m))(mod)
            mask = in_masks.setdefault((use.path, use.kind), torch.ones(size, dtype=torch.bool))
            for c in dead:
                start = (use.base + c) * use.mult
                mask[start:start + use.mult] = False
        for p in g.producers:
            _slice_out(modules[p], idx)
            report.pruned[p] = (g.channels, int(idx.numel()))
        for use in g.uses:
            if use.kind == "dw":
                report.pruned[use.path] = (g.channels, int(idx.numel()))
        report.groups[key] = tuple(g.producers)
    for (path, kind), mask in in_masks.items():
        kept = mask.nonzero().flatten()
        if kind in ("bn", "dw"):
            _slice_per_channel(modules[path], kept)
        else:
            _slice_in(modules[path], kept)


def _input_size(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return int(module.in_features)
    return int(module.nx) if is_conv1d(module) else int(module.in_channels)


def _apply_rule(modules: Mapping[str, nn.Module], g: RuleGroup, idx: torch.Tensor,
                report: PruneReport) -> None:
    # sorted: a fused [q | k | v] projection keeps its three parts in place
    for p, cols in g.producers.items():
        _slice_out(modules[p], cols[idx].flatten().sort().values)
    for p, cols in g.consumers.items():
        _slice_in(modules[p], cols[idx].flatten().sort().values)
    if g.after is not None:
        g.after(int(idx.numel()))
    report.pruned[g.key] = (g.units, int(idx.numel()))
    report.groups[g.key] = tuple(g.members)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiles (else ``model``): torch.fx cannot
    trace the wrapper, so every layer was refused as untraceable. Pruned in place, the
    wrapper compiles it afresh on its next call (its shapes changed); paths are the
    module's own (``1``, not ``_orig_mod.1``)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo has no such wrapper
        return model
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(model, OptimizedModule) and isinstance(inner, nn.Module) else model


def prune_channels(model: nn.Module, keep: Mapping[str, torch.Tensor]) -> PruneReport:
    """Keep only the given units (index tensors) of the groups owning the mapping's paths
    (a producer path, or a rule block's key), slicing every member and consumer of each
    group. A refused or unknown path raises ``ValueError``. A ``torch.compile``d model is
    pruned through the module it compiles (:func:`uncompiled`)."""
    model = uncompiled(model)
    a = _analyse(model)
    report = PruneReport(params_before=count_params(model))
    report.kept = _resolve_keep(a, keep)
    _apply(model, a, report.kept, report)
    report.params_after = count_params(model)
    return report


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


def _amount_of(g: Group | RuleGroup, amounts: Mapping[str, float], default: float) -> float:
    paths = [g.key, *(g.producers if isinstance(g, Group) else g.members)]
    return next((amounts[p] for p in paths if p in amounts), default)


def node_prune(
    model: nn.Module,
    amount: float | Mapping[str, float],
    *,
    criterion: Criterion = "l1",
    rounds: int = 1,
    calibration: tuple[torch.Tensor, torch.Tensor] | None = None,
    fine_tune: Callable[[nn.Module, int], None] | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    interfaces: Collection[str] = (),
) -> PruneReport:
    """Prune ``amount`` of the units of every prunable group (or per-layer amounts by path;
    a group takes the amount of the first of its members named), by importance, in
    ``rounds`` iterative rounds (equal ratio per round, ``fine_tune(model, round)`` called
    after each). Refused layers are listed with reasons.

    ``criterion``: ``l1``/``l2`` weight norms, or ``taylor``: with ``calibration`` =
    (inputs, targets) the activation form (recomputed every round on the current model,
    ``loss_fn`` default cross-entropy), else the weight form from the gradients the model
    already holds. A ``torch.compile``d model is pruned through the module it compiles
    (:func:`uncompiled`). ``interfaces``: paths of sub-modules called on their own, not only
    through the model's forward (a GAN's discriminator fed real data): every group crossing
    one's boundary is refused, so each keeps its input and output widths.
    """
    model = uncompiled(model)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    if criterion not in ("l1", "l2", "taylor"):
        raise ValueError(f"unknown criterion {criterion!r}; use l1, l2 or taylor")
    if criterion == "taylor" and calibration is None and not _has_grads(model):
        raise ValueError("criterion 'taylor' needs calibration=(inputs, targets) or gradients "
                         "from a backward pass")
    if isinstance(amount, Mapping):
        amounts = {p: _check_amount(a, f"layer {p!r}") for p, a in amount.items()}
        default = 0.0
    else:
        default = _check_amount(amount, "node_prune")
        amounts = {}
    report = PruneReport(params_before=count_params(model))
    original: dict[str, int] = {}
    for r in range(1, rounds + 1):
        a = _analyse(model, interfaces)
        _record_refusals(a, report)
        groups: list[Group | RuleGroup] = [*a.graph.values(), *a.rules.values()]
        live = [g for g in groups if not g.refused]
        taylor = (taylor_scores(model, [p for g in live for p in _producers(g)], calibration,
                                loss_fn) if criterion == "taylor" and calibration is not None
                  else {})
        modules = dict(model.named_modules())
        keep: dict[str, torch.Tensor] = {}
        for g in live:
            n = g.channels if isinstance(g, Group) else g.units
            n0 = original.setdefault(g.key, n)
            share = _amount_of(g, amounts, default)
            target = _keep_count(n0, share) if r == rounds else max(
                1, round(n0 * (1.0 - share) ** (r / rounds)))
            if r == rounds and _raw_keep(n0, share) < 1:
                report.floored[g.key] = n0
            if r == rounds and share > 0 and _raw_keep(n0, share) >= n0:
                report.unremoved[g.key] = n0
            if min(target, n) < n:
                scores = _group_scores(g, modules, criterion, taylor)
                keep[g.key] = scores.topk(min(target, n)).indices.sort().values
        for key, idx in keep.items():  # indices into this round's units -> the first's
            report.kept[key] = report.kept[key][idx] if key in report.kept else idx
        step = PruneReport()
        _apply(model, a, keep, step)
        for path, (_, after) in step.pruned.items():
            key = a.owner.get(path, path)
            report.pruned[path] = (original.get(key, step.pruned[path][0]), after)
        report.groups.update(step.groups)
        if fine_tune is not None:
            fine_tune(model, r)
    for path in report.pruned:
        report.refused.pop(path, None)
    for key in report.kept:  # an earlier round (rounding to nearest) may have pruned it
        report.unremoved.pop(key, None)
    report.params_after = count_params(model)
    return report


def _producers(g: Group | RuleGroup) -> list[str]:
    return list(g.producers)


def _has_grads(model: nn.Module) -> bool:
    return any(is_producer(m) and m.weight.grad is not None for m in model.modules())


def _record_refusals(a: _Analysis, report: PruneReport) -> None:
    report.refused.update(a.refused)
    for g in a.graph.values():
        if g.refused:
            report.refused.update(dict.fromkeys(g.producers, g.refused))
    for rg in a.rules.values():
        if rg.refused:
            report.refused[rg.key] = rg.refused


# --------------------------------------------------------------------------------------------
# Accounting


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _run(model: nn.Module, example: Any, kwargs: Mapping[str, Any]) -> Any:
    if isinstance(example, Mapping):
        return model(**example, **kwargs)
    if isinstance(example, tuple):
        return model(*example, **kwargs)
    return model(example, **kwargs)


def count_flops(model: nn.Module, example: Any, kwargs: Mapping[str, Any] | None = None) -> int:
    """Multiply-add FLOPs (2 per MAC) of every matrix product and convolution of one forward
    of ``example`` (a tensor, a tuple of positional inputs or a mapping of keyword inputs,
    plus ``kwargs``), counted by torch's ``FlopCounterMode`` at the real shapes.

    Why torch's counter and not hooks on the layers: the products that no ``Linear`` or
    ``Conv2d`` module holds are work too, and pruning heads removes them as well: attention's
    ``QK^T`` and ``AV``, ``nn.MultiheadAttention``'s fused input projection, HF ``Conv1D``
    (an ``addmm``). Counting only the layers called the zoo transformer's pruned model 2.00x
    cheaper where its products are 1.31x, a "bound" its speed-ups could exceed. Why autograd
    is on and attention takes its math path while counting: an eval-mode
    ``nn.TransformerEncoderLayer`` without autograd runs one fused kernel and CPU attention
    another, which the counter does not see; nothing runs backward, the graph is dropped.
    Elementwise work (norms, softmax, activations) and recurrent cells are not counted."""
    with (sdpa_kernel(SDPBackend.MATH), torch.enable_grad(),
          FlopCounterMode(display=False) as counter):
        _run(model, example, kwargs or {})
    return int(counter.get_total_flops())


__all__ = ["PruneReport", "channel_importance", "count_flops", "count_params", "node_prune",
           "out_channels", "plan_model", "prune_channels", "prune_transformer_ffn",
           "record_lineage", "slice_like", "taylor_scores", "unhandled_layers"]
