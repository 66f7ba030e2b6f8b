"""Local ranks join their process group through rank 0's store, opened before any other rank
connects (accelopt/drivers/cluster/rendezvous.py): no rank meets a closed port and its
client's retry back-off, whatever order the ranks start in."""

from __future__ import annotations

from datetime import timedelta

import pytest

from accelopt.drivers.cluster.launch import free_port
from accelopt.drivers.cluster.rendezvous import join_group
from accelopt.drivers.processes import rank_context

WORLD = 3


def _rank(rank: int, port: int, store_ready, arrived, release, conn) -> None:  # noqa: ANN001
    """Join (rank 0 only once ``release`` is set, the others saying they are about to by
    ``arrived``), report whether this rank's store client was made after rank 0's store
    listened, and the sum of an all-reduce."""
    import torch
    import torch.distributed as dist

    made_after_ready = []
    client = dist.TCPStore

    def recording_store(*args, is_master: bool = False, **kwargs):  # noqa: ANN002, ANN003
        if not is_master:
            made_after_ready.append(store_ready.is_set())
        return client(*args, is_master=is_master, **kwargs)

    dist.TCPStore = recording_store
    if rank == 0:
        release.wait(60)
    else:
        arrived.set()
    join_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world=WORLD,
               timeout=timedelta(seconds=60), store_ready=store_ready)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    conn.send((made_after_ready, float(total)))
    conn.close()


@pytest.mark.timeout(120)
def test_the_other_ranks_connect_only_once_rank_0_listens():
    ctx = rank_context()
    store_ready, release = ctx.Event(), ctx.Event()
    arrived = [ctx.Event() for _ in range(WORLD)]
    port = free_port()
    pipes, children = [], []
    for rank in range(WORLD):
        here, there = ctx.Pipe()
        child = ctx.Process(target=_rank,
                            args=(rank, port, store_ready, arrived[rank], release, there))
        child.start()
        pipes.append(here)
        children.append(child)
    for event in arrived[1:]:  # rank 0 starts joining only after every other rank has
        assert event.wait(60)
    release.set()
    try:
        seen = [pipe.recv() for pipe in pipes]
    finally:
        for child in children:
            child.join(60)
    assert seen[0] == ([], 6.0)  # rank 0 opens the store: no client
    assert seen[1:] == [([True], 6.0)] * (WORLD - 1)


def test_a_rank_that_waits_in_vain_says_whom_it_waited_for():
    never = rank_context().Event()
    with pytest.raises(TimeoutError, match="rank 0 did not open the rendezvous store"):
        join_group("gloo", f"tcp://127.0.0.1:{free_port()}", rank=1, world=2,
                   timeout=timedelta(seconds=0.1), store_ready=never)


def test_only_a_tcp_address_is_accepted_with_an_event():
    with pytest.raises(ValueError, match="tcp://host:port"):
        join_group("gloo", "env://", rank=1, world=2, timeout=timedelta(seconds=1),
                   store_ready=rank_context().Event())
