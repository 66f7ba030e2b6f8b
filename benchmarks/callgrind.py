"""Instruction counts under valgrind's callgrind, for the benchmarks that count instead of
time (a count is the same for the same binary and inputs whatever else the machine does).

Each measured thing runs in its own process twice, for a short and a long loop; the
difference of the two totals over the difference of the loop lengths is its count per loop
step (imports, build and start-up cancel out). The processes share the cores: counts do not
depend on what runs beside them.

Address-space layout randomisation is turned off for the measured processes (``setarch
-R``, where the machine has it): with it on, where the heap and the libraries land changes
the work of whatever depends on addresses (hash tables keyed by ``id``, allocator bins), and
two counts of the same MLP iteration differed by up to 4,200 instructions (0.07%); with it
off, by 21. :data:`LAYOUT` says which was used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import _cli


def _setarch() -> str | None:
    """``setarch`` where it can turn randomisation off here (a container may refuse)."""
    found = shutil.which("setarch")
    if found is None:
        return None
    works = subprocess.run([found, "-R", "true"], capture_output=True).returncode == 0
    return found if works else None


_SETARCH = _setarch()
LAYOUT = ("fixed address layout (setarch -R)" if _SETARCH else
          "randomised address layout (setarch -R unavailable: counts move by ~0.07% "
          "between runs)")
"""How the counted processes' address space was laid out, for the benchmark's output."""


def total(command: Sequence[str], out_file: str, env: dict[str, str],
          procs: list[subprocess.Popen] | None = None,
          stopped: threading.Event | None = None) -> int:
    """The instructions ``command`` executes in all (callgrind's summary line). The valgrind
    process is added to ``procs`` (for :func:`per_step` to stop it when the script stops);
    none starts once ``stopped`` is set."""
    if stopped is not None and stopped.is_set():
        raise RuntimeError("stopped")
    fixed = [_SETARCH, "-R"] if _SETARCH else []
    proc = _cli.popen([*fixed, "valgrind", "--tool=callgrind",
                       f"--callgrind-out-file={out_file}", *command],
                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if procs is not None:
        procs.append(proc)
    if stopped is not None and stopped.is_set():  # stopped while this one started
        proc.kill()
    out, err = proc.communicate()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    with open(out_file) as fh:
        found = re.search(r"^summary:\s*(\d+)", fh.read(), re.M)
    if found is None:
        raise SystemExit(f"callgrind wrote no summary for {' '.join(command)}")
    return int(found.group(1))


def per_step(keys: Sequence[str], command: Callable[[str, int], Sequence[str]], short: int,
             long: int, env: dict[str, str] | None = None) -> dict[str, float]:
    """Instructions per loop step of each of ``keys``: ``command(key, n)`` runs ``key``'s
    loop for ``n`` steps; every key runs for ``short`` and ``long`` steps."""
    env = {**os.environ, "PYTHONHASHSEED": "0", **(env or {})}
    procs: list[subprocess.Popen] = []
    stopped = threading.Event()
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        # on an error, Ctrl-C or SIGTERM: no new valgrind starts, the running ones are stopped
        with _cli.stopping(procs):
            try:
                runs = {(k, n): pool.submit(total, command(k, n), f"{work}/{i}-{n}.out", env,
                                            procs, stopped)
                        for i, k in enumerate(keys) for n in (short, long)}
                return {k: (runs[k, long].result() - runs[k, short].result()) / (long - short)
                        for k in keys}
            except BaseException:
                stopped.set()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
