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
weight itself or a view such as ``weight.t()``) stays on the device, and so does autocast's
cast of a parameter that requires grad (``weight.to(bf16)``, or a view of it), recognised by
its autograd node and counted with the parameters. Tensors whose layout cannot
be reproduced exactly (overlapping or non-dense strides) stay resident, so the values and
strides backward sees are exactly those of the run without offloading and the gradients are
bitwise identical.

Saved-tensor hooks switch off autograd's own check that a saved tensor was not modified in
place before backward used it, so the engine makes that check itself: every packed tensor
carries the version it was saved at, and unpacking one that changed raises the error torch
raises without the hooks (an offloaded tensor is watched while it is alive: at every layer
boundary of the forward and at the unpack).

Counting: a counting period is one training iteration when the owner marks iterations
(:meth:`OffloadEngine.begin_iteration` / :meth:`OffloadEngine.end_iteration`; the plugin does
at ``accelopt_iteration_start/_end``), else one grad-enabled forward of the tracked model with
its backward. Bytes kept on the device are counted once per storage per forward pass, at the
storage's size (a tensor saved twice, or an expanded view of a small buffer, is the memory
behind it); parameters once per storage per period. Saves of the tracked model outside the
layers the engine is installed on are counted as resident, so the offloaded share is of the
whole model's saved tensors. A storage is counted once, as offloaded or as resident: where one
save keeps it on the device (a ReLU saves its output) and another would offload it (the next
convolution saves the same tensor as its input), it stays resident, and that save is not
copied out at all, in either order of the two saves (``kept_shared``): the copy would free
nothing, since the device memory stays.

A call of an installed layer that runs under the caller's own saved-tensor hooks is left to
them: ``torch.utils.checkpoint`` (non-reentrant) saves through its hooks and drops the tensors,
recomputing them in backward; the engine's hooks, entered inside, would be innermost and win,
so checkpointing would stop in silence (the forward never recomputed: BatchNorm's running
statistics updated once instead of twice, feature maps copied that checkpoint drops). So the
engine enters its hooks only where the innermost saved-tensor hooks are its own or none, and
never for a forward that runs during backward (checkpoint's recomputation, reentrant or not):
that forward is not another pass, and what it saves is used at once. Those calls are counted
(``left_to_caller``); what they save is neither offloaded nor counted.

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
from torch.nn.modules.conv import _ConvNd
from torch.utils.hooks import RemovableHandle

POLICIES = ("all", "conv", "size")


@dataclass
class PassStats:
    """Counts of one counting period: a training iteration where the owner marks iterations,
    else one forward pass with its backward."""

    offloaded_bytes: int = 0
    """Bytes copied to the host (a tensor saved twice is copied, and counted, once)."""
    offloaded_tensors: int = 0
    resident_bytes: int = 0
    """Device memory that saved non-parameter tensors keep (policy said no, layout not dense,
    or saved outside the layers the engine is installed on): each distinct storage once per
    forward pass, at its size."""
    resident_tensors: int = 0
    """Distinct storages behind ``resident_bytes``."""
    kept_shared: int = 0
    """Saves the policy picked that stayed on the device because another save of the same
    forward keeps their storage there (a ReLU's output saved by the ReLU and by the next
    convolution): copying them out would free nothing, so they count as resident, once."""
    param_bytes: int = 0
    """Parameter storages saved (the weight or a view of it), each once: never offloaded.
    Under autocast, a parameter's cast copy saved instead is counted here, at the copy's
    size, once per parameter and dtype."""
    forwards: int = 0
    """Grad-enabled forward passes of the tracked model."""
    deduplicated: int = 0
    prefetched: int = 0
    """First unpacks served by a prefetch started ahead of need (a second unpack of the
    same feature map reuses the copy and counts in neither)."""
    fetched_on_demand: int = 0
    """Unpacks that had to copy synchronously (a prefetch miss)."""
    left_to_caller: int = 0
    """Calls of installed layers left to the caller's saved-tensor hooks: run under
    ``torch.utils.checkpoint`` (or hooks of the caller's own), or recomputed by a reentrant
    checkpoint during backward. A non-reentrant checkpoint's recomputation is the same call
    again and is not counted twice."""


@dataclass
class Totals:
    passes: int = 0
    """Counting periods closed: iterations, or forward passes where no iteration is marked."""
    stats: PassStats = field(default_factory=PassStats)
    max_offloaded_bytes: int = 0

    def add(self, s: PassStats) -> None:
        self.passes += 1
        self.max_offloaded_bytes = max(self.max_offloaded_bytes, s.offloaded_bytes)
        for name in PassStats.__dataclass_fields__:
            setattr(self.stats, name, getattr(self.stats, name) + getattr(s, name))


class _Handle:
    """What autograd keeps instead of the feature map: the host copy and, once prefetched,
    the device copy with the event that says it has arrived; and what the in-place check
    needs (the version saved, the original while it lives, a change seen while it lived)."""

    __slots__ = ("__weakref__", "device", "device_copy", "event", "group", "host", "kept",
                 "modified", "nbytes", "source", "unpacked", "version")

    def __init__(self, host: torch.Tensor, device: torch.device, group: int, nbytes: int,
                 event: Any) -> None:
        self.host = host
        self.device = device
        self.group = group
        self.nbytes = nbytes
        self.event = event  # offload finished (CUDA) / None
        self.device_copy: torch.Tensor | None = None
        self.unpacked = False
        self.kept = False  # another save kept the storage on the device: device_copy is it
        self.version = 0
        self.source: weakref.ReferenceType[torch.Tensor] | None = None
        self.modified: int | None = None  # the version the original was seen at, if changed


@dataclass
class _RootCall:
    """One call of the tracked model in progress: ``pass`` (a grad-enabled forward pass),
    ``inner`` (the model calling itself: part of the same pass), ``no grad``; ``ctx`` counts
    the saves outside the installed layers."""

    role: str
    ctx: Any = None


class _Kept:
    """A saved tensor left on the device, with the version it was saved at. Detached (same
    storage and version counter): holding a saved output itself would tie it to its own
    autograd node in a cycle the garbage collector cannot see."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version


def modified_in_place(shape: torch.Size, dtype: torch.dtype, saved: int, now: int) -> RuntimeError:
    """Autograd's own error for a saved tensor changed before backward used it (the engine's
    hooks switch torch's check off, so the engine raises it)."""
    dims = ", ".join(str(d) for d in shape)
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a saved tensor of shape [{dims}] ({dtype}) was modified in "
        f"place after being saved for backward: it is at version {now}; expected version "
        f"{saved} instead (make the in-place operation out of place, e.g. y = y + 1)"
    )


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


