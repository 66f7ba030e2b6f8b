"""The vDNN engine: saved-tensor hooks that offload feature maps and prefetch them back.

Why this shape (Rhu et al., MICRO 2016): the feature maps a layer saves for backward are not
touched again until that layer's backward, so they can leave device memory during forward and
come back just before they are needed. Two things distinguish vDNN from PyTorch's
``save_on_cpu``, and both are here:

* **Asynchronous offload.** On CUDA the device->host copy runs on a side stream (after the
  producing kernels), into pinned host memory, and the device tensor is released as soon as
  the copy is done (``record_stream`` keeps the caching allocator from reusing it earlier).
* **Prefetch.** Saved tensors are grouped by the leaf layer whose forward saved them. When
  backward first unpacks a tensor of layer ``g``, the engine starts copying the tensors of
  layers ``g-1 .. g-prefetch_layers`` back on the side stream, so they are on the device when
  backward reaches those layers; ``save_on_cpu`` copies each one synchronously on demand. At
  the end of forward the last layers are prefetched at once (backward starts with them).

Parameters are never offloaded: a saved tensor whose storage is a parameter's storage (the
weight itself or a view such as ``weight.t()``) is returned as is. Tensors whose layout cannot
be reproduced exactly (overlapping or non-dense strides) stay resident, so the values and
strides backward sees are exactly those of the run without offloading and the gradients are
bitwise identical.

On a CPU the same code path runs (the "host" copy is another CPU tensor and no stream
exists); the engine's byte counts then say what would leave device memory on a GPU.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

POLICIES = ("all", "conv", "size")


@dataclass
class PassStats:
    """Byte counts of one forward/backward pass (one training iteration)."""

    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    resident_bytes: int = 0
    """Saved non-parameter bytes kept on the device (policy said no, or layout not dense)."""
    resident_tensors: int = 0
    param_bytes: int = 0
    """Saved tensors that are parameters (or views of them): never offloaded."""
    deduplicated: int = 0
    prefetched: int = 0
    """First unpacks served by a prefetch started ahead of need (a second unpack of the
    same feature map reuses the copy and counts in neither)."""
    fetched_on_demand: int = 0
    """Unpacks that had to copy synchronously (a prefetch miss)."""


@dataclass
class Totals:
    passes: int = 0
    stats: PassStats = field(default_factory=PassStats)
    max_offloaded_bytes: int = 0

    def add(self, s: PassStats) -> None:
        self.passes += 1
        self.max_offloaded_bytes = max(self.max_offloaded_bytes, s.offloaded_bytes)
        for name in PassStats.__dataclass_fields__:
            setattr(self.stats, name, getattr(self.stats, name) + getattr(s, name))


class _Handle:
    """What autograd keeps instead of the feature map: the host copy and, once prefetched,
    the device copy with the event that says it has arrived."""

    __slots__ = ("__weakref__", "device", "device_copy", "event", "group", "host", "nbytes",
                 "unpacked")

    def __init__(self, host: torch.Tensor, device: torch.device, group: int, nbytes: int,
                 event: Any) -> None:
        self.host = host
        self.device = device
        self.group = group
        self.nbytes = nbytes
        self.event = event  # offload finished (CUDA) / None
        self.device_copy: torch.Tensor | None = None
        self.unpacked = False


def dense_layout(t: torch.Tensor) -> bool:
    """True when ``t``'s strides describe a dense, non-overlapping block of memory, so an
    ``empty_strided`` copy with the same strides holds exactly the same elements."""
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return False
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return True
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _is_conv(type_name: str) -> bool:
    return type_name.startswith("Conv") or type_name.startswith("LazyConv")


class OffloadEngine:
    """One per job. ``install(module)`` makes ``module``'s forward run under the engine's
    saved-tensor hooks; ``track(root)`` lets it know the model (parameters, pass boundary)."""

    def __init__(self, *, policy: str = "all", min_bytes: int = 0, prefetch_layers: int = 1,
                 pin_memory: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.policy = policy
        self.min_bytes = int(min_bytes)
        self.prefetch_layers = int(prefetch_layers)
        self.pin_memory = pin_memory
        self.totals = Totals()
        self.current = PassStats()
        self.installed: list[str] = []
        self._root: weakref.ReferenceType[nn.Module] | None = None
        self._param_ptrs: set[int] = set()
        self._group = 0
        self._group_type = ""
        self._groups: dict[int, list[weakref.ReferenceType[_Handle]]] = {}
        self._dedupe: dict[tuple[Any, ...], tuple[weakref.ReferenceType[torch.Tensor], _Handle]] = {}
        self._group_ids: list[int] = []
        self._contexts: list[Any] = []
        self._stream: Any = None
        self._leaf_hooked: set[int] = set()

    # -- installation ------------------------------------------------------------------

    def track(self, root: nn.Module) -> None:
        """The whole model: its parameters are never offloaded, and its forward marks the
        start of a new pass (statistics of the previous one are closed)."""
        self._root = weakref.ref(root)
        root.register_forward_pre_hook(self._root_pre, prepend=True)
        root.register_forward_hook(self._root_post, always_call=True)

    def install(self, module: nn.Module, path: str) -> nn.Module:
        """Run ``module``'s forward inside the offloading hooks (the module itself is kept:
        parameter names and state_dict keys do not change)."""
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit, always_call=True)
        for sub in module.modules():
            if not list(sub.children()) and id(sub) not in self._leaf_hooked:
                self._leaf_hooked.add(id(sub))
                sub.register_forward_pre_hook(self._leaf_pre)
                sub.register_forward_hook(self._leaf_post)
        self.installed.append(path or "<model>")
        return module

    # -- forward-time hooks (native torch hooks, no plugin machinery) -------------------

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.close_pass()
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._group, self._group_type = 0, ""

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        # backward begins with the last layers: bring them back now
        self._dedupe.clear()
        if self.prefetch_layers > 0:
            self._prefetch_before(self._group + 1)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._root is None:  # installed on a layer of a model never tracked
            self._param_ptrs |= {p.untyped_storage().data_ptr() for p in module.parameters()}
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self._contexts.append(ctx)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)

    def _leaf_pre(self, module: nn.Module, args: Any) -> None:
        self._group += 1
        self._group_type = type(module).__name__

    def _leaf_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._group_type = ""  # ops between layers belong to no convolution

    # -- saved-tensor hooks ---------------------------------------------------------------

    def _wanted(self, t: torch.Tensor, nbytes: int) -> bool:
        if self.policy == "conv" and not _is_conv(self._group_type):
            return False
        if self.policy == "size" and nbytes < self.min_bytes:
            return False
        return dense_layout(t)

    def pack(self, t: torch.Tensor) -> Any:
        s = self.current
        nbytes = t.numel() * t.element_size()
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            ptr = None
        if ptr is not None and ptr in self._param_ptrs:
            s.param_bytes += nbytes
            return t
        if ptr is None or t.device.type == "meta" or not self._wanted(t, nbytes):
            s.resident_bytes += nbytes
            s.resident_tensors += 1
            return t
        key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        seen = self._dedupe.get(key)
        # the first tensor must still be alive: otherwise its memory may have been reused
        # by a new tensor with the same address, shape and version
        if seen is not None and seen[0]() is not None:
            s.deduplicated += 1
            return seen[1]
        handle = self._offload(t, nbytes)
        self._dedupe[key] = (weakref.ref(t), handle)
        if self._group not in self._groups:
            self._groups[self._group] = []
            self._group_ids.append(self._group)  # ascending: groups are numbered in order
        self._groups[self._group].append(weakref.ref(handle))
        s.offloaded_bytes += nbytes
        s.offloaded_tensors += 1
        return handle

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed  # type: ignore[no-any-return]
        out = packed.device_copy
        if out is None:
            self.current.fetched_on_demand += 1
            out = self._fetch(packed, sync=True)
            packed.device_copy = out
        else:
            if not packed.unpacked:
                self.current.prefetched += 1
            if packed.event is not None:
                stream = torch.cuda.current_stream(packed.device)
                stream.wait_event(packed.event)
                out.record_stream(stream)
        packed.unpacked = True
        # kept until the handle dies with its autograd nodes: a tensor saved by two layers
        # (a ReLU's output and the next layer's input) is unpacked twice, copied once
        self._prefetch_before(packed.group)
        return out

    # -- copies ----------------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _offload(self, t: torch.Tensor, nbytes: int) -> _Handle:
        cuda = t.device.type == "cuda"
        host = torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device="cpu",
            pin_memory=self.pin_memory and cuda,
        )
        event = None
        if cuda:
            side = self._side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            t.record_stream(side)  # the allocator may reuse t only after the copy
        else:
            host.copy_(t.detach())
        return _Handle(host, t.device, self._group, nbytes, event)

    def _fetch(self, h: _Handle, sync: bool) -> torch.Tensor:
        if h.device.type != "cuda":
            return h.host  # same memory space: the host copy is what backward reads
        if sync:
            if h.event is not None:
                h.event.synchronize()
            return h.host.to(h.device, non_blocking=False)
        side = self._side_stream(h.device)
        with torch.cuda.stream(side):
            # same strides as the original: empty_strided + copy_, not .to()
            dev = torch.empty_strided(h.host.shape, h.host.stride(), dtype=h.host.dtype,
                                      device=h.device)
            dev.copy_(h.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        h.event = event
        return dev

    def _prefetch_before(self, group: int) -> None:
        """vDNN's prefetch: the next ``prefetch_layers`` layers backward will reach (the
        closest earlier layers that still have feature maps on the host)."""
        ids = self._group_ids
        pos = bisect.bisect_left(ids, group)
        for g in ids[max(0, pos - self.prefetch_layers):pos]:
            self._prefetch_group(g)

    def _prefetch_group(self, g: int) -> None:
        refs = self._groups.pop(g, None)
        if not refs:
            return
        self._group_ids.remove(g)
        for ref in refs:
            h = ref()
            if h is not None and h.device_copy is None:
                h.device_copy = self._fetch(h, sync=False)

    # -- results ---------------------------------------------------------------------------

    def close_pass(self) -> None:
        s = self.current
        if s.offloaded_tensors or s.resident_tensors or s.param_bytes:
            self.totals.add(s)
        self.current = PassStats()
        self._groups.clear()
        self._group_ids.clear()
        self._dedupe.clear()


def install_on(model: nn.Module, engine: OffloadEngine,
               paths: Iterable[str] | None = None,
               select: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Convenience for benchmarks and tests (the plugin uses the layer hook instead):
    install on the whole model, or on the submodules ``select`` picks."""
    engine.track(model)
    if select is None and paths is None:
        return engine.install(model, "")
    wanted = set(paths or ())
    taken: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in taken):
            continue
        if path in wanted or (select is not None and path and select(path, module)):
            engine.install(module, path)
            taken.append(path)
    return model
