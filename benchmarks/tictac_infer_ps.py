"""Forward-only (inference) parameter-server runs for the TicTac benchmark.

The paper's largest claim (up to 37.7% more throughput) is for inference: each step the
worker receives every parameter from the parameter server and runs forward only, so the
order of the transfers decides how much of forward hides behind the link. The cluster
runtime trains only (``cluster.mode=ps`` needs ``kind: train``), so this module runs the
core's own pieces with two exchanges of its own: the job's one step (``Job.step`` of an
inference job), the plugins, their lifecycle and the transport of a cluster rank
(:class:`accelopt.drivers.cluster.rank.RankJob`, hence the same ``accelopt_transfer_order``
enforcement), the same shaped network namespace, the same per-layer waits (the PS worker's:
forward of a layer starts as soon as that layer's parameters are in), and the same metrics
(:func:`accelopt.drivers.cluster.outcome.build_outcome`).

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
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import _cli
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from accelopt.activation import activate
from accelopt.drivers.cluster import faults, netns
from accelopt.drivers.cluster.launch import free_port, join_local_rank
from accelopt.drivers.cluster.outcome import ClusterOutcome, build_outcome
from accelopt.drivers.cluster.ps import ClusterExchange, PsWorker, Receivers
from accelopt.drivers.cluster.rank import RankJob, RankResult
from accelopt.drivers.cluster.settings import ClusterSettings, settings_from
from accelopt.drivers.cluster.transport import Transport
from accelopt.drivers.lifecycle import Lifecycle
from accelopt.job import job_id_for, job_specs
from accelopt.types import RunInfo


class InferServer(ClusterExchange):
    """Once every worker asked for iteration i (a one-element request on the control group),
    post every parameter to every worker, in the order the plugins enforce."""

    computes = False
    steps = False

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport,
                 control: Any) -> None:
        super().__init__(settings, rank, transport)
        self.control = control

    def attach(self, job: Any, timer: Any) -> None:
        super().attach(job, timer)
        self.params = dict(job.model.named_parameters())

    def begin(self, iteration: int) -> None:
        request = torch.zeros(1)
        for w in self.settings.worker_ranks():  # every worker has started iteration i
            dist.recv(request, src=w, group=self.control)
        for w in self.settings.worker_ranks():
            records = [self.record(p, iteration, self.rank, w, "param") for p in self.table]
            self.transport.plan(iteration, w, records)
            for rec in records:
                self.transport.post(rec, self.params[rec.tensor].detach())

    def end(self, iteration: int) -> None:
        self.transport.complete(iteration)


class InferWorker(PsWorker):
    """The PS worker's per-layer waits and receives, asking the server for each iteration
    first; no gradients (an inference step has none)."""

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport,
                 control: Any) -> None:
        super().__init__(settings, rank, transport)
        self.control = control

    def begin(self, iteration: int) -> None:
        server = self.settings.server_ranks()[0]
        self._iteration = iteration
        self.layers.reset(iteration)
        receivers = Receivers(on_error=self.layers.fail)
        receivers.start(self.transport.receive, iteration, server,
                        {p.index: self.record(p, iteration, server, self.rank, "param")
                         for p in self.table}, self._deliver)
        self._receivers = receivers
        dist.send(torch.full((1,), float(iteration)), dst=server, group=self.control)

    def end(self, iteration: int) -> None:
        assert self._receivers is not None
        self._receivers.join()


def run_inference(cfg: DictConfig, run_dir: str) -> ClusterOutcome:
    """``cfg`` as for ``run_cluster`` (cluster.mode=ps, one server); the job is run forward
    only whatever its ``kind``. Returns the same outcome a cluster run returns."""
    settings = settings_from(cfg.cluster)
    if settings.mode != "ps" or settings.servers != 1:
        raise ValueError("the inference harness needs cluster.mode=ps with 1 server")
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tictac-infer-") as work:
        out = Path(work) / "results.pkl"
        with contextlib.ExitStack() as stack:
            ends = stack.enter_context(netns.network(settings.network, settings.links()))
            ctx = mp.get_context("spawn")
            port = free_port() if settings.network != "hosts" else 29500
            procs = [ctx.Process(target=_child, args=(r, settings.world_size, cfg_yaml, port,
                                                      t0, ends[r], ends[0].address, run_dir,
                                                      str(out)))
                     for r in range(settings.world_size)]
            stack.enter_context(_cli.stopping(procs))  # no rank outlives SIGTERM or Ctrl-C
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
    return build_outcome(ranks, settings)


def _child(rank: int, world: int, cfg_yaml: str, port: int, t0: float,
           endpoint: netns.Endpoint, master: str, run_dir: str, out: str) -> None:
    faults.die_with_parent()
    try:
        init_method = join_local_rank(rank, world, port, endpoint, master)
        cfg = OmegaConf.create(cfg_yaml)
        settings = settings_from(cfg.cluster)
        torch.set_num_threads(1)  # as a cluster rank does
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world,
                                timeout=timedelta(seconds=settings.timeout_s))
        origin = [t0]
        dist.broadcast_object_list(origin, src=0)
        torch.manual_seed(int(cfg.run.seed))
        control = dist.new_group(backend="gloo")  # the step requests, apart from the transfers
        (spec,) = job_specs(cfg)[:1]
        spec.kind = "infer"  # forward only, whatever the config says
        job_id = job_id_for(0, spec)
        plugins = activate(cfg, _registry(), [job_id])
        role = settings.role(rank)
        exchange = (lambda t: InferServer(settings, rank, t, control)) if role == "server" \
            else (lambda t: InferWorker(settings, rank, t, control))
        job = RankJob(spec, job_id, settings=settings, rank=rank, device=torch.device("cpu"),
                      backend="gloo", plugins=plugins, t0_epoch=float(origin[0]), group=None,
                      servers_group=None, label="", exchange=exchange)
        info = RunInfo(run_dir, "cpu", plugins.names, (), int(cfg.run.seed), rank=rank,
                       role=role, world_size=world, leader=rank == 0,  # type: ignore[arg-type]
                       cluster=settings.info("gloo"))
        lifecycle = Lifecycle(plugins, info)
        lifecycle.job_built([job.job])
        lifecycle.start()
        train_t0 = job.now()
        for _ in range(spec.iterations):
            job.step("cluster", None)
        result = RankResult(rank=rank, role=role, pid=os.getpid(), train_t0=train_t0,
                            job_scoped=plugins.job_scoped)
        result.plugin_rows = lifecycle.rows()
        lifecycle.end({"rank": rank, "role": role})
        result.parts[job_id] = job.finish()
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


def _registry() -> Any:
    from accelopt.plugin import Registry

    return Registry.discover()
