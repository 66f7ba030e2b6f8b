"""gradcomm's codecs as a DDP communication hook for any PyTorch DDP script."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, get_type_hints

import torch.distributed as dist
from accelopt_plugins.gradcomm.config import GradcommConfig, momentum_factor, validate
from omegaconf import OmegaConf
from torch import nn

from accelopt import JobInfo
from accelopt.activation import plugin_config
from accelopt.config import differing_keys
from accelopt.errors import ConfigError
from accelopt.job.specs import OPTIMIZERS


def _same_on_every_rank(settings: dict[str, Any], process_group: Any) -> None:
    """Every rank must encode its buckets the same way: with another density, dtype or bucket
    size on one rank the all-reduces no longer match and the job waits for the process
    group's timeout (30 minutes by default) before gloo says "Connection closed". One
    gather of the settings when the hook is made (every rank makes it) says so at once."""
    world = dist.get_world_size(process_group)
    if world == 1:
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, settings, group=process_group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ConfigError(f"gradcomm.comm_hook: rank {rank} was given other settings than "
                              f"rank 0 ({differing_keys(everyone[0], theirs)}); every rank must "
                              "encode its buckets the same way: pass the same options on every "
                              "rank")


BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})
"""What a switch may be given besides True/False: the words the command line takes. Not a
number, nor a number's text: in Python, ``factor_masking=1`` or ``error_feedback="0"`` reads
as a count or a typo, and ``check_finite=2`` (as any non-zero number, for OmegaConf) was
read as true."""


def _refuse_non_bool(options: dict[str, Any]) -> None:
    """A switch (``check_finite``, ``error_feedback``, ...) given a number (``2``, ``1``,
    ``"0"``) is refused in one line: OmegaConf reads any non-zero number as true."""
    switches = {name for name, kind in get_type_hints(GradcommConfig).items()
                if kind in (bool, Optional[bool])}
    for key in sorted(switches & set(options)):
        value = options[key]
        if value is None or isinstance(value, bool) or (
                isinstance(value, str) and value.lower() in BOOL_WORDS):
            continue
        raise ConfigError(f"gradcomm.comm_hook: {key} is a switch: give True or False, "
                          f"got {value!r}")


def _refuse_non_group(process_group: Any) -> None:
    """``process_group`` must be None (the default group) or a ``ProcessGroup``: anything
    else (``"x"``) failed inside torch's gather of the ranks' settings with
    "'str' object has no attribute 'size'". (``dist.new_group``'s answer to a rank outside
    the group is left to ``accelopt.ddp.comm_hook``, which names that case.)"""
    if process_group is None or process_group is dist.GroupMember.NON_GROUP_MEMBER \
            or isinstance(process_group, dist.ProcessGroup):
        return
    raise ConfigError(f"gradcomm.comm_hook: process_group={process_group!r} is not a process "
                      "group; pass the one DDP uses (dist.new_group(...)), or None for the "
                      "default")


def comm_hook(model: nn.Module, *, optimizer: str = "sgd", momentum: float = 0.0,
              process_group: Any = None, bucket_mb: float = 25.0, timeout_s: float = 300.0,
              **options: Any) -> tuple[Any, Callable[..., Any]]:
    """``(state, hook)`` for ``ddp.register_comm_hook(state, hook)``: gradcomm's codec on
    every gradient bucket of your own DDP job.

    ``options`` are gradcomm's settings (``dtype="fp16"|"bf16"``, ``sparsify="topk"|
    "threshold"``, ``density``, ``threshold``, ``error_feedback``, ``momentum_correction``,
    ``factor_masking``, ``topk_scope``, ``check_finite``, ``overlap``; see
    :class:`~accelopt_plugins.gradcomm.config.GradcommConfig`), checked as on the command
    line. ``optimizer``/``momentum`` describe your optimizer: DGC's momentum correction
    (top-k or threshold with error feedback under SGD with momentum) needs them, and your
    SGD must be built with that same ``momentum``: the decoder hands it
    ``S_t - m*S_{t-1}``, so torch's momentum buffer equals the sent velocity sum ``S_t``
    (with ``momentum=0`` the step would apply that difference: no momentum at all).
    ``process_group``, ``bucket_mb`` and ``timeout_s`` (how long a rank waits for the
    others, seconds) are ``accelopt.ddp.comm_hook``'s and go to it unchanged (see there for
    what is not checked about ``process_group``). ``state.report()`` gives gradcomm's
    summary row (bytes sent, ratio)."""
    from accelopt_plugins.gradcomm import PLUGIN
    from accelopt_plugins.gradcomm.plugin import GradcommPlugin

    from accelopt.ddp import bucket_size, timeout_seconds
    from accelopt.ddp import comm_hook as accelopt_comm_hook

    known = {f.name for f in dataclasses.fields(GradcommConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"gradcomm.comm_hook: unknown option(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    _refuse_non_bool(options)
    # typed as on the command line ("1e-3" a float, "no" false), one line naming the key
    config = plugin_config(PLUGIN, OmegaConf.create({"plugins": {PLUGIN.name: options}}))
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"gradcomm.comm_hook: optimizer must be one of {', '.join(OPTIMIZERS)} "
                          f"(your optimizer's kind, lower case), got {optimizer!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
            or not 0 <= momentum < 1:
        raise ConfigError(f"gradcomm.comm_hook: momentum must be a number in [0, 1) (your "
                          f"SGD's momentum), got {momentum!r}")
    validate(config)
    _refuse_non_group(process_group)
    momentum_factor(config, optimizer, momentum)  # refuse what cannot apply, in one line
    bucket_size(bucket_mb)  # before the ranks compare it: nan != nan reads as a mismatch
    timeout_seconds(timeout_s)
    if dist.is_initialized():  # (without a group, accelopt's comm_hook says so below)
        _same_on_every_rank({**dataclasses.asdict(config), "optimizer": optimizer,
                             "momentum": float(momentum), "bucket_mb": bucket_mb},
                            process_group)
    plugin = GradcommPlugin(config)
    job = JobInfo(job_id="ddp", name="ddp", model=type(model).__name__, kind="train",
                  arrival_s=0.0, iterations=0, batch_size=0, optimizer=optimizer,
                  momentum=float(momentum))
    spec = dataclasses.replace(PLUGIN, factory=lambda _c: plugin)
    return accelopt_comm_hook(model, [(spec, plugin)], process_group=process_group,
                              bucket_mb=bucket_mb, timeout_s=timeout_s, job=job)
