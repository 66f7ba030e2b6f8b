"""Channel groups of a torch.fx graph: which output channels must be removed *together*.

Why groups: a residual ``add`` sums two tensors channel by channel, so removing channel 7 of
one operand is only correct if channel 7 of the other operand goes too (and every layer
reading the sum drops its input 7). A depthwise conv maps input channel c to output channel
c, so it couples its producer's channels to everything after it. Instead of refusing such
layers, every tensor's channel dimension is described by *channel spaces* (one per producer
output, a Linear / groups=1 Conv2d / HF ``Conv1D``), the graph is walked forward once, and a
union-find merges the spaces that meet at an elementwise op or pass through a depthwise
conv. A group (one union-find class) is pruned with one index set for all its producers and
consumers; it is refused, with the first reason found, as soon as any of its channels reaches
something that cannot be sliced consistently (the model output, a LayerNorm over channels,
a view/reshape, a reduction over the channels, an unknown op, a tensor of unknown channels).
A pool, or a mean/sum/amax/amin over dims that leave the channels out (``h.mean((2, 3))``,
global average pooling), keeps each channel to itself and is sliced through.

Layouts: ``map`` (channels on dim 1: conv feature maps), ``vec`` (channels on the last dim:
Linear outputs), ``flat`` (a ``map`` flattened from dim 1, so channel c owns a contiguous
block of ``mult`` features, as NCHW flattens).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

_ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Hardswish, nn.Hardsigmoid, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
)
_POOL_MODULES: tuple[type[nn.Module], ...] = (
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
)
_ACTIVATION_FUNCTIONS: set[Any] = {
    F.relu, torch.relu, F.relu6, F.gelu, F.silu, torch.sigmoid, torch.tanh, F.leaky_relu,
    F.dropout, F.hardswish, F.hardsigmoid, F.elu,
}
_POOL_FUNCTIONS: set[Any] = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d,
                             F.adaptive_max_pool2d}
_REDUCTION_FUNCTIONS: set[Any] = {torch.mean, torch.sum, torch.amax, torch.amin}
_REDUCTION_METHODS = {"mean", "sum", "amax", "amin"}
"""Reductions that act on each channel alone when their dims leave the channel dimension
out: ``h.mean((2, 3))``, global average pooling written as a reduction, keeps channel c in
channel c exactly as ``AdaptiveAvgPool2d(1)`` does, so it is sliced through like a pool."""
_ELEMENTWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh", "contiguous"}
_BINARY_FUNCTIONS: set[Any] = {operator.add, operator.iadd, operator.sub, operator.isub,
                               operator.mul, operator.imul, torch.add, torch.sub, torch.mul}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_"}
_NORMS_OVER_CHANNELS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm)


def is_conv1d(module: nn.Module) -> bool:
    """HF ``transformers.pytorch_utils.Conv1D``: a Linear whose weight is stored [in, out].
    Recognised by shape, so pruning does not import transformers."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")
            and tuple(module.weight.shape) == (module.nx, module.nf))


def is_producer(module: nn.Module) -> bool:
    """A layer whose output channels can be removed by slicing its own weight."""
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return True
    return isinstance(module, nn.Conv2d) and module.groups == 1


def is_depthwise(module: nn.Module) -> bool:
    return (isinstance(module, nn.Conv2d) and module.groups > 1
            and module.groups == module.in_channels == module.out_channels)


