"""Two gloo processes for tests of a user's own DDP script: each rank computes a dict of
results, which the test reads back from disk (``torch.multiprocessing.spawn`` returns none)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Compute = Callable[[int, str], dict[str, Any]]
"""``compute(rank, what)``: one rank's results (a module-level function: it is pickled)."""


def _rank(rank: int, init: str, out_dir: str, what: str, compute: Compute) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results = compute(rank, what)
    torch.save(results, os.path.join(out_dir, f"{what}{rank}.pt"))
    gc.collect()  # the DDP wrappers, before the group goes
    dist.destroy_process_group()


def two_ranks(tmp_path: Path, what: str, compute: Compute) -> list[dict[str, Any]]:
    """Each of two ranks' ``compute(rank, what)``, in rank order."""
    mp.spawn(_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path), what, compute),
             nprocs=2)
    return [torch.load(tmp_path / f"{what}{r}.pt") for r in range(2)]
