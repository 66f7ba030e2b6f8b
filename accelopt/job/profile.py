"""Measure a job's memory and time profile (SALUS's persistent / ephemeral split).

Method (``docs/ARCHITECTURE.md`` repeats it):

* **persistent** = the exact sum of the byte sizes of the distinct storages of the model's
  parameters and buffers, their gradients and the optimizer's state tensors, taken after
  one real step (Adam creates its state lazily). Exact on every device.
* **ephemeral**, on CUDA: the SALUS authors' recipe: ``max_memory_allocated`` during one
  iteration minus ``memory_allocated`` at the iteration boundary, taken on a stream of its own
  so that the per-stream library workspace a lane needs is included (``_cuda_ephemeral``).
* **ephemeral**, on CPU there are no allocator statistics: we count the distinct storages
  autograd saves for backward (via ``saved_tensors_hooks``), plus the batch and the output.
  That is exactly what an iteration must keep alive at its peak; temporaries freed inside a
  single op are not seen, so it is a lower bound of the allocator's true peak.
* **iteration time**: the median of a few timed iterations after a warm-up.

The profile runs on a deep copy of the job's model and optimizer, so measuring never moves
the real job's weights, optimizer state or data position.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from accelopt.job import inputs
from accelopt.job.job import Job, logits_of
from accelopt.types import JobProfile

TIMED_ITERATIONS = 3


def tensor_bytes(tensors: Any) -> int:
    """Sum of distinct storages' sizes (a storage shared by two tensors counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def persistent_tensors(job: Job) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [*job.model.parameters(), *job.model.buffers()]
    tensors += [p.grad for p in job.model.parameters() if p.grad is not None]
    if job.optimizer is not None:
        for state in job.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def measure_profile(job: Job) -> JobProfile:
    """Profile ``job`` on a copy of it; the job itself is left untouched."""
    probe = _clone(job)
    probe.step()  # warm-up: creates gradients and lazy optimizer state
    if job.random.uses_rng is None:  # what the probe learnt saves the job's first step a check
        job.random.uses_rng = probe.random.uses_rng
    persistent = tensor_bytes(persistent_tensors(probe))
    if job.device.type == "cuda":
        ephemeral, method = _cuda_ephemeral(probe)
    else:
        ephemeral, method = _saved_tensor_ephemeral(probe)
    seconds = []
    for _ in range(TIMED_ITERATIONS):
        start = time.perf_counter()
        probe.step()
        _sync(job.device)
        seconds.append(time.perf_counter() - start)
    return JobProfile(
        persistent_bytes=persistent,
        peak_bytes=persistent + ephemeral,
        ephemeral_bytes=ephemeral,
        iteration_seconds=statistics.median(seconds),
        device=str(job.device),
        method=method,
    )


def _clone(job: Job) -> Job:
    """A copy whose steps move nothing of the job: its own model and optimizer (copied
    together, so the optimizer holds the copy's parameters, whatever a plugin wrapped it in)
    and its own copy of the job's random state; its steps fire no hooks."""
    probe = copy.copy(job)
    memo: dict[int, Any] = {}
    probe.model = copy.deepcopy(job.model, memo)
    probe.optimizer = copy_optimizer(job.optimizer, memo)
    probe.forward = probe.model  # the profile runs on one process: no DDP wrapper
    probe._stepped = dict(probe.model.named_parameters())
    probe.random = job.random.copy()
    probe.info = job.info
    probe.iteration = job.iteration
    return probe


def copy_optimizer(optimizer: torch.optim.Optimizer, memo: dict[int, Any]) -> Any:
    """A deep copy of ``optimizer`` with every attribute it has, its parameters those
    ``memo`` already mapped (copy the model first, with the same ``memo``).

    Why not ``copy.deepcopy``: torch's ``Optimizer.__getstate__`` keeps only ``defaults``,
    ``state`` and ``param_groups``, so a wrapper a plugin returned from
    ``accelopt_optimizer_build`` (a Lookahead holding the optimizer it wraps as
    ``self.base``) would lose its own attributes in the copy and fail on its first step.
    Optimizers it holds as attributes are copied the same way."""
    if id(optimizer) in memo:
        return memo[id(optimizer)]
    try:
        clone = object.__new__(type(optimizer))
        memo[id(optimizer)] = clone
        for name, value in vars(optimizer).items():
            clone.__dict__[name] = (copy_optimizer(value, memo)
                                    if isinstance(value, torch.optim.Optimizer)
                                    else copy.deepcopy(value, memo))
    except Exception:  # an attribute that cannot be copied: torch's own way, as before
        memo.pop(id(optimizer), None)
        return copy.deepcopy(optimizer, memo)
    return clone


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_PROFILING_STREAMS: dict[int, Any] = {}
_STREAM_WORKSPACE: dict[int, int] = {}


def _cuda_ephemeral(probe: Job) -> tuple[int, str]:
    """Peak allocated bytes of one iteration, measured on a stream of its own.

    Why a stream of its own: a SALUS lane runs its jobs on its own stream, and cuBLAS keeps a
    workspace per stream for as long as the stream lives (seen on an H200: a lane's allocated
    peak was ~55 MiB above a profile taken on the default stream). The first profile on a
    device measures what its fresh stream kept after the step (the library workspaces); later
    profiles reuse that stream and add the same amount, so every job is accounted alike.
    """
    device = probe.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    first = index not in _PROFILING_STREAMS
    if first:
        _PROFILING_STREAMS[index] = torch.cuda.Stream(device)
    stream = _PROFILING_STREAMS[index]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.cuda.stream(stream):
        probe.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    if first:
        _STREAM_WORKSPACE[index] = max(0, torch.cuda.memory_allocated(device) - base)
    else:
        peak += _STREAM_WORKSPACE[index]
    method = (f"cuda allocator: max_memory_allocated - memory_allocated on a stream of its own "
              f"(incl. {_STREAM_WORKSPACE[index] / 2**20:.1f} MiB per-stream library workspace)")
    return max(0, peak), method


def _saved_tensor_ephemeral(probe: Job) -> tuple[int, str]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x, y = probe.batch(probe.iteration)
    params = {p.untyped_storage().data_ptr() for p in probe.model.parameters()}
    if probe.optimizer is None:
        with torch.inference_mode():
            out = inputs.call(probe.model, x)
        return (tensor_bytes([*inputs.tensors(x), y, logits_of(out)]),
                "cpu: batch + output (inference keeps no activations)")
    with probe.random.active(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = probe._call(x, y)  # as the step calls it (loss=model: with labels=)
        loss = probe.loss_fn(out, y)
    activations = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    total = tensor_bytes([*inputs.tensors(x), y, logits_of(out), *activations])
    loss.backward()  # release the graph the same way a real step does
    probe.optimizer.zero_grad(set_to_none=False)
    return total, "cpu: batch + output + tensors saved for backward (lower bound of peak)"