def out_channels(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return int(module.out_features)
    if is_conv1d(module):
        return int(module.nf)
    return int(module.out_channels)


def in_channels(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return int(module.in_features)
    if is_conv1d(module):
        return int(module.nx)
    return int(module.in_channels)


class _Tracer(fx.Tracer):
    """torch.fx tracer that keeps HF ``Conv1D`` (its forward reshapes) and the blocks a module
    rule prunes (``leaves``: their insides are that rule's business) as single calls."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (is_conv1d(m) or qualname in self.leaves or foreign_plugin(m) is not None
                or super().is_leaf_module(m, qualname))


PLUGINS_PACKAGE = "accelopt_plugins."


def foreign_plugin(module: nn.Module) -> str | None:
    """The plugin whose layer ``module`` is, when another plugin put it in before pruning
    (slide's output layer: gpu_kernels runs after slide whatever the list order), else
    ``None``. Such a layer is
    a single opaque call of the trace: tracing into it raised (slide's forward branches on
    its inputs), which refused every layer of the model as "not torch.fx-traceable"."""
    where = type(module).__module__
    if not where.startswith(PLUGINS_PACKAGE):
        return None
    name = where[len(PLUGINS_PACKAGE):].partition(".")[0]
    return None if name in ("gpu_kernels", "") else name


def trace(model: nn.Module, leaves: set[str] | None = None) -> fx.Graph:
    return _Tracer(leaves or set()).trace(model)


@dataclass
class Use:
    """Channel c of a space occupies indices ``(base + c)*mult + [0, mult)`` of the input
    dimension of the module at ``path`` (``kind``: ``linear_in`` | ``conv_in`` | ``conv1d_in``
    | ``bn`` | ``dw``, the last two slicing the module's own per-channel tensors)."""

    path: str
    kind: str
    base: int
    mult: int


@dataclass
class _Space:
    size: int
    producer: str
    uses: list[Use] = field(default_factory=list)
    refused: str | None = None


@dataclass
class Group:
    """Channels removed together: one index set for every producer's output and every use."""

    key: str
    channels: int
    producers: list[str]
    uses: list[Use]
    refused: str | None = None

    @property
    def members(self) -> list[str]:
        """Every module this group slices (producers, then BatchNorms/depthwise/consumers)."""
        seen = dict.fromkeys(self.producers)
        seen.update(dict.fromkeys(u.path for u in self.uses))
        return list(seen)


@dataclass(frozen=True)
class _Layout:
    segs: tuple[tuple[int, int], ...]  # (space id, size) in channel order
    kind: str  # "map" | "vec" | "flat"
    ndim: int | None = None
    """The tensor's rank where known (a Conv2d's map: 4, NCHW), so a reduction's negative
    dims can be told apart from the channel dimension; ``None``: unknown."""

    @property
    def total(self) -> int:
        return sum(size for _, size in self.segs)


class _Planner:
    """One forward walk over the graph: layouts per node, spaces, union-find, refusals."""

    def __init__(self, model: nn.Module, graph: fx.Graph, skip: set[str]) -> None:
        self.modules = dict(model.named_modules())
        self.graph, self.skip = graph, skip
        self.calls: dict[str, int] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                self.calls[str(node.target)] = self.calls.get(str(node.target), 0) + 1
        self.spaces: list[_Space] = []
        self.parent: list[int] = []
        self.layout: dict[fx.Node, _Layout | None] = {}
        self.not_producers: dict[str, str] = {}

    # -- union-find -------------------------------------------------------------------------

    def _find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def _union(self, a: int, b: int) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def _new_space(self, size: int, producer: str) -> int:
        self.spaces.append(_Space(size, producer))
        self.parent.append(len(self.parent))
        return len(self.spaces) - 1

    def _refuse(self, layouts: Iterable[_Layout | None], why: str) -> None:
        for lay in layouts:
            for space, _ in lay.segs if lay is not None else ():
                if self.spaces[space].refused is None:
                    self.spaces[space].refused = why

    # -- the walk ---------------------------------------------------------------------------

    def run(self) -> list[Group]:
        for node in self.graph.nodes:
            self.layout[node] = self._visit(node)
        return self._groups()

    def _lay(self, arg: Any) -> _Layout | None:
        return self.layout.get(arg) if isinstance(arg, fx.Node) else None

    def _inputs(self, node: fx.Node) -> list[_Layout]:
        return [lay for n in node.all_input_nodes if (lay := self.layout.get(n)) is not None]

    def _where(self, node: fx.Node) -> str:
        return f"'{node.target}'" if node.op == "call_module" else f"node '{node.name}'"

    def _visit(self, node: fx.Node) -> _Layout | None:
        if node.op in ("placeholder", "get_attr"):
            return None
        if node.op == "output":
            self._refuse(self._inputs(node),
                         "its outputs are the model's outputs (e.g. the classifier head)")
            return None
        if node.op == "call_module":
            return self._module(node, self.modules[str(node.target)])
        if node.op == "call_function" and node.target in _BINARY_FUNCTIONS or (
                node.op == "call_method" and node.target in _BINARY_METHODS):
            return self._binary(node)
        if node.op == "call_function" and node.target in (torch.cat, torch.concat):
            return self._cat(node)
        if node.op == "call_function" and node.target in _ACTIVATION_FUNCTIONS or (
                node.op == "call_method" and node.target in _ELEMENTWISE_METHODS):
            return self._passthrough(node, pool=False)
        if node.op == "call_function" and node.target in _POOL_FUNCTIONS:
            return self._passthrough(node, pool=True)
        if node.op == "call_function" and node.target in _REDUCTION_FUNCTIONS or (
                node.op == "call_method" and node.target in _REDUCTION_METHODS):
            return self._reduce(node)
        if _flatten_start(node) is not None:
            return self._flatten(node, _flatten_start(node))
        return self._opaque(node)

    def _opaque(self, node: fx.Node, what: str | None = None) -> None:
        name = what or f"{node.op} {getattr(node.target, '__name__', node.target)}"
        self._refuse(self._inputs(node), f"feeds {name} {self._where(node)}, which cannot be "
                     "sliced (a view/reshape, reduction, indexing or unknown op)")
        return None

    def _passthrough(self, node: fx.Node, *, pool: bool) -> _Layout | None:
        lay = self._lay(node.args[0]) if node.args else None
        others = [self.layout.get(n) for n in node.all_input_nodes if n is not node.args[0]]
        self._refuse(others, f"reaches {self._where(node)} as a non-input argument")
        if lay is not None and pool and lay.kind != "map":
            self._refuse([lay], f"pooled by {self._where(node)} over its channel dimension")
            return None
        return lay

    def _module(self, node: fx.Node, mod: nn.Module) -> _Layout | None:
        path = str(node.target)
        where = self._where(node)
        if path in self.skip:
            return self._opaque(node, "the block (pruned inside by its own rule)")
        if is_producer(mod):
            return self._producer(node, path, mod)
        if is_depthwise(mod):
            return self._depthwise(node, path, mod)
        if isinstance(mod, nn.Conv2d):
            self.not_producers[path] = (f"grouped Conv2d (groups={mod.groups}): its channels "
                                        "are tied to groups; not pruned")
            return self._opaque(node, f"grouped Conv2d (groups={mod.groups})")
        if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
            lay = self._lay(node.args[0])
            want = "map" if isinstance(mod, nn.BatchNorm2d) else None
            if lay is None:
                return None
            if (want and lay.kind != want) or lay.kind == "flat" or lay.total != mod.num_features:
                self._refuse([lay], f"feeds BatchNorm {where} whose features do not match")
                return None
            if self.calls.get(path, 0) != 1:
                self._refuse([lay], f"feeds {where}, which is called several times")
                return None
            self._use(lay, path, "bn", 1)
            return lay
        if isinstance(mod, _NORMS_OVER_CHANNELS):
            self._refuse(self._inputs(node), f"normalised by {type(mod).__name__} {where} over "
                         "the channels (its statistics would change)")
            return None
        if isinstance(mod, _ACTIVATION_MODULES):
            return self._passthrough(node, pool=False)
        if isinstance(mod, _POOL_MODULES):
            return self._passthrough(node, pool=True)
        if isinstance(mod, nn.Flatten):
            return self._flatten(node, mod.start_dim if mod.end_dim == -1 else -99)
        plugin = foreign_plugin(mod)
        if plugin is not None:
            self._refuse(self._inputs(node), (
                f"feeds {type(mod).__name__} {where}, a layer plugin '{plugin}' put in as the "
                "job was built, before gpu_kernels prunes (gpu_kernels runs after it whatever "
                "the order +plugins lists them): pruning cannot slice that layer, so the one "
                "feeding it stays dense"))
            return None
        return self._opaque(node, type(mod).__name__)

    def _producer(self, node: fx.Node, path: str, mod: nn.Module) -> _Layout:
        lay = self._lay(node.args[0]) if node.args else None
        extra = [self.layout.get(n) for n in node.all_input_nodes if n is not node.args[0]]
        self._refuse(extra, f"reaches {self._where(node)} as a non-input argument")
        shared = self.calls.get(path, 0) != 1
        if lay is not None:
            self._consume(lay, node, path, mod, shared)
        space = self._new_space(out_channels(mod), path)
        if shared:
            self.spaces[space].refused = (f"module is called {self.calls.get(path, 0)} times "
                                          "(shared weights)")
        if isinstance(mod, nn.Conv2d):
            return _Layout(((space, out_channels(mod)),), "map", 4)
        return _Layout(((space, out_channels(mod)),), "vec")

    def _consume(self, lay: _Layout, node: fx.Node, path: str, mod: nn.Module,
                 shared: bool) -> None:
        where = self._where(node)
        if shared:
            self._refuse([lay], f"consumer {where} is called several times (shared weights)")
            return
        if isinstance(mod, nn.Conv2d):
            if lay.kind != "map" or lay.total != mod.in_channels:
                self._refuse([lay], f"feeds Conv2d {where} with a channel layout that does "
                             "not match")
                return
            self._use(lay, path, "conv_in", 1)
            return
        kind = "conv1d_in" if is_conv1d(mod) else "linear_in"
        n_in = in_channels(mod)
        if lay.kind == "vec" and lay.total == n_in:
            self._use(lay, path, kind, 1)
        elif lay.kind == "flat" and n_in % lay.total == 0:
            self._use(lay, path, kind, n_in // lay.total)
        else:
            self._refuse([lay], f"channel count {lay.total} does not match the inputs of "
                         f"{where} ({n_in})")

    def _depthwise(self, node: fx.Node, path: str, mod: nn.Conv2d) -> _Layout | None:
        lay = self._lay(node.args[0])
        if lay is None:
            self.not_producers[path] = ("depthwise Conv2d reading channels no producer of "
                                        "this graph owns")
            return None
        if lay.kind != "map" or lay.total != mod.in_channels or self.calls.get(path, 0) != 1:
            self._refuse([lay], f"feeds depthwise Conv2d {self._where(node)} with a layout that "
                         "does not match (or called several times)")
            return None
        self._use(lay, path, "dw", 1)
        return lay  # channel c in -> channel c out: the same spaces continue

    def _use(self, lay: _Layout, path: str, kind: str, mult: int) -> None:
        base = 0
        for space, size in lay.segs:
            self.spaces[space].uses.append(Use(path, kind, base, mult))
            base += size

    def _binary(self, node: fx.Node) -> _Layout | None:
        operands = [a for a in list(node.args) + list(node.kwargs.values())
                    if isinstance(a, fx.Node)]
        lays = [self.layout.get(a) for a in operands]
        known = [lay for lay in lays if lay is not None]
        if not known:
            return None
        where = self._where(node)
        if len(known) != len(lays):
            self._refuse(known, f"merged by {where} with a tensor whose channels are not "
                         "tracked (an input, parameter or unknown op)")
            return None
        first = known[0]
        for lay in known[1:]:
            if lay.kind != first.kind or [s for _, s in lay.segs] != [s for _, s in first.segs]:
                self._refuse(known, f"merged by {where} with channels laid out differently")
                return None
        for lay in known[1:]:  # the residual rule: equal channels of every operand go together
            for (a, _), (b, _) in zip(first.segs, lay.segs, strict=True):
                self._union(a, b)
        return first

    def _cat(self, node: fx.Node) -> _Layout | None:
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        lays = [self._lay(p) for p in parts]  # type: ignore[union-attr]
        known = [lay for lay in lays if lay is not None]
        if not known:
            return None
        if dim != 1 or len(known) != len(lays) or any(lay.kind != "map" for lay in known):
            self._refuse(known, f"concatenated by {self._where(node)} along a dimension other "
                         "than channels or with inputs whose channels are not tracked")
            return None
        ranks = {lay.ndim for lay in known}
        return _Layout(tuple(seg for lay in known for seg in lay.segs), "map",
                       ranks.pop() if len(ranks) == 1 else None)

    def _reduce(self, node: fx.Node) -> _Layout | None:
        """A mean/sum/amax/amin: passed through like a pool when its dims are known at trace
        time and leave the channels (and, for a map, the batch) out; the reduced dims go, so
        ``h.mean((2, 3))`` of an NCHW map is an [N, C] ``vec`` a Linear reads, and with
        ``keepdim=True`` the map keeps its rank. Refused when the channel dimension is
        reduced (channels would mix), or the dims are not literal numbers (unknown)."""
        lay = self._lay(node.args[0]) if node.args else None
        others = [self.layout.get(n) for n in node.all_input_nodes
                  if not node.args or n is not node.args[0]]
        where = self._where(node)
        self._refuse(others, f"reaches {where} as a non-input argument")
        if lay is None:
            return None
        dims, keepdim = _reduction_dims(node)
        if dims is None or not isinstance(keepdim, bool):
            self._refuse([lay], f"reduced by {where} over dims not known when traced")
            return None
        if not dims:
            self._refuse([lay], f"reduced by {where} over every dimension, its channels "
                         "included")
            return None
        if lay.kind == "flat":
            self._refuse([lay], f"reduced by {where} after a flatten (channels and positions "
                         "share that dimension)")
            return None
        rank = lay.ndim
        if rank is not None:
            if any(not -rank <= d < rank for d in dims):
                self._refuse([lay], f"reduced by {where} over dims {list(dims)} that a "
                             f"{rank}-D tensor does not have")
                return None
            dims = tuple(sorted({d % rank for d in dims}))
        channel = 1 if lay.kind == "map" else (rank - 1 if rank is not None else -1)
        if channel in dims:
            self._refuse([lay], f"reduced by {where} over its channel dimension")
            return None
        if lay.kind == "map" and (0 in dims or rank is None and any(d < 0 for d in dims)):
            self._refuse([lay], f"reduced by {where} over the batch dimension or dims of "
                         "unknown place (the channels would leave dim 1)")
            return None
        if lay.kind == "vec" and rank is None and any(d >= 0 for d in dims):
            self._refuse([lay], f"reduced by {where} over dims {list(dims)} of a tensor "
                         "whose rank is unknown (they may hold its channels: count them from "
                         "the end, e.g. dim=-2)")
            return None
        if keepdim:
            return lay
        left = rank - len(set(dims)) if rank is not None else None
        if lay.kind == "map" and left == 2:  # [N, C]: channels are the last dim
            return _Layout(lay.segs, "vec", 2)
        return _Layout(lay.segs, lay.kind, left)

    def _flatten(self, node: fx.Node, start: int | None) -> _Layout | None:
        lay = self._lay(node.args[0])
        if lay is None:
            return None
        if lay.kind == "flat" or (lay.kind == "map" and start == 1):
            return _Layout(lay.segs, "flat")
        self._refuse([lay], f"flatten {self._where(node)} does not flatten from the channel "
                     "dimension")
        return None

    # -- groups -----------------------------------------------------------------------------

    def _groups(self) -> list[Group]:
        by_root: dict[int, list[int]] = {}
        for s in range(len(self.spaces)):
            by_root.setdefault(self._find(s), []).append(s)
        groups = []
        for members in by_root.values():
            spaces = [self.spaces[s] for s in members]
            sizes = {sp.size for sp in spaces}
            refused = next((sp.refused for sp in spaces if sp.refused), None)
            if len(sizes) != 1:
                refused = refused or "coupled layers disagree on the channel count"
            producers = [sp.producer for sp in spaces]
            if refused and len(producers) > 1:
                refused = (f"{refused} [channel group of {len(producers)} coupled layers, "
                           f"with {', '.join(producers[:4])}{'...' if len(producers) > 4 else ''}]")
            groups.append(Group(producers[0], spaces[0].size, producers,
                                [u for sp in spaces for u in sp.uses], refused))
        return groups


def _reduction_dims(node: fx.Node) -> tuple[tuple[int, ...] | None, object]:
    """(dims, keepdim) of a reduction node as written (``dim=`` or ``axis=``, else the
    second argument; ``()`` for a reduction over every dimension), ``None`` for dims that
    are not literal integers (computed in the graph); keepdim as given (False if not)."""
    args, kwargs = node.args, node.kwargs
    if "dim" in kwargs or "axis" in kwargs:
        dim = kwargs.get("dim", kwargs.get("axis"))
    else:
        dim = args[1] if len(args) > 1 else None
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if dim is None:
        return (), keepdim
    items = dim if isinstance(dim, (tuple, list)) else (dim,)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in items):
        return None, keepdim
    return tuple(int(d) for d in items), keepdim


def _flatten_start(node: fx.Node) -> int | None:
    """start_dim of a flatten function/method node (``-99``: a partial flatten), else None."""
    if node.op == "call_function" and node.target is torch.flatten:
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        return int(start) if end == -1 else -99  # type: ignore[arg-type]
    if node.op == "call_method" and node.target == "flatten":
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        end = node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1)
        return int(start) if end == -1 else -99  # type: ignore[arg-type]
    return None


def channel_groups(model: nn.Module, blocks: set[str] | None = None
                   ) -> tuple[list[Group], dict[str, str]]:
    """The channel groups of ``model`` (raises if torch.fx cannot trace it), and the layers
    that are not producers with the reason (grouped convs). ``blocks``: module paths a module
    rule prunes; the graph keeps them as opaque single calls."""
    planner = _Planner(model, trace(model, blocks), blocks or set())
    return planner.run(), planner.not_producers

