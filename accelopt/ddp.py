"""accelopt's transfer hooks inside *your own* PyTorch DDP script.

``cluster.mode=allreduce`` wraps each job's model in ``DistributedDataParallel`` and carries
its gradient buckets through the transfer hooks with a DDP communication hook. The same hook
works in a training script that already uses DDP::

    from accelopt.ddp import comm_hook

    ddp = DistributedDataParallel(model)
    state, hook = comm_hook(model, plugins=[my_plugin])
    ddp.register_comm_hook(state, hook)

Each bucket then goes through ``accelopt_transfer_filter``, ``accelopt_transfer_encode``,
``accelopt_transfer_order`` (once per iteration), the all-reduce (or an all-gather when the
encoder returns a tuple of tensors), ``accelopt_transfer_decode`` and
``accelopt_transfer_done``, exactly as in an accelopt run, with records named ``bucket0``,
``bucket1``, … by the model's logical buckets (its parameters that require grad, as DDP's
buckets: a frozen parameter is never sent; ``bucket_mb`` each, backward order). Freeze
parameters before wrapping the model in DDP and making the hook; a trainable embedding with
``sparse=True`` is refused in one line (the hook carries dense buckets only). Plugins
are told ``accelopt_run_start`` once, with a :class:`~accelopt.types.RunInfo` that says
all-reduce mode, this rank and a :class:`~accelopt.types.JobInfo` of the model (its
parameter table and buckets). Gradients are averaged over the ranks, as DDP's own hook does.
``state.state_dict()`` / ``state.load_state_dict(saved)`` carry the plugins' own state (error
feedback, momentum) across a checkpoint of your script: save it on every rank with the model
and the optimizer, load it before the first backward. Pass ``load_state_dict`` exactly what
``state_dict()`` returned (``checkpoint["hook"]``); anything else is refused in one line. After
``state.close()`` the hook refuses every bucket: make a new one to train on.

For gradient compression without writing a plugin, ``accelopt_plugins.gradcomm.comm_hook``
builds the gradcomm plugin and calls this function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from accelopt.drivers.cluster.ddp_hook import BucketHook, reduce_bucket
from accelopt.drivers.cluster.settings import MAX_BUCKET_MB, MAX_TIMEOUT_S, positive_number
from accelopt.drivers.cluster.transport import Transport
from accelopt.errors import UserError
from accelopt.host import PluginHost
from accelopt.job.params import buckets_by_bytes, param_table
from accelopt.plugin import PluginSpec
from accelopt.types import ClusterInfo, JobInfo, RunInfo

DEFAULT_BUCKET_MB = 25.0
"""DDP's own default bucket size."""


def bucket_size(bucket_mb: object) -> int:
    """``bucket_mb`` in bytes, refused in one line unless a finite number > 0 (the checks of
    ``cluster.bucket_mb``). Its own function so that gradcomm's ``comm_hook`` checks it
    before comparing the ranks' settings: ``nan != nan``, so a nan given to every rank was
    reported as ranks given different settings, and ``inf`` overflowed ``int()``."""
    return max(1, int(positive_number(bucket_mb, "bucket_mb", "MiB per bucket",
                                      MAX_BUCKET_MB) * 2**20))


def timeout_seconds(timeout_s: object) -> float:
    """``timeout_s`` as a float, refused in one line unless a finite number > 0 (the checks
    of ``cluster.timeout_s``); its own function for the same reason as :func:`bucket_size`."""
    return positive_number(timeout_s, "timeout_s", "seconds a rank waits for the others",
                           MAX_TIMEOUT_S)


