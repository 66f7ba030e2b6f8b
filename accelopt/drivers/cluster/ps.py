"""Parameter-server mode: synchronous SGD with parameters sharded over the servers, as the
two exchanges a job's step uses on a server and on a worker.

Per iteration: every server posts each of its parameter tensors to each worker as its own
transfer (``begin``); a worker starts forward as soon as the parameters of the first layer
have arrived (a forward pre-hook per layer, installed once in ``attach``, waits for that
layer only); each gradient is posted to its server the moment autograd has accumulated it;
the servers average the workers' gradients (weighted by shard size, so the result is the
gradient of the whole global batch: ``gradients``), and the job's step then runs
``accelopt_before_optimizer_step`` and the optimizer on the server's shard.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from accelopt.drivers.cluster.settings import ClusterSettings
from accelopt.drivers.cluster.transport import CommunicationError, Transport
from accelopt.job import Exchange
from accelopt.job.params import layer_modules, shard_by_bytes, shard_rows
from accelopt.types import ParamInfo, Role, TransferRecord

if TYPE_CHECKING:
    from accelopt.job import Job
    from accelopt.job.timeline import PhaseTimer


class Receivers:
    """Receiving threads of one iteration; the first error is re-raised on join."""

    def __init__(self, on_error: Callable[[BaseException | None], None] | None = None) -> None:
        self.threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        self.on_error = on_error

    def start(self, fn: Callable[..., None], *args: Any) -> None:
        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - surfaced in join()
                if self.error is None:
                    self.error = exc
                if self.on_error is not None:
                    self.on_error(self.error)

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        if self.error is not None:
            raise self.error


class ClusterExchange(Exchange):
    """What the PS and all-reduce exchanges share: the rank, the settings, the transport and
    the records of the job's transfers."""

    moves = True

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport) -> None:
        self.settings = settings
        self.rank = rank
        self.transport = transport
        self.role: Role = settings.role(rank)  # type: ignore[assignment]
        self.job_id = ""
        self.table: tuple[ParamInfo, ...] = ()

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        self.job_id = job.info.job_id
        self.table = job.info.parameters
        self.transport.tensor_ids = {p.name: p.index for p in self.table}

    def record(self, info: ParamInfo, iteration: int, source: int, destination: int,
               kind: str) -> TransferRecord:
        return TransferRecord(
            job_id=self.job_id, iteration=iteration, source=source, destination=destination,
            tensor=info.name, nbytes=info.nbytes, layer_index=info.layer_index,
            kind=kind,  # type: ignore[arg-type]
        )

    def shards(self) -> dict[int, list[ParamInfo]]:
        servers = self.settings.server_ranks()
        return dict(zip(servers, shard_by_bytes(self.table, len(servers)), strict=True))

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(parameters, buffers) this rank reports at the end (what it is the owner of)."""
        return {}, {}

    def close(self) -> None:
        self.transport.close()


class PsServer(ClusterExchange):
    """A parameter server: sends its shard, averages the workers' gradients into it; the job's
    optimizer updates the shard."""

    computes = False
    steps = True
    whole = False

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport,
                 servers_group: Any = None) -> None:
        super().__init__(settings, rank, transport)
        self.servers_group = servers_group
        self.whole = settings.servers == 1
        workers = settings.worker_ranks()
        self.workers = workers
        self._grads: dict[int, dict[str, torch.Tensor | None]] = {}
        self._receivers: Receivers | None = None

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        super().attach(job, timer)
        self.shard = self.shards()[self.rank]
        self.params = dict(job.model.named_parameters())
        batch = job.info.batch_size
        self.weights = {w: (stop - start) / batch for w, (start, stop) in
                        zip(self.workers, shard_rows(batch, len(self.workers)), strict=True)}

    def rows(self, batch_size: int) -> tuple[int, int]:
        return shard_rows(batch_size, self.settings.workers)[0]  # worker 0's (job_built)

    def stepped_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(model.named_parameters())
        return {p.name: params[p.name] for p in self.shards()[self.rank]}

    def begin(self, iteration: int) -> None:
        t = self.transport
        self._grads = {w: {} for w in self.workers}
        receivers = Receivers()
        for w in self.workers:
            records = {p.index: self.record(p, iteration, w, self.rank, "grad") for p in self.shard}

            def deliver(rec: TransferRecord, payload: Any, got: dict = self._grads[w]) -> None:
                got[rec.tensor] = payload

            receivers.start(t.receive, iteration, w, records, deliver)
        self._receivers = receivers
        for w in self.workers:
            records = [self.record(p, iteration, self.rank, w, "param") for p in self.shard]
            t.plan(iteration, w, records)
            for rec, p in zip(records, self.shard, strict=True):
                t.post(rec, self.params[p.name].detach())

    def gradients(self, iteration: int) -> None:
        t = self.transport
        t.wait_started(iteration)
        assert self._receivers is not None
        self._receivers.join()
        t.complete(iteration)  # the parameters left: the optimizer may change them now
        with torch.no_grad():
            for p in self.shard:
                param = self.params[p.name]
                total = torch.zeros_like(param)
                for w in self.workers:
                    g = self._grads[w].get(p.name)
                    if g is not None:
                        total.add_(g.to(total.device), alpha=self.weights[w])
                param.grad = total

    def reduce(self, value: float, op: str) -> float:
        if self.settings.servers == 1:
            return value
        box = torch.tensor([value], dtype=torch.float64, device=self.transport.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=self.servers_group)
        return float(box.item())

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {p.name: self.params[p.name].detach().cpu().clone() for p in self.shard}, {}


class LayerArrivals:
    """Which layers' parameters have arrived in the current iteration (a forward pre-hook
    per layer waits on it, so forward starts as soon as its first layer is in)."""

    def __init__(self, counts: Counter[int], timeout_s: float) -> None:
        self.counts = counts
        self.timeout_s = timeout_s
        self.arrived: Counter[int] = Counter()
        self.iteration = -1
        self.cv = threading.Condition()
        self.error: BaseException | None = None

    def reset(self, iteration: int) -> None:
        with self.cv:
            self.iteration, self.arrived, self.error = iteration, Counter(), None

    def arrive(self, layer: int) -> None:
        with self.cv:
            self.arrived[layer] += 1
            self.cv.notify_all()

    def fail(self, error: BaseException | None) -> None:
        with self.cv:
            self.error = error or CommunicationError("a receiving thread failed")
            self.cv.notify_all()

    def ready(self, layer: int) -> bool:
        return self.arrived[layer] >= self.counts[layer]

    def wait(self, layer: int) -> None:
        with self.cv:
            ok = self.cv.wait_for(lambda: self.error is not None or self.ready(layer),
                                  timeout=self.timeout_s)
            if self.error is not None:
                raise self.error
            if not ok:
                raise CommunicationError(
                    f"parameters of layer {layer} did not arrive within {self.timeout_s:g} s "
                    f"at iteration {self.iteration}"
                )


class PsWorker(ClusterExchange):
    """A worker: receives the parameters layer by layer during forward, pushes each gradient
    to its server the moment autograd has it; takes no optimizer step."""

    computes = True
    steps = False

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport) -> None:
        super().__init__(settings, rank, transport)
        self.index = settings.worker_index(rank)
        self.stream = self.index
        self._iteration = 0
        self._posted: set[str] = set()
        self._receivers: Receivers | None = None

    def rows(self, batch_size: int) -> tuple[int, int]:
        return shard_rows(batch_size, self.settings.workers)[self.index]

    def stepped_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return {}

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        super().attach(job, timer)
        model = job.model
        self.model = model
        self.params = dict(model.named_parameters())
        self._shards = self.shards()
        self.owner = {p.name: s for s, shard in self._shards.items() for p in shard}
        self.layers = LayerArrivals(Counter(p.layer_index for p in self.table),
                                    self.settings.timeout_s)
        # A module's forward may use its submodules' parameters without calling their
        # forward (nn.MultiheadAttention reads out_proj.weight directly), so layer L also
        # waits for the layers below its module; the root module waits only for its own.
        path = {p.layer_index: p.module for p in self.table}
        inside = {layer: sorted(n for n, sub in path.items()
                                if n == layer or (mod and sub.startswith(mod + ".")))
                  for layer, mod in path.items()}
        layers = self.layers

        def wait_layer(layer: int) -> None:
            needed = inside[layer]
            if all(layers.ready(n) for n in needed):
                return
            timer.wait(f"wait layer {layer}", lambda: [layers.wait(n) for n in needed])

        # per-layer waits, installed once: forward of layer L starts when L's parameters are in
        for layer, module in layer_modules(model, self.table).items():
            module.register_forward_pre_hook(lambda _m, _a, layer=layer: wait_layer(layer))
        for info in self.table:
            self.params[info.name].register_post_accumulate_grad_hook(
                lambda p, info=info: self._post_grad(info, p.grad, p))

    def _post_grad(self, info: ParamInfo, grad: torch.Tensor | None, param: torch.Tensor) -> None:
        self._posted.add(info.name)
        payload = grad if grad is not None else torch.zeros_like(param)
        self.transport.post(self.record(info, self._iteration, self.rank, self.owner[info.name],
                                        "grad"), payload)

    def _deliver(self, rec: TransferRecord, payload: Any) -> None:
        if payload is not None:
            with torch.no_grad():
                self.params[rec.tensor].copy_(payload)
        self.layers.arrive(rec.layer_index)

    def begin(self, iteration: int) -> None:
        t = self.transport
        self._iteration, self._posted = iteration, set()
        self.layers.reset(iteration)
        receivers = Receivers(on_error=self.layers.fail)
        for s, shard in self._shards.items():
            receivers.start(t.receive, iteration, s,
                            {p.index: self.record(p, iteration, s, self.rank, "param")
                             for p in shard}, self._deliver)
            t.plan(iteration, s, [self.record(p, iteration, self.rank, s, "grad") for p in shard])
        self._receivers = receivers

    def gradients(self, iteration: int) -> None:
        for info in self.table:  # parameters the loss did not reach still owe their server
            if info.name not in self._posted:
                self._post_grad(info, None, self.params[info.name])
        self.transport.complete(iteration)
        assert self._receivers is not None
        self._receivers.join()

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self.index != 0:
            return {}, {}
        names = set(self.params)
        return {}, {n: t.detach().cpu().clone() for n, t in model.state_dict().items()
                    if n not in names}
