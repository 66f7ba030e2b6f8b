"""Process setup shared by every driver: torch's threads and determinism, the device, the
memory capacity allocation hooks are told about. One place, so a one-process run and every
rank of a cluster run set torch up the same way."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import torch

from accelopt.drivers.lazy_dynamo import defer_dynamo_import
from accelopt.errors import ConfigError, UserError
from accelopt.job.rng import isolated_rng
from accelopt.units import format_bytes, parse_bytes

CUBLAS_WORKSPACE = ":4096:8"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else
    the machine's count): what lane counts, test workers and benchmarks size themselves by."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def setup_torch(run: Any, *, default_threads: int = 0) -> None:
    """Seed torch, set its intra-op threads (``run.threads``; 0: ``default_threads``, and 0
    there too: torch's own default) and, with ``run.deterministic``, deterministic
    algorithms (plus the cuBLAS workspace setting they need on CUDA). Dynamo is imported
    only if something compiles (:mod:`accelopt.drivers.lazy_dynamo`). The process's
    defaults a run trains under (:func:`run_defaults`) are set first."""
    defer_dynamo_import()
    run_defaults()
    torch.manual_seed(int(run.get("seed", 0)))
    threads = _configured_threads(run) or default_threads
    if threads > 0:
        torch.set_num_threads(threads)
    if bool(run.get("deterministic", True)):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        deterministic_algorithms()


RUN_DTYPE = torch.float32
"""torch's default dtype while a run builds and trains: its jobs' ``precision`` (fp32, or
autocast's bf16/fp16 over fp32 weights) is relative to it, and ``config.yaml`` says nothing
else, so a caller's ``torch.set_default_dtype(torch.float64)`` must not make float64 models."""


def run_defaults() -> None:
    """Set the process-wide torch modes a run relies on, whatever the caller of
    ``accelopt.run`` left set: the default dtype :data:`RUN_DTYPE` and gradients enabled (a
    script's ``torch.no_grad()`` or ``set_grad_enabled(False)`` made every job's first
    backward fail). Inference mode cannot be left from inside, so it is refused
    (:func:`refuse_inference_mode`). :func:`torch_state_kept` gives the caller's back."""
    refuse_inference_mode()
    torch.set_default_dtype(RUN_DTYPE)
    torch.set_grad_enabled(True)


def refuse_inference_mode(caller: str = "accelopt.run") -> None:
    """One line instead of every job failing in its first backward: a run trains, and
    ``torch.inference_mode()`` cannot be switched off from inside it."""
    if torch.is_inference_mode_enabled():
        raise UserError(f"{caller} was called inside torch.inference_mode(), where nothing can "
                        "be trained; call it outside that block")


MAX_THREADS = 1024
"""The most intra-op threads a setting may ask for: torch segfaults on its first parallel
kernel with 100,000 (5,000 works), and no machine has cores for more than this."""

RANK_THREADS = 1
"""A rank's intra-op threads unless ``run.threads`` says otherwise: a cluster's ranks share
the machine's cores."""


def rank_threads(run: Any) -> int:
    """The intra-op threads each rank of a cluster run uses (``run.threads``, else
    :data:`RANK_THREADS`)."""
    return _configured_threads(run) or RANK_THREADS


def _configured_threads(run: Any) -> int:
    """``run.threads`` (0: not set)."""
    return int(run.get("threads", 0) or 0)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def torch_state_kept() -> Iterator[None]:
    """What :func:`setup_torch` and a run change in the process, as it was before, after:
    intra-op threads, deterministic algorithms (and the environment they set), the default
    dtype and gradient mode (:func:`run_defaults`, set on entry too: a cluster run's
    launching process builds models to score them without :func:`setup_torch`), and the
    random states of torch (CUDA included, where initialised) and numpy (``random``'s is
    kept by :func:`accelopt.api.keeps_python_random`, from before the run's imports).
    ``accelopt.run`` called from a notebook or a script must not leave that script's
    torch seeded, single-threaded and deterministic (the command's own process ends)."""
    import numpy as np

    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "TORCHINDUCTOR_DETERMINISTIC")}
    np_rng = np.random.get_state()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    run_defaults()
    try:
        with isolated_rng(seed=None):  # torch's generators, CPU and CUDA
            yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        torch._C._set_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        np.random.set_state(np_rng)


def deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` without its import of
    ``torch._inductor.config``, which loads all of dynamo and inductor: 1.8 s of every
    process's start on 2 cores, for a compiler a run need not use. Inductor gets the same
    setting: directly if it is loaded already, else from the environment it reads when it
    is (``TORCHINDUCTOR_DETERMINISTIC``)."""
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True  # type: ignore[attr-defined]
    else:
        os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device: unknown device {name!r}; use auto, cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"run.device: {name!r} is not supported (jobs run on a CPU or a CUDA "
                          "device); use auto, cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"run.device={name} but no CUDA device is available; use run.device=cpu")
    return device


def memory_capacity(text: str, device: torch.device) -> int:
    """The capacity allocation hooks are told about: the real device memory on CUDA, the
    machine's RAM on CPU (where it is accounting only), or what the user configured (more
    than the device has is said by :func:`capacity_warning` where the run enforces it)."""
    if text != "auto":
        capacity = parse_bytes(text, "run.memory_capacity")
        if capacity <= 0:
            raise ConfigError("run.memory_capacity must be positive, e.g. 2GiB")
        return capacity
    return device_memory(device)


def device_memory(device: torch.device) -> int:
    """The memory ``device`` has: the device's total memory on CUDA, the machine's RAM on
    CPU. What ``run.memory_capacity=auto`` gives, and what a configured capacity is held
    against (:func:`capacity_beyond_device`)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(psutil.virtual_memory().total)


def capacity_warning(text: str, device: torch.device) -> str | None:
    """The warning line for ``run.memory_capacity=text`` on ``device`` (``None``: auto, or
    within the device's memory): said by a one-process run, the one that enforces it."""
    if text == "auto":
        return None
    return capacity_beyond_device(memory_capacity(text, device), device,
                                  f"run.memory_capacity={text}")


def capacity_beyond_device(capacity: int, device: torch.device, setting: str) -> str | None:
    """One line when a configured memory capacity is more than ``device`` has (``None``: it
    fits). Admission is accounted against the setting, so jobs are admitted that the device
    cannot hold, where the value reads as a limit: accepted silently, ``999TiB`` on a 23 GiB
    machine looked enforced. ``setting``: the setting and its value, as the user wrote it."""
    real = device_memory(device)
    if capacity <= real:
        return None
    what = "RAM" if device.type == "cpu" else f"{device} memory"
    return (f"{setting} ({format_bytes(capacity)}) is more than this machine's {what} "
            f"({format_bytes(real)}): jobs are admitted against the setting, nothing holds "
            f"them to the device's real memory; set it to {format_bytes(real)} or less "
            "(auto: the device's memory)")