def comm_hook(
    model: nn.Module,
    plugins: Sequence[object | tuple[PluginSpec, object]] = (),
    *,
    process_group: Any = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    timeout_s: float = 300.0,
    job: JobInfo | None = None,
    run_dir: str = ".",
) -> tuple[BucketHook, Callable[..., Any]]:
    """``(state, hook)`` for ``ddp.register_comm_hook(state, hook)``.

    ``model`` is the module DDP wraps (not the DDP wrapper); ``plugins`` are plugin objects
    (their ``@hookimpl`` methods), or ``(PluginSpec, object)`` pairs to name them; the
    process group defaults to the default one. Pass the very group DDP was given
    (``DistributedDataParallel(model, process_group=...)``): the hook reduces on its own
    group, not on DDP's, and cannot check that they are the same (DDP does not hand its group
    to a communication hook). A hook on another group is not refused: on a smaller one (each
    rank's ``dist.new_group([rank])``) the gradients are not averaged across DDP's ranks and
    the replicas drift apart without an error; on one of other ranks it waits for them.
    ``job`` overrides the record the plugins are
    given (its optimizer and momentum matter to a codec that corrects for momentum); its
    parameter table and buckets are always the model's. ``bucket_mb`` and ``timeout_s``
    must be finite numbers > 0 (a nan or inf is refused in one line, as ``cluster.*``'s).
    For gradcomm's codecs alone, ``accelopt_plugins.gradcomm.comm_hook`` takes its options
    and builds the plugin.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise UserError("comm_hook takes the model DDP wraps, not the DDP wrapper: pass "
                        "ddp.module")
    refuse_sparse_gradients(model)
    bucket_bytes = bucket_size(bucket_mb)
    timeout_seconds(timeout_s)
    if not dist.is_initialized():
        raise UserError("comm_hook needs torch.distributed: call "
                        "dist.init_process_group(...) first")
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # dist.new_group's answer to a
        # rank outside the group: read as "not a process group", which the user did pass
        raise UserError(f"comm_hook: rank {dist.get_rank()} is not a member of process_group "
                        "(dist.new_group gives a rank outside the group no group); make the "
                        "hook, and DDP, only on the group's ranks, or pass None for the default")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise UserError(f"comm_hook: process_group={process_group!r} is not a process group; "
                        "pass the one DDP uses (dist.new_group(...)), or None for the default")
    active = [p if isinstance(p, tuple) else
              (PluginSpec(name=type(p).__name__, factory=lambda _c, p=p: p), p)
              for p in plugins]
    host = PluginHost(active)
    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    table = param_table(model)
    buckets = buckets_by_bytes(table, bucket_bytes, model)  # what DDP reduces: no frozen one
    base = job or JobInfo(job_id="ddp", name="ddp", model=type(model).__name__, kind="train",
                          arrival_s=0.0, iterations=0, batch_size=0)
    info = JobInfo(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                      "parameters": table, "buckets": buckets})
    device = next(model.parameters()).device
    backend = str(dist.get_backend(process_group))
    run = RunInfo(run_dir=run_dir, device=str(device), plugins=host.names, jobs=(info,),
                  seed=0, rank=rank, role="worker", world_size=world, leader=rank == 0,
                  cluster=ClusterInfo(mode="allreduce", workers=world, servers=0,
                                      backend=backend, bucket_bytes=bucket_bytes,
                                      timeout_s=timeout_s),
                  job=info)
    host.call("accelopt_run_start", run=run)
    transport = Transport(rank=rank, host=host, t0_epoch=0.0, process=f"rank {rank} (worker)",
                          timeout_s=timeout_s, device=device, group=process_group)
    state = BucketHook(transport, job_id=info.job_id, table=table, buckets=buckets,
                       model=model, weight=1.0 / world, self_planning=True)
    state.run = run
    return state, reduce_bucket


def refuse_sparse_gradients(model: nn.Module) -> None:
    """A trainable embedding built with ``sparse=True`` hands DDP a sparse gradient bucket,
    which the hook cannot cut into logical buckets nor a codec encode: backward failed
    with torch's long "Could not run 'aten::as_strided' ... 'SparseCPU' backend". Refused
    in one line when the hook is made (a frozen one has no gradient and is never sent)."""
    sparse = [name or type(m).__name__ for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
              and m.weight.requires_grad]
    if sparse:
        one = len(sparse) == 1
        names = ", ".join(f"'{name}'" for name in sparse[:3])
        raise UserError(f"comm_hook: {'embedding' if one else 'embeddings'} {names} "
                        f"{'was' if one else 'were'} built with sparse=True, whose sparse "
                        "gradients the hook cannot carry (DDP's buckets are cut and encoded "
                        f"as dense tensors): build {'it' if one else 'them'} with sparse=False")
