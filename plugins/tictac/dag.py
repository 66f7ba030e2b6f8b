"""The worker's graph as TicTac sees it: compute ops plus one recv op per parameter tensor.

Why torch.fx: it gives the op graph of a PyTorch model without running it (also on the meta
device), so the same tracer serves the real zoo models and the simulator's large models.
A ``call_module`` node reads every parameter of its (leaf) module; a ``get_attr`` node that
names a parameter *is* that parameter's recv. dep(op) = the recvs an op transitively needs,
kept as Python-int bitsets (one bit per recv) so even ResNet-152 is built in milliseconds.

Two execution models, because they are different machines:

* ``dataflow`` (TensorFlow, the paper's setting): any op whose inputs are ready may run.
* ``eager`` (PyTorch, what accelopt's workers do): forward runs in program order, so op k
  also waits for op k-1. That program order is a real dependency, and adding it as a chain
  edge lets TIC/TAC reason about the machine the order is enforced on.

Training adds one backward op per forward compute op (it needs the forward op and the
backward ops of the op's users); backward needs no new recvs.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from accelopt.errors import UserError, first_line

Execution = Literal["eager", "dataflow"]
RECV, COMPUTE = "recv", "compute"


@dataclass
class Dag:
    """Ops in a topological order. ``recvs[i]`` is the op index of recv i (``named_parameters``
    order); ``program`` lists compute ops in program (execution) order."""

    names: list[str]
    kinds: list[str]
    inputs: list[tuple[int, ...]]
    nbytes: list[int]
    recvs: list[int]
    program: list[int]
    flops: list[float] = field(default_factory=list)
    mem_bytes: list[float] = field(default_factory=list)
    backward_of: dict[int, int] = field(default_factory=dict)
    """backward op -> its forward op (training DAGs only)."""
    model: str = ""

    @classmethod
    def from_spec(cls, recvs: dict[str, int], ops: list[tuple[str, list[str]]]) -> Dag:
        """A hand-written DAG: ``recvs`` name -> bytes, ``ops`` (name, input names) in
        program order (tests and examples)."""
        names = list(recvs)
        index = {n: i for i, n in enumerate(names)}
        inputs: list[tuple[int, ...]] = [() for _ in names]
        for name, ins in ops:
            index[name] = len(names)
            names.append(name)
            inputs.append(tuple(sorted(index[i] for i in ins)))
        kinds = [RECV] * len(recvs) + [COMPUTE] * len(ops)
        nbytes = list(recvs.values()) + [0] * len(ops)
        return cls(names, kinds, inputs, nbytes, list(range(len(recvs))),
                   list(range(len(recvs), len(names))))

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def recv_names(self) -> list[str]:
        return [self.names[i] for i in self.recvs]

    @property
    def recv_bytes(self) -> np.ndarray:
        return np.array([self.nbytes[i] for i in self.recvs], dtype=np.float64)

    def fingerprint(self) -> str:
        """Identifies the structure (ops, recvs, bytes): a cache keyed by it goes stale when
        the model changes."""
        import hashlib

        h = hashlib.sha256()
        for name, kind, ins, nb in zip(self.names, self.kinds, self.inputs, self.nbytes,
                                       strict=True):
            h.update(f"{name}|{kind}|{','.join(map(str, ins))}|{nb};".encode())
        return h.hexdigest()[:16]

    def users(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.n)]
        for op, ins in enumerate(self.inputs):
            for i in ins:
                out[i].append(op)
        return out

    def dep_bits(self, execution: Execution = "dataflow") -> list[int]:
        """dep(op) as an int bitset over recv indices; ``eager`` adds the program-order chain."""
        bit = {op: 1 << r for r, op in enumerate(self.recvs)}
        dep = [0] * self.n
        prev: dict[int, int] = {}
        if execution == "eager":
            prev = {b: a for a, b in zip(self.program, self.program[1:], strict=False)}
        for op in range(self.n):  # ops are topologically ordered, the program order too
            if self.kinds[op] == RECV:
                dep[op] = bit[op]
                continue
            d = 0
            for i in self.inputs[op]:
                d |= dep[i]
            if op in prev:
                d |= dep[prev[op]]
            dep[op] = d
        return dep

    def dep_matrix(self, execution: Execution = "dataflow") -> np.ndarray:
        """Compute ops (program order) x recvs, True where the op needs the recv."""
        bits = self.dep_bits(execution)
        nr = len(self.recvs)
        nbytes = (nr + 7) // 8
        rows = [bits[op].to_bytes(nbytes, "little") if nr else b"" for op in self.program]
        if not rows or nr == 0:
            return np.zeros((len(self.program), nr), dtype=bool)
        raw = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), nbytes)
        return np.unpackbits(raw, axis=1, bitorder="little")[:, :nr].astype(bool)


class _Tracer(fx.Tracer):
    """Remembers the module being traced, so a failure can name it."""

    def __init__(self) -> None:
        super().__init__()
        self.current: list[tuple[str, str]] = []

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        path = self.path_of_module(m)
        self.current.append((path, type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.current.pop()
        return out


def trace(model: nn.Module, name: str = "", labels: bool = False) -> fx.GraphModule:
    """``torch.fx`` graph of ``model``; a model fx cannot trace is one line naming the module.
    ``labels``: the graph is of the call a model computing its own loss (``loss: model``) is
    given, ``model(x, labels=y)``: it takes ``(x, labels)`` and holds the model's parameters
    under :data:`LABELLED_PREFIX`."""
    tracer = _Tracer()
    root: nn.Module = _WithLabels(model) if labels else model
    try:
        graph = tracer.trace(root, concrete_args=None if labels else
                             _defaults_after_the_input(model) or None)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        where = tracer.current[-1] if tracer.current else ("", type(model).__name__)
        path = where[0].removeprefix(LABELLED_PREFIX) if labels else where[0]
        path = "<root>" if path in ("", LABELLED_PREFIX.rstrip(".")) else path
        first = first_line(exc) or type(exc).__name__
        raise UserError(
            f"tictac: torch.fx cannot trace module '{path}' ({where[1]}) of model "
            f"'{name or type(model).__name__}': {first}"
        ) from None
    return fx.GraphModule(tracer.root, graph)


LABELLED_PREFIX = "model."
"""What the names in a graph traced with labels carry before the model's own names."""


