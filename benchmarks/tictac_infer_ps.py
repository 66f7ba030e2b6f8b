"""Forward-only (inference) parameter-server runs for the TicTac benchmark.

The paper's largest claim (up to 37.7% more throughput) is for inference: each step the
worker receives every parameter from the parameter server and runs forward only, so the
order of the transfers decides how much of forward hides behind the link. The cluster
runtime trains only (``cluster.mode=ps`` needs ``kind: train``), so this module runs the
same pieces with a forward-only loop: the job, the plugins and the transport of a cluster
rank (:class:`accelopt.cluster.rank.RankRuntime`, hence the same ``accelopt_transfer_order``
enforcement), the same shaped network namespace, the same per-layer waits (forward of a
layer starts as soon as that layer's parameters are in), and the same metrics
(:func:`accelopt.cluster.outcome.build_outcome`).

Per iteration: each worker posts its receives and asks for the parameters (a one-element
request on a separate process group, as a TensorFlow worker's step starts its recvs); the
server, once every worker asked, posts every parameter to every worker (one transfer each,
in the order the plugin enforces, or in layer order without it); each worker receives them
in a thread while forward runs, layer by layer as parameters arrive. The request keeps the
server from starting iteration i+1's transfers while a worker still computes iteration i,
which would date those transfers' starts before the worker's iteration (and distort Mc, a
and E for orders with a long forward tail).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from accelopt.cluster import faults, netns
from accelopt.cluster.launch import free_port, join_local_rank
from accelopt.cluster.model import layer_modules, shard_rows
from accelopt.cluster.outcome import ClusterOutcome, build_outcome
from accelopt.cluster.ps import LayerArrivals
from accelopt.cluster.rank import RankRuntime, Timer
from accelopt.cluster.settings import settings_from
from accelopt.types import TransferRecord


def run_inference(cfg: DictConfig, run_dir: str) -> ClusterOutcome:
    """``cfg`` as for ``run_cluster`` (cluster.mode=ps, one server); the job is run forward
    only whatever its ``kind``. Returns the same outcome a cluster run returns."""
    settings = settings_from(cfg.cluster)
    if settings.mode != "ps" or settings.servers != 1:
        raise ValueError("the inference harness needs cluster.mode=ps with 1 server")
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    shape = netns.Shape(settings.bandwidth_bps, settings.latency_s)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tictac-infer-") as work:
        out = Path(work) / "results.pkl"
        with contextlib.ExitStack() as stack:
            space = stack.enter_context(netns.Namespace(shape)) if settings.shaped else None
            name = space.name if space is not None else None
            ctx = mp.get_context("spawn")
            port = free_port()
            procs = [ctx.Process(target=_child, args=(r, settings.world_size, cfg_yaml, port,
                                                      t0, name, run_dir, str(out)))
                     for r in range(settings.world_size)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + 60 + 10 * settings.timeout_s
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
            if bad or not out.exists():
                errors = sorted(Path(work).glob("failure-*"))
                detail = errors[0].read_text()[:2000] if errors else ""
                raise RuntimeError(f"inference ranks failed (rank, exit code): {bad}\n{detail}")
        with open(out, "rb") as fh:
            ranks = pickle.load(fh)
    return build_outcome(ranks, settings, cfg)


def _child(rank: int, world: int, cfg_yaml: str, port: int, t0: float,
           namespace: str | None, run_dir: str, out: str) -> None:
    faults.die_with_parent()
    try:
        join_local_rank(rank, world, port, namespace)
        cfg = OmegaConf.create(cfg_yaml)
        settings = settings_from(cfg.cluster)
        torch.set_num_threads(1)  # as a cluster rank does
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=timedelta(seconds=settings.timeout_s))
        origin = [t0]
        dist.broadcast_object_list(origin, src=0)
        torch.manual_seed(int(cfg.run.seed))
        control = dist.new_group(backend="gloo")  # the step requests, apart from the transfers
        rt = RankRuntime(cfg, settings, rank, world, float(origin[0]), torch.device("cpu"),
                         "gloo", run_dir, None)
        rt.host.call("accelopt_run_start", run=rt.run_info)
        (_serve if rt.role == "server" else _infer)(rt, control)
        result = rt.finish()
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            with open(out + ".tmp", "wb") as fh:
                pickle.dump(gathered, fh)
            os.replace(out + ".tmp", out)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        import traceback

        Path(out).with_name(f"failure-{rank}").write_text(
            f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        os._exit(1)
    os._exit(0)


def _record(rt: RankRuntime, info: Any, iteration: int, destination: int) -> TransferRecord:
    return TransferRecord(job_id=rt.job.info.job_id, iteration=iteration, source=rt.rank,
                          destination=destination, tensor=info.name, nbytes=info.nbytes,
                          layer_index=info.layer_index, kind="param")


def _serve(rt: RankRuntime, control: Any) -> None:
    params = dict(rt.job.model.named_parameters())
    request = torch.zeros(1)
    for i in range(rt.spec.iterations):
        for w in rt.settings.worker_ranks():  # every worker has started iteration i
            dist.recv(request, src=w, group=control)
        start, ctx = rt.iteration_start(i)
        for w in rt.settings.worker_ranks():
            records = [_record(rt, p, i, w) for p in rt.table]
            rt.transport.plan(i, w, records)
            for rec in records:
                rt.transport.post(rec, params[rec.tensor].detach())
        rt.transport.complete(i)
        rt.iteration_end(ctx, start, None, 0)


def _infer(rt: RankRuntime, control: Any) -> None:
    model = rt.job.model
    model.eval()
    params = dict(model.named_parameters())
    arrivals = LayerArrivals(Counter(p.layer_index for p in rt.table), rt.settings.timeout_s)
    timer = Timer(rt)
    state = {"iteration": 0}

    def wait_layer(layer: int) -> None:
        if arrivals.ready(layer):
            return
        name = timer.pause()
        t = rt.now()
        arrivals.wait(layer)
        rt.span(f"wait layer {layer}", "wait", t, rt.now(), "wait",
                iteration=state["iteration"])
        timer.resume(name)

    for layer, module in layer_modules(model, rt.table).items():
        module.register_forward_pre_hook(lambda _m, _a, layer=layer: wait_layer(layer))

    def deliver(rec: TransferRecord, payload: Any) -> None:
        if payload is not None:
            with torch.no_grad():
                params[rec.tensor].copy_(payload)
        arrivals.arrive(rec.layer_index)

    server = rt.settings.server_ranks()[0]
    k = rt.settings.worker_index(rt.rank)
    row0, row1 = shard_rows(rt.spec.batch_size, rt.settings.workers)[k]
    for i in range(rt.spec.iterations):
        start, ctx = rt.iteration_start(i)
        state["iteration"] = i
        arrivals.reset(i)
        errors: list[BaseException] = []

        def receive(i: int = i, errors: list[BaseException] = errors) -> None:
            try:
                rt.transport.receive(
                    i, server, {p.index: TransferRecord(
                        rt.job.info.job_id, i, server, rt.rank, p.name, p.nbytes,
                        p.layer_index, "param") for p in rt.table}, deliver)
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)
                arrivals.fail(exc)

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        dist.send(torch.full((1,), float(i)), dst=server, group=control)
        x, y = rt.job.dataset.batch(i, rt.spec.batch_size)
        x, y = x[row0:row1], y[row0:row1]
        timer.begin("forward", i)
        with torch.no_grad():
            loss = rt.job.loss_fn(model(x), y)
        timer.end()
        thread.join()
        if errors:
            raise errors[0]
        rt.iteration_end(ctx, start, float(loss), int(y.shape[0]))
