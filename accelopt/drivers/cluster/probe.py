"""Measure what a shaped loopback really delivers: one large tensor, gloo, two processes
inside a fresh namespace. Used by the shaped-network test and the benchmark."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accelopt.drivers.cluster import faults, netns
from accelopt.drivers.cluster.launch import free_port, own_mp_helpers


def _probe_child(rank: int, port: int, namespace: str, nbytes: int, repeats: int,
                 out: str) -> None:
    faults.die_with_parent()
    netns.enter(namespace)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
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


def measure_bandwidth(bandwidth_bps: int, nbytes: int = 8 * 2**20, repeats: int = 3,
                      latency_s: float | None = None, workdir: str = "/tmp") -> list[float]:
    """Achieved bits/s of ``repeats`` transfers of ``nbytes`` over a loopback shaped to
    ``bandwidth_bps``."""
    out = os.path.join(workdir, f"accelopt-probe-{os.getpid()}-{time.time_ns()}.txt")
    with own_mp_helpers(), netns.Namespace(netns.Shape(bandwidth_bps, latency_s)) as ns:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_probe_child, args=(r, port, ns.name, nbytes, repeats, out))
                 for r in range(2)]
        children = [faults.Child(r, "probe", p) for r, p in enumerate(procs)]
        for p in procs:
            p.start()
        try:
            faults.Watchdog(children, workdir).wait()
        finally:
            faults.Watchdog(children, workdir).kill_all()
    try:
        with open(out) as fh:
            return [float(x) for x in fh.read().split()]
    finally:
        os.unlink(out)
