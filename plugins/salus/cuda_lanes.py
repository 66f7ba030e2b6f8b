"""CUDA lanes: one ``torch.cuda.MemPool`` and one stream per lane, entered per iteration.

Why a module of its own: what "a job's allocations land in its lane" means on CUDA depends on
PyTorch's private allocator routing, and two facts found on a real H200 shape this code:

* ``torch.cuda.use_mem_pool`` routes the *calling thread's* allocations only. Autograd runs a
  CUDA backward pass on its own per-device thread, so gradients and backward temporaries would
  miss the lane. Where the build has ``_cuda_beginAllocateCurrentStreamToPool`` we route by
  *stream* instead: every allocation on the lane's stream, from any thread, goes to the lane's
  pool (autograd runs each backward op on its forward op's stream). Otherwise we fall back to
  the per-thread routing and say so (``routing == "thread"``).
* Destroying a ``MemPool`` while any other thread routes allocations to a pool trips an
  internal assert in the caching allocator (``captures_underway.empty()``) and aborts the
  process. A lane that goes away therefore *retires* its pool; retired pools are dropped only
  in :meth:`CudaLanes.close`, after every lane thread has left its pool.
"""

from __future__ import annotations

import threading
from typing import Any


class CudaLanes:
    """Per-lane pools and streams; ``enter``/``exit`` bracket one iteration on its thread."""

    def __init__(self, torch_module: Any = None) -> None:
        """``torch_module``: torch itself by default; tests pass a recording stand-in."""
        if torch_module is None:
            import torch as torch_module

        self._torch = torch = torch_module
        stream_routing = hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool")
        self.routing = "stream" if stream_routing else "thread"
        self._lanes: dict[str, tuple[Any, Any]] = {}
        self._retired: list[tuple[Any, Any]] = []
        self._active: dict[int, tuple[str, Any, Any, Any]] = {}
        """thread -> (lane, pool, stream, stream before enter)"""
        self.pool_peak: dict[str, int] = {}
        self.stream_ids: dict[str, int] = {}  # lane -> cudaStream_t, for allocator traces
        self._lock = threading.Lock()

    def enter(self, lane: str) -> None:
        """Route this iteration's allocations to ``lane``'s pool and run it on its stream."""
        torch = self._torch
        with self._lock:
            if lane not in self._lanes:
                self._lanes[lane] = (torch.cuda.MemPool(), torch.cuda.Stream())
                self.stream_ids[lane] = int(self._lanes[lane][1].cuda_stream)
            pool, stream = self._lanes[lane]
        previous = torch.cuda.current_stream()
        torch.cuda.set_stream(stream)
        device = torch.cuda.current_device()
        if self.routing == "stream":
            torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool.id)
        else:
            torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool.id)
        self._active[threading.get_ident()] = (lane, pool, stream, previous)

    def exit(self, *, synchronize: bool = True) -> None:
        """Leave this thread's lane pool (same thread as :meth:`enter`), record its reserved
        peak. ``synchronize=False``: a job failed mid-iteration, do not wait for its work."""
        entry = self._active.pop(threading.get_ident(), None)
        if entry is None:
            return
        torch = self._torch
        lane, pool, stream, previous = entry
        if synchronize:
            stream.synchronize()
        device = torch.cuda.current_device()
        # One end for both routings (torch 2.11 has no stream-specific end; the stream begin
        # registers a filter that endAllocateToPool removes by pool id).
        torch._C._cuda_endAllocateToPool(device, pool.id)
        torch._C._cuda_releasePool(device, pool.id)
        torch.cuda.set_stream(previous)
        reserved = sum(int(s.get("total_size", 0)) for s in pool.snapshot())
        with self._lock:
            self.pool_peak[lane] = max(self.pool_peak.get(lane, 0), reserved)

    def retire(self, lane: str) -> None:
        """The lane is gone: keep its pool alive (see the module docstring) until close()."""
        with self._lock:
            entry = self._lanes.pop(lane, None)
            if entry is not None:
                self._retired.append(entry)

    def close(self) -> None:
        """Every lane thread has finished: now pools may be destroyed safely."""
        with self._lock:
            if self._active:
                return  # a lane is still routing; dropping pools now would abort the process
            self._retired.clear()
            self._lanes.clear()
