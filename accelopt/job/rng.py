"""Per-job random state: each job draws dropout masks (and any other random op of its
forward and backward) from its own generator, never from whatever the process's global RNG
holds.

Why swapping and not passing generators: PyTorch's random layers (``nn.Dropout``,
``F.dropout``, attention dropout, stochastic depth) take no generator argument; they read the
process's default generator. So the job's step runs with the job's own state swapped into
the default generator and swapped out after (:meth:`JobRandom.active`). That makes the state
part of the job: checkpointed with it, restored on resume, unaffected by the jobs next to it.

Concurrency. The default generator is one per process, so two lanes that swap their jobs'
states in at the same time would draw from each other's streams. A job's step therefore
holds one process-wide lock while its state is active. A job whose step draws nothing (found
on its first step: the state did not move) needs no state and no lock from then on, so only
jobs that really use randomness serialise with each other.

Measurements. A plugin that runs the model inside a job's step to measure it (a timing
forward in training mode draws dropout masks) wraps the measurement in
:func:`isolated_rng`, so the job's stream does not advance.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_RNG_LOCK = threading.Lock()
_NOTHING = contextlib.nullcontext()


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (adjacent inputs give unrelated streams)."""
    state = np.random.SeedSequence([p & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2)
    return int((int(state[0]) << 32 | int(state[1])) & 0x7FFFFFFFFFFFFFFF)


_STREAM = 0x6A6F62  # "job": separates the dropout stream from the weight-init seed


class JobRandom:
    """The generator state(s) one job's forward and backward draw from."""

    def __init__(self, seed: int, device: torch.device, stream: int = 0) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if self._cuda else []):
            torch.manual_seed(derive_seed(seed, _STREAM, stream))
            self._cpu = torch.get_rng_state()
            self._gpu = torch.cuda.get_rng_state(device) if self._cuda else None
        self.uses_rng: bool | None = None
        """Whether the job's step draws random numbers (``None`` until its first step)."""

    def active(self) -> contextlib.AbstractContextManager[None]:
        """Run the job's step with its own state as the process's default generator."""
        if self.uses_rng is False:
            return _NOTHING
        return _Active(self)

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": self._cpu.clone(), "cuda": None if self._gpu is None else self._gpu.clone(),
                "uses_rng": self.uses_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cpu = state["cpu"].clone()
        if self._cuda and state.get("cuda") is not None:
            self._gpu = state["cuda"].clone()
        self.uses_rng = state.get("uses_rng")

    def copy(self) -> JobRandom:
        """An independent copy (a profile's probe steps must not advance the job's stream)."""
        other = JobRandom.__new__(JobRandom)
        other.device, other._cuda = self.device, self._cuda
        other._cpu = self._cpu.clone()
        other._gpu = None if self._gpu is None else self._gpu.clone()
        other.uses_rng = self.uses_rng
        return other


class _Active:
    """Swap the job's state in on enter, out on exit (under the process-wide RNG lock)."""

    __slots__ = ("random", "saved_cpu", "saved_gpu")

    def __init__(self, random: JobRandom) -> None:
        self.random = random

    def __enter__(self) -> None:
        _RNG_LOCK.acquire()
        r = self.random
        self.saved_cpu = torch.get_rng_state()
        torch.set_rng_state(r._cpu)
        if r._cuda:
            self.saved_gpu = torch.cuda.get_rng_state(r.device)
            torch.cuda.set_rng_state(r._gpu, r.device)

    def __exit__(self, *exc: object) -> None:
        r = self.random
        try:
            after = torch.get_rng_state()
            moved = not torch.equal(after, r._cpu)
            r._cpu = after
            torch.set_rng_state(self.saved_cpu)
            if r._cuda:
                gpu_after = torch.cuda.get_rng_state(r.device)
                moved = moved or not torch.equal(gpu_after, r._gpu)
                r._gpu = gpu_after
                torch.cuda.set_rng_state(self.saved_gpu, r.device)
            if r.uses_rng is None:
                r.uses_rng = moved
        finally:
            _RNG_LOCK.release()


@contextlib.contextmanager
def isolated_rng(seed: int | None = 0) -> Iterator[None]:
    """Run a measurement without advancing anybody's random stream: the process's generator
    state (inside a job's step: the job's state) is saved, reseeded with ``seed`` (``None``:
    left as it is) and restored afterwards, on the CPU and the current CUDA device."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        yield
