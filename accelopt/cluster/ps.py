"""Parameter-server mode: synchronous SGD with parameters sharded over the servers.

Per iteration: every server posts each of its parameter tensors to each worker as its own
transfer; a worker starts forward as soon as the parameters of the first layer have arrived
(a forward pre-hook per layer, installed once when the worker starts, waits for that layer
only); each gradient is posted to its server the moment autograd has accumulated it; the
servers average the workers' gradients (weighted by shard size, so the result is the
gradient of the whole global batch) and apply the job's optimizer to their shard.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from accelopt.cluster.model import layer_modules, shard_by_bytes, shard_rows
from accelopt.cluster.rank import RankRuntime, Timer
from accelopt.cluster.transport import CommunicationError
from accelopt.runtime.job import make_optimizer
from accelopt.types import TransferRecord


class _Receivers:
    """Receiving threads of one iteration; the first error is re-raised on join."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        self.on_error: Callable[[], None] = lambda: None

    def start(self, fn: Callable[..., None], *args: Any) -> None:
        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - surfaced in join()
                if self.error is None:
                    self.error = exc
                self.on_error()

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        if self.error is not None:
            raise self.error


def _record(rt: RankRuntime, info: Any, iteration: int, source: int, destination: int,
            kind: str) -> TransferRecord:
    return TransferRecord(
        job_id=rt.job.info.job_id, iteration=iteration, source=source, destination=destination,
        tensor=info.name, nbytes=info.nbytes, layer_index=info.layer_index, kind=kind,  # type: ignore[arg-type]
    )


def _shards(rt: RankRuntime) -> dict[int, list[Any]]:
    servers = rt.settings.server_ranks()
    return dict(zip(servers, shard_by_bytes(rt.table, len(servers)), strict=True))


def run_server(rt: RankRuntime) -> None:
    for _ in server_steps(rt):
        pass


def run_worker(rt: RankRuntime) -> None:
    for _ in worker_steps(rt):
        pass


def server_steps(rt: RankRuntime) -> Iterator[int]:
    """The server's loop, one iteration per ``next()`` (it yields the iteration it just
    finished), so a multi-job run can interleave several jobs' iterations in one process."""
    shard = _shards(rt)[rt.rank]
    params = dict(rt.job.model.named_parameters())
    mine = [params[p.name] for p in shard]
    optimizer = make_optimizer(rt.spec, nn.ParameterList(mine)) if mine else None
    workers = rt.settings.worker_ranks()
    batch = rt.spec.batch_size
    weights = {w: (stop - start) / batch
               for w, (start, stop) in zip(workers, shard_rows(batch, len(workers)), strict=True)}
    timer = Timer(rt)
    for i in range(rt.spec.iterations):
        start, ctx = rt.iteration_start(i)
        grads: dict[int, dict[str, torch.Tensor | None]] = {w: {} for w in workers}
        receivers = _Receivers()
        for w in workers:
            records = {p.index: _record(rt, p, i, w, rt.rank, "grad") for p in shard}

            def deliver(rec: TransferRecord, payload: Any, got: dict = grads[w]) -> None:
                got[rec.tensor] = payload

            receivers.start(rt.transport.receive, i, w, records, deliver)
        for w in workers:
            records = [_record(rt, p, i, rt.rank, w, "param") for p in shard]
            rt.transport.plan(i, w, records)
            for rec, p in zip(records, shard, strict=True):
                rt.transport.post(rec, params[p.name].detach())
        rt.transport.wait_started(i)
        receivers.join()
        rt.transport.complete(i)
        timer.begin("optimizer", i)
        if optimizer is not None:
            with torch.no_grad():
                for p in shard:
                    total = torch.zeros_like(params[p.name])
                    for w in workers:
                        g = grads[w].get(p.name)
                        if g is not None:
                            total.add_(g.to(total.device), alpha=weights[w])
                    params[p.name].grad = total
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        timer.end()
        rt.iteration_end(ctx, start, None, 0)
        yield i
    rt.result.params = {p.name: params[p.name].detach().cpu().clone() for p in shard}


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