def is_convolution(module: nn.Module) -> bool:
    """vDNN_conv's test, by class and not by name: torch's convolutions and their subclasses
    (timm's ``StdConv2d``, gpu_kernels' ``AutotunedConv2d``, ``LazyConv*``) are; HF GPT-2's
    ``Conv1D`` (a linear layer) is not."""
    return isinstance(module, _ConvNd)


_top_hooks: Callable[[bool], Any] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None)
"""The innermost saved-tensor hooks in effect (pack, unpack), or None; absent from some
torch versions."""


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread: a forward that runs
    then is a checkpoint's recomputation, not a pass of the training step."""
    return int(torch._C._current_graph_task_id()) != -1


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


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
        self.per_iteration = False
        """Counting periods are iterations (set by :meth:`begin_iteration`)."""
        self._root: weakref.ReferenceType[nn.Module] | None = None
        self._param_ptrs: set[int] = set()
        # per period: parameter storages, and (storage, dtype) of their autocast copies
        self._params_seen: set[int | tuple[int, torch.dtype]] = set()
        self._resident_ptrs: set[int] = set()  # per forward pass
        # storage -> the handles offloaded from it this forward pass: a later resident save
        # of the same storage keeps it on the device, and those copies then free nothing
        self._offloaded_ptrs: dict[int, list[weakref.ReferenceType[_Handle]]] = {}
        self._group = 0
        self._conv_depth = 0
        self._groups: dict[int, list[weakref.ReferenceType[_Handle]]] = {}
        self._dedupe: dict[tuple[Any, ...], _Handle] = {}
        self._live: dict[int, _Handle] = {}  # offloaded this forward, original still alive
        self._group_ids: list[int] = []
        self._contexts: list[Any] = []
        self._calls: list[_RootCall] = []  # the tracked model's calls in progress
        self._installed_ids: set[int] = set()
        self._stream: Any = None
        self._hooked: set[int] = set()
        self._handles: list[RemovableHandle] = []
        """Every hook the engine registered on a module, for :meth:`remove`."""

    # -- installation ------------------------------------------------------------------

    def track(self, root: nn.Module) -> None:
        """The whole model: its parameters are never offloaded, its saves outside the
        installed layers are counted (as resident), and its forward starts a forward pass
        (and, where no iteration is marked, a new counting period)."""
        self._root = weakref.ref(root)
        self._handles += [root.register_forward_pre_hook(self._root_pre, prepend=True),
                          root.register_forward_hook(self._root_post, always_call=True)]

    def install(self, module: nn.Module, path: str) -> nn.Module:
        """Run ``module``'s forward inside the offloading hooks (the module itself is kept:
        parameter names and state_dict keys do not change)."""
        self._handles += [module.register_forward_pre_hook(self._enter),
                          module.register_forward_hook(self._exit, always_call=True)]
        self._installed_ids.add(id(module))
        for sub in module.modules():
            if id(sub) in self._hooked:
                continue
            self._hooked.add(id(sub))
            if next(sub.children(), None) is None:  # a leaf: one prefetch group
                self._handles.append(sub.register_forward_pre_hook(self._leaf_pre))
            if is_convolution(sub):  # a leaf, or one with parametrizations inside
                self._handles += [sub.register_forward_pre_hook(self._conv_pre),
                                  sub.register_forward_hook(self._conv_post, always_call=True)]
        self.installed.append(path or "<model>")
        return module

    def remove(self) -> None:
        """Take every hook off the model (the run ended): the model runs as it did before,
        and a later engine on it does not stack on this one. Without it a loop's model
        (``accelopt.attach``) kept offloading after ``close()``, and each attach added a
        second set of hooks. What was counted stays, for the report."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._installed_ids.clear()
        self._root = None

    # -- iterations (the owner's boundaries) ---------------------------------------------

    def begin_iteration(self) -> None:
        """An iteration starts: from now on a counting period is an iteration. What was
        counted since the last iteration ended (or before the first: forwards outside the
        training loop) is not an iteration's and is dropped."""
        if not self.per_iteration:
            self.per_iteration = True
            self.totals = Totals()
        self._reset_period()

    def end_iteration(self) -> None:
        """An iteration ended: close its counting period."""
        self.close_pass()

    def finish(self) -> None:
        """Close what is still counted for the report: a forward pass's period, but not
        forwards after the last marked iteration."""
        if self.per_iteration:
            self._reset_period()
        else:
            self.close_pass()

    # -- forward-time hooks (native torch hooks, no plugin machinery) -------------------

    def _caller_hooks(self) -> str:
        """Whose saved-tensor hooks this call's saves belong to: ``""`` (none, or the
        engine's own: enter the engine's), ``"caller"`` (the caller's, in forward: a
        ``torch.utils.checkpoint`` around the call; left to them, counted), ``"recompute"``
        (a forward during backward, a checkpoint's recomputation: left alone, and counted
        only for a reentrant checkpoint, whose forward saved nothing under no_grad)."""
        top = _top_hooks(False) if _top_hooks is not None else None
        foreign = top is not None and getattr(top[0], "__self__", None) is not self
        if in_backward():
            return "recompute" if foreign else "caller"
        return "caller" if foreign else ""

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if self._calls:  # the model calling itself: part of the same forward
            self._calls.append(_RootCall("inner"))
        elif not torch.is_grad_enabled():
            self._calls.append(_RootCall("no grad"))
        elif in_backward():  # a checkpoint recomputing the model: no other pass
            self._calls.append(_RootCall("recompute"))
        else:
            self._calls.append(_RootCall("pass", self._begin_forward(module)))

    def _begin_forward(self, module: nn.Module) -> Any:
        """A forward pass starts: its counting state, and the context that counts what the
        layers the engine is not installed on save."""
        if not self.per_iteration:
            self.close_pass()
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._resident_ptrs.clear()  # an earlier forward's freed storage may be reused
        self._offloaded_ptrs.clear()
        self._conv_depth = 0
        self.current.forwards += 1
        ctx = None
        # count what the other layers save, unless the caller's hooks (a checkpoint around
        # the model) take the saves: entered inside them, the engine's would win
        if id(module) not in self._installed_ids and not self._caller_hooks():
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_outside, self.unpack)
            ctx.__enter__()
        return ctx

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self._calls.pop() if self._calls else None
        if call is None or call.role != "pass":
            return
        if call.ctx is not None:
            call.ctx.__exit__(None, None, None)
        self._check_live()
        self._live.clear()
        self._dedupe.clear()
        # backward begins with the last layers: bring them back now
        if self.prefetch_layers > 0:
            self._prefetch_before(self._group + 1)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._root is None:  # installed on a layer of a model never tracked
            self._param_ptrs |= {p.untyped_storage().data_ptr() for p in module.parameters()}
        caller = self._caller_hooks()
        ctx = None
        if not caller:
            ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            ctx.__enter__()
        elif caller == "caller":  # checkpoint drops these maps: better than offloading them
            self.current.left_to_caller += 1
        self._contexts.append(ctx)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._contexts:
            ctx = self._contexts.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def _leaf_pre(self, module: nn.Module, args: Any) -> None:
        self._group += 1
        self._check_live()  # a layer boundary: did code since the last one modify a saved map?

    def _conv_pre(self, module: nn.Module, args: Any) -> None:
        self._conv_depth += 1

    def _conv_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._conv_depth = max(0, self._conv_depth - 1)  # ops between layers: no convolution

    # -- saved-tensor hooks ---------------------------------------------------------------

    def _wanted(self, t: torch.Tensor, nbytes: int) -> bool:
        if self.policy == "conv" and self._conv_depth == 0:
            return False
        if self.policy == "size" and nbytes < self.min_bytes:
            return False
        return dense_layout(t)

    def pack(self, t: torch.Tensor) -> Any:
        """The hook inside installed layers: offload what the policy wants."""
        return self._pack(t, may_offload=True)

    def _pack_outside(self, t: torch.Tensor) -> Any:
        """The hook of the tracked model outside installed layers: count, keep."""
        return self._pack(t, may_offload=False)

    def _pack(self, t: torch.Tensor, may_offload: bool) -> Any:
        s = self.current
        nbytes = t.numel() * t.element_size()
        ptr = _storage_ptr(t)
        if ptr is not None and ptr in self._param_ptrs:
            if ptr not in self._params_seen:
                self._params_seen.add(ptr)
                s.param_bytes += t.untyped_storage().nbytes()
            return _Kept(t)
        cast_of = self._cast_of_param(t)
        if cast_of is not None:  # autocast's copy of a weight: a weight, not a feature map
            key = (cast_of, t.dtype)
            if key not in self._params_seen:
                self._params_seen.add(key)
                s.param_bytes += t.untyped_storage().nbytes()
            return _Kept(t)
        if (not may_offload or ptr is None or t.device.type == "meta"
                or not self._wanted(t, nbytes)):
            self._count_resident(t, ptr, nbytes)
            return _Kept(t)
        if ptr in self._resident_ptrs:
            # another save keeps this storage on the device (the ReLU that produced a
            # convolution's input saves it too): a host copy would free nothing
            s.kept_shared += 1
            return _Kept(t)
        key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        seen = self._dedupe.get(key)
        # the first tensor must still be alive: otherwise its memory may have been reused
        # by a new tensor with the same address, shape and version
        if seen is not None and seen.source is not None and seen.source() is not None:
            s.deduplicated += 1
            return seen
        handle = self._offload(t, nbytes)
        handle.version = t._version
        handle.source = weakref.ref(t, self._forget)
        self._live[id(handle.source)] = handle
        self._dedupe[key] = handle
        self._offloaded_ptrs.setdefault(ptr, []).append(weakref.ref(handle))
        if self._group not in self._groups:
            self._groups[self._group] = []
            self._group_ids.append(self._group)  # ascending: groups are numbered in order
        self._groups[self._group].append(weakref.ref(handle))
        s.offloaded_bytes += nbytes
        s.offloaded_tensors += 1
        return handle

    def _cast_of_param(self, t: torch.Tensor) -> int | None:
        """The storage of the parameter that ``t`` is a cast of (or a view of one), else None.

        Why: under mixed precision autocast hands an op ``weight.to(bf16)``, a new tensor
        whose storage is not the parameter's, so the storage test misses it and the weights
        would be copied to the host and back every step as if they were feature maps (and,
        during forward, autocast's cache holds the copy, so the device memory stays). The
        cast is recognised by its autograd node: ``_to_copy``'s backward whose one input is
        the AccumulateGrad of a parameter of the model. A view (``weight.t()`` saved by
        ``addmm``) is looked at through its base. A parameter that does not require grad
        has no such node, and its cast is not recognised (README: "Mixed precision")."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return None
        nexts = fn.next_functions
        if len(nexts) != 1 or nexts[0][0] is None:
            return None
        source = getattr(nexts[0][0], "variable", None)  # AccumulateGrad's leaf only
        if not isinstance(source, torch.Tensor):
            return None
        ptr = _storage_ptr(source)
        return ptr if ptr is not None and ptr in self._param_ptrs else None

    def _count_resident(self, t: torch.Tensor, ptr: int | None, nbytes: int) -> None:
        """The memory behind a kept tensor, once per storage per forward pass: a tensor
        saved by two layers, or an expanded view of a small buffer, is its storage."""
        s = self.current
        if ptr is None or t.device.type == "meta":  # no storage to tell apart
            s.resident_bytes += nbytes
            s.resident_tensors += 1
        elif ptr not in self._resident_ptrs:
            self._resident_ptrs.add(ptr)
            s.resident_bytes += t.untyped_storage().nbytes()
            s.resident_tensors += 1
            self._keep_offloaded(ptr)

    def _keep_offloaded(self, ptr: int) -> None:
        """A storage saved earlier in this forward and offloaded is now kept on the device by
        another save (a convolution offloaded its input, then a later op saved the same
        tensor): the copies free nothing. They are counted as resident (the storage, once,
        by the save that keeps it) and backward reads the device tensor itself, which is
        there anyway; the host copy is dropped."""
        s = self.current
        for ref in self._offloaded_ptrs.pop(ptr, ()):
            handle = ref()
            # the original must be alive: otherwise its address may be a new tensor's
            src = handle.source() if handle is not None and handle.source is not None else None
            if handle is None or src is None or _storage_ptr(src) != ptr:
                continue
            handle.device_copy = src.detach()
            handle.kept = True
            handle.event = None
            host = handle.host
            handle.host = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                              device="meta")  # shape and dtype, for errors
            s.offloaded_bytes -= handle.nbytes
            s.offloaded_tensors -= 1
            s.kept_shared += 1

    def _forget(self, ref: weakref.ReferenceType[torch.Tensor]) -> None:
        self._live.pop(id(ref), None)  # the original died: nothing can modify it any more

    def _check_live(self) -> None:
        """Mark offloaded tensors whose original was modified in place since it was saved
        (the device tensor is gone by backward, so the change is looked for while it lives)."""
        for handle in list(self._live.values()):
            src = handle.source() if handle.source is not None else None
            if src is not None and src._version != handle.version:
                handle.modified = src._version
                self._live.pop(id(handle.source), None)

    def _check_version(self, packed: _Handle | _Kept) -> None:
        if isinstance(packed, _Kept):
            t = packed.tensor
            if t._version != packed.version:
                raise modified_in_place(t.shape, t.dtype, packed.version, t._version)
            return
        now = packed.modified
        src = packed.source() if packed.source is not None else None
        if now is None and src is not None:
            now = src._version
        if now is not None and now != packed.version:
            raise modified_in_place(packed.host.shape, packed.host.dtype, packed.version, now)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            self._check_version(packed)
            return packed.tensor
        if not isinstance(packed, _Handle):
            return packed  # type: ignore[no-any-return]
        self._check_version(packed)
        out = packed.device_copy
        if out is None:
            self.current.fetched_on_demand += 1
            out = self._fetch(packed, sync=True)
            packed.device_copy = out
        else:
            if not packed.unpacked and not packed.kept:
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
        """Close the counting period (an iteration, or a forward pass with its backward)."""
        s = self.current
        if s.offloaded_tensors or s.resident_tensors or s.param_bytes or s.left_to_caller:
            self.totals.add(s)
        self._reset_period()

    def _reset_period(self) -> None:
        self.current = PassStats()
        self._params_seen.clear()
        self._resident_ptrs.clear()
        self._offloaded_ptrs.clear()
        self._group = 0
        self._groups.clear()
        self._group_ids.clear()
        self._dedupe.clear()


def engine_on(module: nn.Module) -> OffloadEngine | None:
    """The engine whose hooks ``module`` carries, if any (one not yet removed: a loop's
    earlier ``accelopt.attach`` that was never closed)."""
    for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, OffloadEngine):
            return owner
    return None


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