class _WithLabels(nn.Module):
    """``forward(x, labels)`` calls ``model(x, labels=labels)``, the job's call under ``loss:
    model``. fx traces through it into the model's forward, whose other parameters keep
    their defaults as Python values (so ``mask is None`` holds), while ``labels`` is an
    input and ``labels is None`` is False: the graph holds the model's loss, as it runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Any, labels: Any) -> Any:
        return self.model(x, labels=labels)


def _defaults_after_the_input(model: nn.Module) -> dict[str, Any]:
    """The forward's parameters after its first, with their defaults, held at those values
    while fx traces: a job whose loss is computed outside the model calls it with its one
    input, so ``forward(x, labels=None)`` runs with ``labels`` None. Traced as placeholders
    instead, ``labels is None`` is False on the proxy and the graph bakes in the loss
    branch, which then fails when run without labels. (A job under ``loss: model`` calls it
    with its labels: :func:`trace` with ``labels``.)"""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params[1:]
            if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


@dataclass
class Traced:
    """A model's op graph and the flat positional inputs that run it (``gm(*example)``)."""

    gm: fx.GraphModule
    example: tuple[torch.Tensor, ...]
    how: str
    """``torch.fx`` (symbolic, the model's own modules) or ``torch.export`` (ATen ops, run
    once on the real inputs: models fx cannot trace, and models of several inputs)."""
    prefix: str = ""
    """What the graph's parameter names carry before the model's own names."""


