"""How the local ranks of a cluster run join their process group: rank 0's store listens
before any other rank tries to reach it.

Why: with ``init_method="tcp://..."`` every rank starts at once, rank 0 opens the
rendezvous store (a ``TCPStore``) and the others connect to it. A rank whose first connect
comes before rank 0 listens, which is the usual case when the ranks fork together, waits
out the store client's retry back-off (~0.55 s on this 2-core VM, measured on the default
run: every rank left ``init_process_group`` at the same instant, 0.55 s after entering
it). So rank 0 opens the store itself and says so through an event; the other ranks wait
for the event and connect once, at once. Ranks under ``torchrun`` (no event) rendezvous as
torch does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist


def join_group(backend: str, init_method: str, *, rank: int, world: int,
               timeout: timedelta, store_ready: Any | None = None) -> None:
    """``dist.init_process_group`` for this rank. ``store_ready``: an event shared by the
    run's local ranks (``multiprocessing``'s), set by rank 0 once its store listens; without
    it, ``init_method`` rendezvous as usual."""
    if store_ready is None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout)
        return
    store = _store(init_method, rank=rank, world=world, timeout=timeout,
                   store_ready=store_ready)
    # The prefix torch gives the store of an init_method, so the keys are the same.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=timeout)


def _store(init_method: str, *, rank: int, world: int, timeout: timedelta,
           store_ready: Any) -> dist.TCPStore:
    address = urlsplit(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"a local rank joins through tcp://host:port, not {init_method!r}")
    if rank == 0:
        # wait_for_workers=False: listening is all the others need; the group's own set-up
        # waits for them.
        store = dist.TCPStore(address.hostname, address.port, world, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        store_ready.set()
        return store
    if not store_ready.wait(timeout.total_seconds()):
        raise TimeoutError(f"rank 0 did not open the rendezvous store at {address.netloc} "
                           f"within {timeout.total_seconds():g} s")
    return dist.TCPStore(address.hostname, address.port, world, is_master=False,
                         timeout=timeout)
