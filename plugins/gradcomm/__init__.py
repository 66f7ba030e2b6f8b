"""gradcomm: gradient communication tricks for all-reduce data parallelism.

fp16/bf16 compression of gradient buckets, threshold / top-k sparsification with error
feedback (nothing that is not sent is lost: it is added to the next iteration's gradient)
and, under SGD with momentum, DGC's momentum correction and factor masking,
bucket fusion (the core's ``cluster.bucket_mb``) and overlap of per-bucket communication
with backward (on by default; ``overlap=false`` holds every bucket until backward ends).
Everything goes through the send/recv hook point (``accelopt_transfer_encode/decode``).

In your own DDP script, :func:`comm_hook` gives the same codecs as a DDP communication hook:
``ddp.register_comm_hook(*comm_hook(model, dtype="fp16"))``.
"""

from __future__ import annotations

from accelopt_plugins.gradcomm.config import GradcommConfig

from accelopt import PluginSpec


def comm_hook(model, **kwargs):  # type: ignore[no-untyped-def]
    """gradcomm's codec as a DDP communication hook: see :func:`.ddp.comm_hook` (imported
    on use, so discovering the plugin does not import torch.distributed)."""
    from accelopt_plugins.gradcomm.ddp import comm_hook as build

    return build(model, **kwargs)


def _factory(config: GradcommConfig) -> object:
    from accelopt_plugins.gradcomm.plugin import GradcommPlugin

    return GradcommPlugin(config)


PLUGIN = PluginSpec(
    name="gradcomm",
    factory=_factory,
    config=GradcommConfig,
    description="fp16/bf16 gradients, top-k/threshold sparsification with error feedback and "
    "DGC momentum correction, fusion and overlap for all-reduce.",
    scope="job",
)
