"""What one parameter-server transfer costs the receiving and the sending process in CPU
time: accelopt's transport against plain gloo point-to-point messages of the same tensors.

Why it matters: a worker receives each parameter as its own transfer. In the default order
the receives happen while the worker waits for its parameters, and their CPU is free; when
the server updates early (tictac's ``heuristic=priority``), the next iteration's parameters
arrive during backward and their receive path takes the worker's core from backward
(``docs/benchmarks.md``, tictac vs the default order). This measures that cost per
transfer, beside two floors:

- ``gloo``: every receive posted up front (the receiver knows every size), then waited for:
  one gloo message per tensor, the least a receive can cost from Python.
- ``gloo+header``: a fixed-size header message and then the payload, whose receive is posted
  once its header is in: the shape of accelopt's wire protocol for a payload over 64 KiB (a
  header says what follows: which tensor, its encoded size and type, its chunk, when it was
  sent), without the rest; a smaller payload travels in its header's message.
- ``accelopt``: ``Transport.post`` on the sender, ``Transport.receive`` on the receiver, no
  plugin: what a PS worker runs.
- ``accelopt+done``: the same with one plugin implementing ``accelopt_transfer_done`` and
  doing nothing in it, hook trace on (as in a run): what any plugin observing transfers
  (tictac measuring the link, a byte counter) adds to each transfer's receive.

Two processes on the loopback (gloo, one intra-op thread each), ``--tensors`` tensors of
``--kib`` KiB a round, ``--rounds`` rounds per measurement after one unmeasured round; the
receiver's CPU time (every thread: ``getrusage``) over the rounds, per transfer, and the
sender's (a PS server sends every parameter). The three run in turn, ``--repeats`` times
in rotating order; medians with their min-max. Last line:
``accelopt receive: X us of CPU per transfer (gloo floor Y us, with a header Z us); send
S us (gloo G us)``.

    python benchmarks/transport_cost.py [--tensors 28] [--kib 10] [--rounds 150] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from typing import Any

import _cli
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accelopt import hookimpl
from accelopt.drivers.cluster.launch import free_port
from accelopt.drivers.processes import release_before_exit

MODES = ("gloo", "gloo+header", "accelopt", "accelopt+done")
HEADER_INTS = 20
"""A header of 20 int64 values, as accelopt's (``transport.HEADER_LEN``)."""


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Observer:
    """A plugin that observes every transfer and does nothing with it."""

    def __init__(self) -> None:
        self.seen = 0

    @hookimpl
    def accelopt_transfer_done(self, record: Any, start_s: float, end_s: float) -> None:
        self.seen += 1


def _round(mode: str, rank: int, i: int, values: list[torch.Tensor], transport: Any,
           records: Any) -> None:
    """One round: rank 0 sends every tensor to rank 1, rank 1 receives them."""
    n, numel = len(values), values[0].numel()
    if mode == "gloo":
        if rank == 0:
            works = [dist.isend(v, 1, tag=k) for k, v in enumerate(values)]
        else:
            works = [dist.irecv(torch.empty(numel), 0, tag=k) for k in range(n)]
        for work in works:
            work.wait()
    elif mode == "gloo+header":
        if rank == 0:
            works = []
            for k, v in enumerate(values):
                works.append(dist.isend(torch.zeros(HEADER_INTS, dtype=torch.int64), 1,
                                        tag=2 * k))
                works.append(dist.isend(v, 1, tag=2 * k + 1))
            for work in works:
                work.wait()
        else:
            headers = [torch.empty(HEADER_INTS, dtype=torch.int64) for _ in range(n)]
            posted = [dist.irecv(h, 0, tag=2 * k) for k, h in enumerate(headers)]
            for k in range(n):
                posted[k].wait()
                headers[k].tolist()  # what the receiver reads from it
                dist.irecv(torch.empty(numel), 0, tag=2 * k + 1).wait()
    else:  # accelopt, with or without an observing plugin
        if rank == 0:
            batch = records(i)
            transport.plan(i, 1, batch)
            for record, value in zip(batch, values, strict=True):
                transport.post(record, value)
            transport.complete(i)
        else:
            transport.receive(i, 0, dict(enumerate(records(i))), lambda _r, _p: None)


