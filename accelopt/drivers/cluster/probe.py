"""Measure what a shaped network really delivers: one large tensor, gloo, two processes
in fresh namespaces (one shaped loopback, or a host each). Used by the shaped-network tests
and the benchmarks."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accelopt.drivers.cluster import faults, netns
from accelopt.drivers.cluster.launch import free_port, join_local_rank, own_mp_helpers
from accelopt.drivers.cluster.rendezvous import join_group


def _probe_child(rank: int, port: int, endpoint: netns.Endpoint, master: str, nbytes: int,
                 repeats: int, out: str, store_ready: Any) -> None:
    faults.die_with_parent()
    init_method = join_local_rank(rank, 2, port, endpoint, master)
    torch.set_num_threads(1)
    join_group("gloo", init_method, rank=rank, world=2, timeout=timedelta(seconds=60),
               store_ready=store_ready)
    data = torch.zeros(nbytes // 4, dtype=torch.float32)
    small = torch.zeros(1)
    results = []
    for k in range(repeats + 1):  # the first round warms up TCP
        dist.barrier()
        if rank == 0:
            dist.send(small, 1, tag=2 * k)
            dist.send(data, 1, tag=2 * k + 1)
        else:
            dist.recv(small, 0, tag=2 * k)  # start the clock when the sender is known to run
            t0 = time.perf_counter()
            dist.recv(data, 0, tag=2 * k + 1)
            if k > 0:
                results.append(8 * data.numel() * 4 / (time.perf_counter() - t0))
    if rank == 1:
        with open(out, "w") as fh:
            fh.write(" ".join(f"{r:.1f}" for r in results))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure_bandwidth(bandwidth_bps: int | None, nbytes: int = 8 * 2**20, repeats: int = 3,
                      latency_s: float | None = None, workdir: str = "/tmp", *,
                      topology: str = "shared",
                      receiver_bps: int | None = None) -> list[float]:
    """Achieved bits/s of ``repeats`` transfers of ``nbytes`` from rank 0 to rank 1 over a
    network shaped to ``bandwidth_bps``: one loopback (``shared``) or a host each
    (``hosts``; ``receiver_bps``: rank 1's link rate, default the same)."""
    out = os.path.join(workdir, f"accelopt-probe-{os.getpid()}-{time.time_ns()}.txt")
    links = [netns.Shape(bandwidth_bps, latency_s),
             netns.Shape(receiver_bps or bandwidth_bps, latency_s)]
    with own_mp_helpers(), netns.network(topology, links) as ends:
        ctx = mp.get_context("spawn")
        port = free_port() if topology != "hosts" else 29500
        store_ready = ctx.Event()
        procs = [ctx.Process(target=_probe_child,
                             args=(r, port, ends[r], ends[0].address, nbytes, repeats, out,
                                   store_ready))
                 for r in range(2)]
        children = [faults.Child(r, "probe", p) for r, p in enumerate(procs)]
        for p in procs:
            p.start()
        try:
            faults.Watchdog(children, workdir).wait()
        finally:
            faults.Watchdog(children, workdir).kill_all()
            # The event's semaphores (held by it, the processes' arguments and the children)
            # must be gone before own_mp_helpers stops the resource tracker it started, or
            # the tracker reports them as leaked (as _spawn in launch.py releases its own).
            children.clear()
            procs.clear()
            store_ready = None
    try:
        with open(out) as fh:
            return [float(x) for x in fh.read().split()]
    finally:
        os.unlink(out)