class _FlatInputs(nn.Module):
    """Calls ``model`` with its inputs rebuilt from flat tensors, so an exported graph takes
    one placeholder per tensor whatever the inputs' structure (a tuple, a mapping)."""

    def __init__(self, model: nn.Module, spec: Any, leaves: list[Any]) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.leaves = leaves
        self.slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def forward(self, *tensors: torch.Tensor) -> Any:
        from torch.utils import _pytree

        leaves = list(self.leaves)
        for slot, t in zip(self.slots, tensors, strict=True):
            leaves[slot] = t
        args, kwargs = _pytree.tree_unflatten(leaves, self.spec)
        return self.model(*args, **kwargs)


def _as_call(model: nn.Module, inputs: Any,
             labels: torch.Tensor | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) as the job's step calls the model (``accelopt.job.inputs.call``), with
    ``labels=`` where given (``loss: model``); a model that can return a key-value cache is
    asked not to (the trace needs no cache)."""
    import inspect
    from collections.abc import Mapping

    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    try:
        takes = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = {}
    if "use_cache" in takes and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    if labels is not None:
        kwargs["labels"] = labels
    return args, kwargs


def _first_line(exc: BaseException) -> str:
    return (first_line(exc) or type(exc).__name__)[:200]


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """A failed torch.export prints its partial graph to stderr and logs at WARNING; the
    one-line reason is what the plugin reports, so both are held back while it tries."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def trace_inputs(model: nn.Module, inputs: Any, name: str = "",
                 labels: torch.Tensor | None = None) -> Traced:
    """The op graph of ``model`` on the job's real ``inputs``: ``torch.fx`` first (symbolic,
    one tensor input), then ``torch.export`` (non-strict: runs the forward once on the
    inputs, so data-dependent Python, HF's models and several inputs trace). A model neither
    traces is one line with both reasons (the plugin falls back to the default order).

    ``labels``: the job's labels where the model computes its own loss (``loss: model``),
    which the job's step passes as ``labels=``: the graph is of that call, loss included.
    Traced without them, an encoder-decoder (T5, BART: its decoder's inputs are made from
    the labels) could not be traced at all, and another model was timed without its loss."""
    from torch.utils import _pytree

    fx_why = "torch.fx: not tried (the model takes several inputs)"
    if isinstance(inputs, torch.Tensor):
        try:
            if labels is None:
                return Traced(trace(model, name), (inputs,), "torch.fx")
            return Traced(trace(model, name, labels=True), (inputs, labels), "torch.fx",
                          prefix=LABELLED_PREFIX)
        except UserError as exc:
            fx_why = str(exc).removeprefix("tictac: ")
    args, kwargs = _as_call(model, inputs, labels)
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    flat = _FlatInputs(model, spec, leaves)
    example = tuple(v for v in leaves if isinstance(v, torch.Tensor))
    try:
        with torch.no_grad(), _quiet_torch_logs():
            gm = torch.export.export(flat, example, strict=False).module()
    except Exception as exc:  # export raises many types (Unsupported, RuntimeError, ...)
        given = " (called with labels=, as the job calls it)" if labels is not None else ""
        raise UserError(
            f"tictac: cannot trace model '{name or type(model).__name__}'{given}: {fx_why}; "
            f"torch.export: {_first_line(exc)}"
        ) from None
    return Traced(gm, example, "torch.export", prefix="model.")  # type: ignore[arg-type]


