"""All-reduce mode as the exchange of a job's step: every rank holds the whole model, wrapped
in PyTorch's ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA) on the job's own
process group.

DDP does what it does in any script: it broadcasts rank 0's parameters at the start, fires
each gradient bucket's all-reduce the moment autograd has produced it (so communication
overlaps backward) and writes the reduced gradients into ``.grad`` before backward returns.
What accelopt adds is DDP's communication hook (``ddp_hook.py``): every bucket goes through
the transport, and so through the transfer hooks (filter, encode, order, decode, done), as the
job's logical buckets (``JobInfo.buckets``, named ``bucket0``, ``bucket1``, … in every
iteration). Each rank scales its gradients by its share of the global batch's loss first (its
rows' share, or its labelled positions' where the model's loss is a mean over them:
``Job.loss_share``), so the sum is the global batch's mean gradient. The job's step then runs
``accelopt_before_optimizer_step`` on the final gradients and every rank takes the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accelopt.drivers.cluster.ddp_hook import BucketHook, reduce_bucket
from accelopt.drivers.cluster.ps import ClusterExchange
from accelopt.drivers.cluster.settings import ClusterSettings
from accelopt.drivers.cluster.transport import Transport
from accelopt.errors import UserError, listed
from accelopt.job.params import replaced_parameters, shard_rows

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
        self.hook: BucketHook | None = None
        self.ddp: DistributedDataParallel | None = None
        self.row_share = 1.0
        """This rank's rows over the batch's: its weight unless :meth:`weigh` says another."""

    def rows(self, batch_size: int) -> tuple[int, int]:
        return shard_rows(batch_size, self.settings.workers)[self.index]

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        super().attach(job, timer)
        self.params = dict(job.model.named_parameters())
        self.model = job.model
        self.job_name = job.info.name
        if job.info.kind != "train":
            return  # nothing to reduce: every rank runs forward on its rows
        row0, row1 = self.rows(job.info.batch_size)
        self.row_share = (row1 - row0) / job.info.batch_size
        self.hook = BucketHook(self.transport, job_id=self.job_id, table=self.table,
                               buckets=job.info.buckets, model=job.model,
                               weight=self.row_share)
        device = next(job.model.parameters()).device
        self.ddp = DistributedDataParallel(
            job.model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.transport.group,
            bucket_cap_mb=self.settings.bucket_bytes / 2**20,
        )
        self.ddp.register_comm_hook(self.hook, reduce_bucket)
        self.hook.on_last_bucket = lambda: timer.waiting_from_here("wait all-reduce")
        job.forward = self.ddp

    def begin(self, iteration: int) -> None:
        if self.hook is not None:
            self.hook.begin(iteration)

    def weigh(self, share: float | None) -> None:
        if self.hook is not None:
            self.hook.weight = self.row_share if share is None else share

    def gradients(self, iteration: int,
                  update: Callable[[Sequence[str]], None] | None = None) -> bool:
        """DDP has already written the reduced buckets into ``.grad`` (backward waited for
        them); collect the iteration's transfers and any error. Every rank steps the whole
        model itself (``update`` unused)."""
        if self.hook is not None:
            unused = self.hook.unsent(self.params)
            if unused is not None:
                self._refuse_replaced(iteration)
                raise UserError(
                    f"job '{self.job_name}': {listed(unused, 4)} got no gradient in iteration {iteration} "
                    "(the loss does not use them), and all-reduce (PyTorch DDP) needs every "
                    "trainable parameter in the loss; freeze them (requires_grad_(False)) "
                    "or use cluster.mode=ps")
            self.transport.finish_allreduce(iteration)
        return False

    def _refuse_replaced(self, iteration: int) -> None:
        """A parameter replaced by a new object after DDP wrapped the model (a plugin's
        ``lin.weight = nn.Parameter(...)``) also leaves DDP without its gradient; say that,
        not that the loss does not use it."""
        replaced = replaced_parameters(self.params, self.model)
        if replaced:
            raise UserError(
                f"job '{self.job_name}': {listed(replaced, 4)} replaced by a new Parameter "
                f"object after the job was built (found in iteration {iteration}); DDP still "
                "holds the old one. Change parameters' values in place (with torch.no_grad(): "
                "param.copy_(new)) or change the model at build time (accelopt_layer_build)")

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self.rank != 0:
            return {}, {}
        names = set(self.params)
        return ({n: p.detach().cpu().clone() for n, p in self.params.items()},
                {n: t.detach().cpu().clone() for n, t in model.state_dict().items()
                 if n not in names})
