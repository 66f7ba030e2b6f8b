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


def _in_thread(call, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    """Run ``call`` on a thread; the returned function joins it and gives what it raised."""
    import threading

    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised[0] = exc

    thread = threading.Thread(target=run)
    thread.start()

    def joined() -> BaseException | None:
        thread.join(30)
        assert not thread.is_alive()
        return raised[0]

    return joined


@pytest.fixture
def torchrun_address(monkeypatch):
    """A torchrun rank's MASTER_ADDR and MASTER_PORT (nobody else listens there)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


@pytest.mark.timeout(60)
def test_a_refusal_reaches_every_torchrun_rank_at_once(torchrun_address):
    """A rank whose config is refused before it joins still meets the others in the store
    and leaves its line there: they stop at once (not after their 60 s) with that line."""
    from accelopt.drivers.cluster.rendezvous import arrive, refuse_at_rendezvous, torchrun_store
    from accelopt.errors import RankRefused

    timeout = timedelta(seconds=60)
    store = torchrun_store(0, WORLD, timeout)  # rank 0 opens it
    refusing = _in_thread(refuse_at_rendezvous, "cluster.workers: wrong", rank=1, world=WORLD,
                          timeout=timeout)
    waiting = _in_thread(lambda: arrive(torchrun_store(2, WORLD, timeout), rank=2, world=WORLD,
                                        timeout=timeout))
    with pytest.raises(RankRefused) as info:
        arrive(store, rank=0, world=WORLD, timeout=timeout)
    assert str(info.value) == "rank 1 refused its config: cluster.workers: wrong"
    assert (info.value.rank, info.value.exit_code) == (1, 2)
    assert refusing() is None  # its caller raises its own error
    assert str(waiting()) == str(info.value)


@pytest.mark.timeout(60)
def test_torchrun_ranks_name_the_ranks_that_never_arrived(torchrun_address):
    from accelopt.drivers.cluster.rendezvous import NeverJoined, arrive, torchrun_store

    timeout = timedelta(seconds=0.5)
    store = torchrun_store(0, WORLD, timeout)
    other = _in_thread(lambda: arrive(torchrun_store(1, WORLD, timeout), rank=1, world=WORLD,
                                      timeout=timeout))
    with pytest.raises(NeverJoined, match=r"^rank 2 never joined the rendezvous at "
                                          r"MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=\d+ within "
                                          r"cluster\.timeout_s=0\.5 s \(rank 0 waited"):
        arrive(store, rank=0, world=WORLD, timeout=timeout)
    assert isinstance(other(), NeverJoined)


@pytest.mark.timeout(60)
def test_torchrun_ranks_that_all_arrive_go_on(torchrun_address):
    from accelopt.drivers.cluster.rendezvous import arrive, torchrun_store

    timeout = timedelta(seconds=30)
    store = torchrun_store(0, 2, timeout)
    other = _in_thread(lambda: arrive(torchrun_store(1, 2, timeout), rank=1, world=2,
                                      timeout=timeout))
    arrive(store, rank=0, world=2, timeout=timeout)
    assert other() is None