def worker_steps(rt: RankRuntime) -> Iterator[int]:
    """The worker's loop, one iteration per ``next()`` (see :func:`server_steps`)."""
    model = rt.job.model
    params = dict(model.named_parameters())
    shards = _shards(rt)
    owner = {p.name: s for s, shard in shards.items() for p in shard}
    layers = LayerArrivals(Counter(p.layer_index for p in rt.table), rt.settings.timeout_s)
    timer = Timer(rt)
    state: dict[str, Any] = {"iteration": 0, "posted": set()}

    def wait_layer(layer: int) -> None:
        needed = inside[layer]
        if all(layers.ready(n) for n in needed):
            return
        name = timer.pause()
        t = rt.now()
        for n in needed:
            layers.wait(n)
        rt.span(f"wait layer {layer}", "wait", t, rt.now(), "wait", iteration=layers.iteration)
        timer.resume(name)

    # A module's forward may use its submodules' parameters without calling their forward
    # (nn.MultiheadAttention reads out_proj.weight directly), so layer L also waits for the
    # layers below its module; the root module waits only for its own parameters.
    path = {p.layer_index: p.module for p in rt.table}
    inside = {layer: sorted(n for n, sub in path.items()
                            if n == layer or (mod and sub.startswith(mod + ".")))
              for layer, mod in path.items()}
    # per-layer waits, installed once: forward of layer L starts when L's parameters are in
    for layer, module in layer_modules(model, rt.table).items():
        module.register_forward_pre_hook(lambda _m, _a, layer=layer: wait_layer(layer))

    def post_grad(info: Any, grad: torch.Tensor | None, param: torch.Tensor) -> None:
        i = state["iteration"]
        state["posted"].add(info.name)
        payload = grad if grad is not None else torch.zeros_like(param)
        rt.transport.post(_record(rt, info, i, rt.rank, owner[info.name], "grad"), payload)

    for info in rt.table:
        params[info.name].register_post_accumulate_grad_hook(
            lambda p, info=info: post_grad(info, p.grad, p)
        )

    def deliver(rec: TransferRecord, payload: Any) -> None:
        if payload is not None:
            with torch.no_grad():
                params[rec.tensor].copy_(payload)
        layers.arrive(rec.layer_index)

    k = rt.settings.worker_index(rt.rank)
    row0, row1 = shard_rows(rt.spec.batch_size, rt.settings.workers)[k]
    for i in range(rt.spec.iterations):
        start, ctx = rt.iteration_start(i)
        state["iteration"], state["posted"] = i, set()
        layers.reset(i)
        receivers = _Receivers()
        receivers.on_error = lambda r=receivers: layers.fail(r.error)
        for s, shard in shards.items():
            receivers.start(rt.transport.receive, i, s,
                            {p.index: _record(rt, p, i, s, rt.rank, "param") for p in shard},
                            deliver)
            rt.transport.plan(i, s, [_record(rt, p, i, rt.rank, s, "grad") for p in shard])
        x, y = rt.job.dataset.batch(i, rt.spec.batch_size)
        x, y = x[row0:row1].to(rt.device), y[row0:row1].to(rt.device)
        for p in params.values():
            p.grad = None  # fresh gradient tensors: the previous ones may still be in flight
        timer.begin("forward", i)
        loss = rt.job.loss_fn(model(x), y)
        timer.end()
        timer.begin("backward", i)
        loss.backward()
        for info in rt.table:  # parameters the loss did not reach still owe their server
            if info.name not in state["posted"]:
                post_grad(info, None, params[info.name])
        timer.end()
        rt.transport.complete(i)
        receivers.join()
        rt.iteration_end(ctx, start, float(loss.detach()), int(y.shape[0]))
        yield i
    if k == 0:
        names = set(params)
        rt.result.buffers = {n: t.detach().cpu().clone()
                             for n, t in model.state_dict().items() if n not in names}
