"""All-reduce mode as the exchange of a job's step: every rank holds the whole model;
gradients are summed in buckets.

Buckets (``JobInfo.buckets``: ``cluster.bucket_mb`` each, backward order, like PyTorch DDP)
are posted to the transport the moment autograd has accumulated all of their gradients, so
their async ``all_reduce`` runs while backward continues on earlier layers. Each rank scales
its gradients by its share of the global batch first, so the sum is the global batch's mean
gradient. ``gradients`` waits for every bucket and writes the sums into ``.grad``; the job's
step then runs ``accelopt_before_optimizer_step`` on them and every rank takes the same step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from accelopt.drivers.cluster.ps import ClusterExchange
from accelopt.drivers.cluster.settings import ClusterSettings
from accelopt.drivers.cluster.transport import ALL_RANKS, Transport
from accelopt.job.params import shard_rows
from accelopt.types import ParamInfo, TransferRecord

if TYPE_CHECKING:
    from accelopt.job import Job
    from accelopt.job.timeline import PhaseTimer


class AllReduce(ClusterExchange):
    """One rank of an all-reduce job."""

    computes = True
    steps = True
    whole = True

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport) -> None:
        super().__init__(settings, rank, transport)
        self.index = settings.worker_index(rank)
        self.stream = self.index
        self._iteration = 0
        self._ready: list[int] = []
        self._posted: set[int] = set()

    def rows(self, batch_size: int) -> tuple[int, int]:
        return shard_rows(batch_size, self.settings.workers)[self.index]

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        super().attach(job, timer)
        self.params = dict(job.model.named_parameters())
        self.buckets: list[list[ParamInfo]] = [[self.table[i] for i in b]
                                               for b in job.info.buckets]
        bucket_of = {p.name: b for b, bucket in enumerate(self.buckets) for p in bucket}
        row0, row1 = self.rows(job.info.batch_size)
        self.weight = (row1 - row0) / job.info.batch_size
        self._ready = [0] * len(self.buckets)

        def on_grad(name: str) -> None:
            b = bucket_of[name]
            self._ready[b] += 1
            if self._ready[b] == len(self.buckets[b]):
                self._post_bucket(b)

        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(lambda _p, name=name: on_grad(name))

    def _record(self, b: int, iteration: int) -> TransferRecord:
        bucket = self.buckets[b]
        return TransferRecord(
            job_id=self.job_id, iteration=iteration, source=self.rank, destination=ALL_RANKS,
            tensor=f"bucket{b}", nbytes=sum(p.nbytes for p in bucket),
            layer_index=min(p.layer_index for p in bucket), kind="grad",
        )

    def _post_bucket(self, b: int) -> None:
        self._posted.add(b)
        with torch.no_grad():
            flat = torch.cat([
                (self.params[p.name].grad if self.params[p.name].grad is not None
                 else torch.zeros_like(self.params[p.name])).reshape(-1)
                for p in self.buckets[b]
            ]).mul_(self.weight)
        self.transport.post(self._record(b, self._iteration), flat)

    def begin(self, iteration: int) -> None:
        self._iteration = iteration
        self._ready = [0] * len(self.buckets)
        self._posted = set()
        self.transport.plan(iteration, ALL_RANKS,
                            [self._record(b, iteration) for b in range(len(self.buckets))])

    def gradients(self, iteration: int) -> None:
        for b in range(len(self.buckets)):
            if b not in self._posted:
                self._post_bucket(b)
        summed = self.transport.finish_allreduce(iteration)
        with torch.no_grad():
            for b, bucket in enumerate(self.buckets):
                flat = summed[f"bucket{b}"].reshape(-1)
                offset = 0
                for p in bucket:
                    t = self.params[p.name]
                    n = t.numel()
                    value = flat[offset:offset + n].view_as(t).to(t.dtype)
                    if t.grad is None:
                        t.grad = value.clone()
                    else:
                        t.grad.copy_(value)
                    offset += n

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self.rank != 0:
            return {}, {}
        names = set(self.params)
        return ({n: p.detach().cpu().clone() for n, p in self.params.items()},
                {n: t.detach().cpu().clone() for n, t in model.state_dict().items()
                 if n not in names})
