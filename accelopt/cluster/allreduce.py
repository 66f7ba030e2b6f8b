"""All-reduce mode: every rank holds the whole model; gradients are summed in buckets.

Buckets (``cluster.bucket_mb``, backward order, like PyTorch DDP) are posted to the
transport the moment autograd has accumulated all of their gradients, so their async
``all_reduce`` runs while backward continues on earlier layers. Each rank scales its
gradients by its share of the global batch first, so the sum is the global batch's mean
gradient; every rank then takes the same optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from accelopt.cluster.model import buckets_by_bytes, shard_rows
from accelopt.cluster.rank import RankRuntime, Timer
from accelopt.cluster.transport import ALL_RANKS
from accelopt.types import TransferRecord


def run_worker(rt: RankRuntime) -> None:
    model = rt.job.model
    optimizer = rt.job.optimizer
    assert optimizer is not None
    params = dict(model.named_parameters())
    buckets = buckets_by_bytes(rt.table, rt.settings.bucket_bytes)
    bucket_of = {p.name: b for b, bucket in enumerate(buckets) for p in bucket}
    k = rt.settings.worker_index(rt.rank)
    row0, row1 = shard_rows(rt.spec.batch_size, rt.settings.workers)[k]
    weight = (row1 - row0) / rt.spec.batch_size
    timer = Timer(rt)
    state: dict[str, Any] = {"iteration": 0, "ready": [0] * len(buckets), "posted": set()}

    def record(b: int, i: int) -> TransferRecord:
        bucket = buckets[b]
        return TransferRecord(
            job_id=rt.job.info.job_id, iteration=i, source=rt.rank, destination=ALL_RANKS,
            tensor=f"bucket{b}", nbytes=sum(p.nbytes for p in bucket),
            layer_index=min(p.layer_index for p in bucket), kind="grad",
        )

    def post_bucket(b: int) -> None:
        state["posted"].add(b)
        with torch.no_grad():
            flat = torch.cat([
                (params[p.name].grad if params[p.name].grad is not None
                 else torch.zeros_like(params[p.name])).reshape(-1)
                for p in buckets[b]
            ]).mul_(weight)
        rt.transport.post(record(b, state["iteration"]), flat)

    def on_grad(name: str) -> None:
        b = bucket_of[name]
        state["ready"][b] += 1
        if state["ready"][b] == len(buckets[b]):
            post_bucket(b)

    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: on_grad(name))

    for i in range(rt.spec.iterations):
        start, ctx = rt.iteration_start(i)
        state.update(iteration=i, ready=[0] * len(buckets), posted=set())
        rt.transport.plan(i, ALL_RANKS, [record(b, i) for b in range(len(buckets))])
        x, y = rt.job.dataset.batch(i, rt.spec.batch_size)
        x, y = x[row0:row1].to(rt.device), y[row0:row1].to(rt.device)
        optimizer.zero_grad(set_to_none=True)
        timer.begin("forward", i)
        loss = rt.job.loss_fn(model(x), y)
        timer.end()
        timer.begin("backward", i)
        loss.backward()
        for b in range(len(buckets)):
            if b not in state["posted"]:
                post_bucket(b)
        timer.end()
        summed = rt.transport.finish_allreduce(i)
        timer.begin("optimizer", i)
        with torch.no_grad():
            for b, bucket in enumerate(buckets):
                flat = summed[f"bucket{b}"].reshape(-1)
                offset = 0
                for p in bucket:
                    t = params[p.name]
                    n = t.numel()
                    t.grad = flat[offset:offset + n].view_as(t).to(t.dtype).clone()
                    offset += n
        optimizer.step()
        timer.end()
        rt.iteration_end(ctx, start, float(loss.detach()), int(y.shape[0]))
    if rt.rank == 0:
        rt.result.params = {n: p.detach().cpu().clone() for n, p in params.items()}
        rt.result.buffers = {n: t.detach().cpu().clone()
                             for n, t in model.state_dict().items() if n not in params}
