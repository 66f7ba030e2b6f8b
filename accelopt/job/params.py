"""A job's parameters as the runtime moves them: the parameter table (names, shapes, bytes,
layer order), gradient buckets, shards over parameter servers, and rows of a batch per worker.

These are facts of the built model, computed once by the core and carried in
:class:`accelopt.types.JobInfo`, so no plugin has to rebuild a job to learn them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from accelopt.errors import UserError
from accelopt.types import ParamInfo


def param_table(model: nn.Module) -> tuple[ParamInfo, ...]:
    """Every distinct parameter in module order; a tied parameter is listed once, under the
    first module that owns it. A model with uninitialized parameters is refused
    (:func:`refuse_lazy`)."""
    refuse_lazy(model)
    out: list[ParamInfo] = []
    seen: set[int] = set()
    layer = 0
    for path, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        for n, p in own:
            seen.add(id(p))
            name = f"{path}.{n}" if path else n
            out.append(ParamInfo(
                index=len(out), name=name, layer_index=layer,
                nbytes=p.numel() * p.element_size(), module=path, shape=tuple(p.shape),
                dtype=str(p.dtype).removeprefix("torch."),
            ))
        layer += 1
    return tuple(out)


def refuse_lazy(model: nn.Module) -> None:
    """A model whose parameters are not materialised yet (a lazy module: ``nn.LazyLinear``,
    ``nn.LazyConv2d``, ... before its first forward pass), refused in one line naming the
    first such parameter and the fix. Why not materialise it here with one batch: the shapes
    are what the runtime plans with (the parameter table, buckets, shards, the optimizer
    the core builds, the plugins' ``accelopt_layer_build``), all before any batch is drawn,
    and a forward pass on the user's behalf would run their code and draw from the RNG
    where the user did not; torch itself raises deep in the first use, several lines long."""
    for name, param in model.named_parameters():
        if nn.parameter.is_lazy(param):
            lazy = [type(m).__name__ for m in model.modules()
                    if isinstance(m, nn.modules.lazy.LazyModuleMixin)]
            raise UserError(
                f"the model has uninitialized parameters ('{name}' of a lazy module, "
                f"{lazy[0] if lazy else 'nn.Lazy*'}): run one forward pass on a batch before "
                "handing the model over (model(example)), or give the layer its input size "
                "(nn.Linear instead of nn.LazyLinear)")


def layer_modules(model: nn.Module, table: Sequence[ParamInfo]) -> dict[int, nn.Module]:
    """layer_index -> the module that owns those parameters (forward pre-hooks go there)."""
    modules = dict(model.named_modules())
    return {p.layer_index: modules[p.module] for p in table}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter -> the name :func:`param_table` lists it under
    (``{"out.weight": "emb.weight"}`` for an output layer sharing the embedding's weight).

    Why: ``named_parameters()`` and the table list a tied parameter once, but
    ``state_dict()`` has an entry per name; whatever moves or reports parameters by name must
    treat the aliases as the parameter they are, not as extra state (a stale copy of one,
    loaded after the true value into the shared storage, overwrites it)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def alias_layer_modules(model: nn.Module, table: Sequence[ParamInfo]) -> dict[str, set[int]]:
    """Module path -> the layers whose tied parameters that module also holds (its own
    parameters being listed under another module): a forward pre-hook on such a module must
    wait for those layers too, since the listed owner's forward may never run (an output
    layer tied to an embedding that the model never calls)."""
    layer_of = {p.name: p.layer_index for p in table}
    out: dict[str, set[int]] = {}
    for alias, canonical in tied_aliases(model).items():
        module = alias.rpartition(".")[0]
        out.setdefault(module, set()).add(layer_of[canonical])
    return out


def shard_by_bytes(table: Sequence[ParamInfo], servers: int) -> list[list[ParamInfo]]:
    """Balance parameter bytes over ``servers``: largest tensor first onto the least loaded
    server (ties: lowest server). Each shard keeps layer order."""
    load = [0] * servers
    shards: list[list[ParamInfo]] = [[] for _ in range(servers)]
    for info in sorted(table, key=lambda p: (-p.nbytes, p.index)):
        target = min(range(servers), key=lambda s: (load[s], s))
        load[target] += info.nbytes
        shards[target].append(info)
    return [sorted(shard, key=lambda p: p.index) for shard in shards]


def buckets_by_bytes(table: Sequence[ParamInfo], bucket_bytes: int,
                     model: nn.Module | None = None) -> tuple[tuple[int, ...], ...]:
    """Gradient buckets in backward order (last layer first), as indices into ``table``.
    A bucket closes as soon as it holds ``bucket_bytes`` or more: PyTorch DDP's rule when it
    rebuilds its buckets after the first iteration, so in all-reduce mode these are the
    buckets DDP reduces (for a model whose gradients arrive in reverse layer order).

    With ``model`` (the module ``table`` describes), its frozen parameters
    (``requires_grad=False``) are left out, as DDP leaves them out: they have no gradient,
    and a bucket holding one would send its slot as zeros (a frozen backbone under a
    trainable head sent 65x DDP's bytes).

    Like DDP, each dtype fills buckets of its own (a bucket is one flat buffer of one dtype):
    buckets are listed in the order they close, then the ones left open in the order their
    dtype first appears. Why: a bucket mixing float32 and float64 gradients would be sent
    as one float64 tensor, twice the float32 bytes its record names, and never matches a
    DDP bucket, so every one would be cut and copied."""
    buckets: list[tuple[int, ...]] = []
    filling: dict[str, list[int]] = {}  # dtype -> its open bucket's indices
    filled: dict[str, int] = {}  # dtype -> its open bucket's bytes
    frozen = set() if model is None else {
        name for name, p in model.named_parameters() if not p.requires_grad}
    for info in reversed(table):
        if info.name in frozen:
            continue
        filling.setdefault(info.dtype, []).append(info.index)
        filled[info.dtype] = filled.get(info.dtype, 0) + info.nbytes
        if filled[info.dtype] >= bucket_bytes:
            buckets.append(tuple(filling.pop(info.dtype)))
            del filled[info.dtype]
    buckets.extend(tuple(indices) for indices in filling.values())
    return tuple(buckets)


def shard_rows(batch_size: int, workers: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of the global batch each worker takes: contiguous, sizes differ by
    at most one (``torch.tensor_split``)."""
    bounds = [len(t) for t in torch.tensor_split(torch.empty(batch_size), workers)]
    out, start = [], 0
    for n in bounds:
        out.append((start, start + n))
        start += n
    return out


def replaced_parameters(built: dict[str, nn.Parameter], model: nn.Module) -> list[str]:
    """The names of ``built``'s parameters (``dict(model.named_parameters())`` when an
    exchange was attached to them) that ``model`` now holds as other objects: a plugin's
    ``lin.weight = nn.Parameter(...)`` leaves the exchange (a PS server, DDP) moving the old
    tensor while the optimizer steps the new one."""
    now = dict(model.named_parameters())
    return [name for name, param in built.items() if now.get(name) is not param]