def build_dag(model: nn.Module, name: str = "", gm: fx.GraphModule | None = None,
              prefix: str = "") -> Dag:
    """Forward DAG of ``model``: compute ops from the fx graph, one recv per parameter. A
    graph from ``torch.export`` holds copies of the parameters under ``prefix`` + the model's
    names, so a ``get_attr`` is matched by name when its object is not the model's own."""
    gm = trace(model, name) if gm is None else gm
    params = dict(model.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), n)
    shared = {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    names: list[str] = []
    kinds: list[str] = []
    inputs: list[tuple[int, ...]] = []
    nbytes: list[int] = []
    recv_of: dict[str, int] = {}
    for pname, p in params.items():  # recvs first, in named_parameters order
        recv_of[pname] = len(names)
        names.append(pname)
        kinds.append(RECV)
        inputs.append(())
        nbytes.append(p.numel() * p.element_size())
    node_op: dict[fx.Node, int] = {}
    program: list[int] = []
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            target = str(node.target)
            obj = _attr(gm, target)
            own = target[len(prefix):] if prefix and target.startswith(prefix) else target
            if isinstance(obj, nn.Parameter) and id(obj) in by_id:
                node_op[node] = recv_of[by_id[id(obj)]]
            elif isinstance(obj, torch.Tensor) and own in shared:
                node_op[node] = recv_of[shared[own]]
            continue
        ins = {node_op[a] for a in node.all_input_nodes if a in node_op}
        if node.op == "call_module":
            mod = modules[str(node.target)]
            ins |= {recv_of[by_id[id(p)]] for p in mod.parameters() if id(p) in by_id}
        node_op[node] = len(names)
        program.append(len(names))
        names.append(str(node.name))
        kinds.append(COMPUTE)
        inputs.append(tuple(sorted(ins)))
        nbytes.append(0)
    return Dag(names, kinds, inputs, nbytes, list(range(len(params))), program, model=name)


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def training_dag(fwd: Dag) -> Dag:
    """Add backward: bwd(op) needs fwd(op) and bwd(u) for every compute user u of op. The
    program runs backward in reverse forward order (autograd's order for a chain)."""
    users = fwd.users()
    names, kinds = list(fwd.names), list(fwd.kinds)
    inputs, nbytes = list(fwd.inputs), list(fwd.nbytes)
    flops, mem = list(fwd.flops), list(fwd.mem_bytes)
    bwd: dict[int, int] = {}
    program = list(fwd.program)
    backward_of: dict[int, int] = {}
    for op in reversed(fwd.program):
        ins = [op] + [bwd[u] for u in users[op] if u in bwd]
        bwd[op] = len(names)
        backward_of[len(names)] = op
        program.append(len(names))
        names.append(f"{fwd.names[op]}.backward")
        kinds.append(COMPUTE)
        inputs.append(tuple(sorted(ins)))
        nbytes.append(0)
        if fwd.flops:
            flops.append(2 * fwd.flops[op])
            mem.append(2 * fwd.mem_bytes[op])
    # bwd ops were appended in reverse forward order, and each one's inputs come earlier
    return Dag(names, kinds, inputs, nbytes, list(fwd.recvs), program, flops, mem,
               backward_of, fwd.model)


def annotate_costs(dag: Dag, gm: fx.GraphModule, example: torch.Tensor) -> None:
    """FLOPs and bytes touched per forward op, from shapes (works on the meta device)."""
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(example)
    modules = dict(gm.named_modules())
    by_name = {dag.names[op]: op for op in dag.program}
    dag.flops = [0.0] * dag.n
    dag.mem_bytes = [0.0] * dag.n
    for node in gm.graph.nodes:
        op = by_name.get(str(node.name))
        if op is None:
            continue
        out = _numel(node.meta.get("tensor_meta"))
        ins = sum(_numel(a.meta.get("tensor_meta")) for a in node.all_input_nodes)
        flops = float(out)
        pbytes = 0.0
        if node.op == "call_module":
            mod = modules[str(node.target)]
            pbytes = float(sum(p.numel() for p in mod.parameters()))
            if isinstance(mod, nn.Conv2d):
                k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
                flops = 2.0 * out * k
            elif isinstance(mod, nn.Linear):
                flops = 2.0 * out * mod.in_features
        dag.flops[op] = flops
        dag.mem_bytes[op] = 4.0 * (out + ins + pbytes)


def _numel(meta: Any) -> int:
    if meta is None:
        return 0
    if hasattr(meta, "shape"):
        n = 1
        for d in meta.shape:
            n *= int(d)
        return n
    if isinstance(meta, (list, tuple)):
        return sum(_numel(m) for m in meta)
    if isinstance(meta, dict):
        return sum(_numel(m) for m in meta.values())
    return 0
