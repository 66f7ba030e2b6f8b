"""What a cluster run needs to know about the job's model: its parameters in layer order,
how they are sharded over servers, and how a global batch is split over workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor. ``index`` is its position in :func:`param_table` (the id both
    ends of a transfer share); ``layer_index`` the position of its owning module among the
    modules that own parameters, in forward (module) order."""

    index: int
    name: str
    layer_index: int
    nbytes: int
    module: str


def param_table(model: nn.Module) -> list[ParamInfo]:
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
            out.append(ParamInfo(len(out), name, layer, p.numel() * p.element_size(), path))
        layer += 1
    return out


def layer_modules(model: nn.Module, table: list[ParamInfo]) -> dict[int, nn.Module]:
    """layer_index -> the module that owns those parameters (forward pre-hooks go there)."""
    modules = dict(model.named_modules())
    return {p.layer_index: modules[p.module] for p in table}


def shard_by_bytes(table: list[ParamInfo], servers: int) -> list[list[ParamInfo]]:
    """Balance parameter bytes over ``servers``: largest tensor first onto the least loaded
    server (ties: lowest server). Each shard keeps layer order."""
    load = [0] * servers
    shards: list[list[ParamInfo]] = [[] for _ in range(servers)]
    for info in sorted(table, key=lambda p: (-p.nbytes, p.index)):
        target = min(range(servers), key=lambda s: (load[s], s))
        load[target] += info.nbytes
        shards[target].append(info)
    return [sorted(shard, key=lambda p: p.index) for shard in shards]


def buckets_by_bytes(table: list[ParamInfo], bucket_bytes: int) -> list[list[ParamInfo]]:
    """Gradient buckets in backward order (last layer first), each up to ``bucket_bytes``
    (a tensor larger than a bucket gets a bucket of its own), like PyTorch DDP."""
    buckets: list[list[ParamInfo]] = []
    current: list[ParamInfo] = []
    size = 0
    for info in reversed(table):
        if current and size + info.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(info)
        size += info.nbytes
    if current:
        buckets.append(current)
    return buckets


def shard_rows(batch_size: int, workers: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of the global batch each worker takes: contiguous, sizes differ by
    at most one (``torch.tensor_split``)."""
    bounds = [len(t) for t in torch.tensor_split(torch.empty(batch_size), workers)]
    out, start = [], 0
    for n in bounds:
        out.append((start, start + n))
        start += n
    return out
