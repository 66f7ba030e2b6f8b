"""Instruction counts under valgrind's callgrind, for the benchmarks that count instead of
time (a count is the same for the same binary and inputs whatever else the machine does).

Each measured thing runs in its own process twice, for a short and a long loop; the
difference of the two totals over the difference of the loop lengths is its count per loop
step (imports, build and start-up cancel out). The processes share the cores: counts do not
depend on what runs beside them.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor


def total(command: Sequence[str], out_file: str, env: dict[str, str]) -> int:
    """The instructions ``command`` executes in all (callgrind's summary line)."""
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
                    *command], check=True, env=env, capture_output=True)
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
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        runs = {(k, n): pool.submit(total, command(k, n), f"{work}/{i}-{n}.out", env)
                for i, k in enumerate(keys) for n in (short, long)}
        return {k: (runs[k, long].result() - runs[k, short].result()) / (long - short)
                for k in keys}