def _child(rank: int, port: int, tensors: int, numel: int, rounds: int,
           order: list[str], out: Any) -> None:
    from accelopt.drivers.cluster.transport import Transport
    from accelopt.host import PluginHost
    from accelopt.types import TransferRecord

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    names = [f"p{k}" for k in range(tensors)]
    from accelopt.plugin import PluginSpec

    observer = _Observer()
    observed = PluginHost([(PluginSpec(name="observer", factory=lambda _c: observer),
                            observer)])
    observed.trace = []  # a run's default: every hook call on its timeline

    def transport_with(host: PluginHost) -> Transport:
        return Transport(rank=rank, host=host, t0_epoch=time.time(), process=f"rank {rank}",
                         timeout_s=60.0, device=torch.device("cpu"),
                         tensor_ids={name: k for k, name in enumerate(names)})

    transports = {"accelopt": transport_with(PluginHost([])),
                  "accelopt+done": transport_with(observed)}

    def records(i: int) -> list[TransferRecord]:
        return [TransferRecord("j", i, 0, 1, name, 4 * numel, k, "param")
                for k, name in enumerate(names)]

    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(numel, generator=generator) for _ in range(tensors)]
    i = 0
    try:
        for mode in order:
            transport = transports.get(mode)
            _round(mode, rank, i, values, transport, records)  # warm: buffers, pairs
            i += 1
            dist.barrier()
            cpu0 = _cpu_s()
            for _ in range(rounds):
                _round(mode, rank, i, values, transport, records)
                i += 1
            cpu = _cpu_s() - cpu0
            dist.barrier()
            out.put((mode, rank, 1e6 * cpu / (rounds * tensors)))
    finally:
        for transport in transports.values():
            transport.close()
        dist.destroy_process_group()
    # as accelopt's ranks end: the results flushed, then no interpreter teardown, whose
    # destruction of gloo's threads now and then aborted the process ("terminate called
    # without an active exception", exit -6)
    out.close()
    out.join_thread()
    release_before_exit()
    os._exit(0)


def measure(order: list[str], tensors: int, numel: int,
            rounds: int) -> dict[tuple[str, int], float]:
    """One invocation of both processes over ``order``: CPU us per transfer of the sender
    (rank 0) and the receiver (rank 1), by (mode, rank)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, port, tensors, numel, rounds, order, out))
             for r in range(2)]
    got = {}
    with _cli.stopping(procs):  # neither process outlives an error, Ctrl-C or SIGTERM
        for p in procs:
            p.start()
        for _ in range(2 * len(order)):
            mode, rank, us = out.get(timeout=600)
            got[(mode, rank)] = us
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise SystemExit(f"transport_cost: a process exited with {p.exitcode}")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--tensors", type=_cli.positive_int, default=28, help="transfers a round")
    ap.add_argument("--kib", type=_cli.positive_float, default=10.0, help="KiB per tensor (float32)")
    ap.add_argument("--rounds", type=_cli.positive_int, default=150, help="rounds per measurement")
    ap.add_argument("--repeats", type=_cli.positive_int, default=3, help="measurements of each, rotating")
    args = ap.parse_args()
    numel = max(1, int(args.kib * 1024 / 4))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}, torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"2 processes on the loopback (gloo, 1 thread each), {args.tensors} tensors of "
          f"{4 * numel / 1024:.1f} KiB a round, {args.rounds} rounds per measurement, "
          f"{args.repeats} repeats in rotating order", flush=True)
    per: dict[tuple[str, int], list[float]] = {(m, r): [] for m in MODES for r in (0, 1)}
    for r in range(args.repeats):
        order = list(MODES[r % len(MODES):] + MODES[:r % len(MODES)])
        got = measure(order, args.tensors, numel, args.rounds)
        for key, us in got.items():
            per[key].append(us)
        print(f"  repeat {r + 1}: " + ", ".join(
            f"{m} {got[(m, 1)]:.1f} us (sender {got[(m, 0)]:.1f})" for m in order), flush=True)
    med = {key: statistics.median(v) for key, v in per.items()}
    for rank, side in ((1, "receiver"), (0, "sender")):
        for mode in MODES:
            values = per[(mode, rank)]
            print(f"{mode:12} {side:8} CPU per transfer {med[(mode, rank)]:7.1f} us (min-max "
                  f"{min(values):.1f}-{max(values):.1f}) "
                  f"{med[(mode, rank)] / med[('gloo', rank)]:.2f}x gloo")
    print(f"an observing plugin adds {med[('accelopt+done', 1)] - med[('accelopt', 1)]:.0f} us "
          f"to a receive and {med[('accelopt+done', 0)] - med[('accelopt', 0)]:.0f} us to a send")
    print(f"accelopt receive: {med[('accelopt', 1)]:.0f} us of CPU per transfer (gloo floor "
          f"{med[('gloo', 1)]:.0f} us, with a header {med[('gloo+header', 1)]:.0f} us); "
          f"send {med[('accelopt', 0)]:.0f} us (gloo {med[('gloo', 0)]:.0f} us)")
    return 0


if __name__ == "__main__":
    _cli.run(main)
