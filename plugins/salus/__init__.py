"""salus: one execution service shares a device among many jobs (Yu & Chowdhury, MLSys 2020).

Memory lanes (allocation hook), iteration-granularity switching and PACK / SRTF / FAIR / FIFO
/ RR policies (iteration-boundary hook), and a long-lived service (``accelopt serve``,
``submit``, ``status``, ``cancel``). See README.md, the method card.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelopt import PluginSpec


@dataclass
class SalusConfig:
    """``accelopt run +plugins=[salus] plugins.salus.policy=srtf plugins.salus.capacity=2GiB``"""

    policy: str = "auto"
    """auto | pack | srtf | fair | fifo | rr | las | dlas | gittins, another registered name,
    or module:Class (las, dlas, gittins: Tiresias's scheduling without knowing job lengths).
    ``auto``: pack on one device (lanes run concurrently, so packing raises utilization);
    srtf in a parameter-server cluster, where every iteration uses every worker and server so
    only one job runs at a time and packing would be arrival order: there the policy that
    minimises average JCT is the useful one."""
    history: str = ""
    """A file of past jobs' lengths in iterations (integers, one per line or separated by
    spaces or commas; ``#`` starts a comment): the distribution ``gittins`` learns from,
    before the run's own finished jobs add to it. Empty: learned from the run alone."""
    capacity: str = ""
    """Device memory shared by the lanes, e.g. '2GiB'. Empty: run.memory_capacity (on CUDA
    the real device memory; on CPU, where lanes are accounted not enforced, the RAM)."""
    max_lanes: int = -1
    """-1: the policy's default (pack: as many as fit; the others: 1); 0: as many as fit."""
    threads: int = 0
    """CPU intra-op threads per lane; 0: auto (fixed cores // lanes when run.deterministic,
    else re-split between the active lanes at every iteration)."""
    headroom: float = 1.05
    persistent_headroom: float = 1.1
    """A job asks for headroom x (persistent_headroom x P + E), as in SALUS's code."""


def _factory(config: SalusConfig) -> object:
    from accelopt_plugins.salus.plugin import SalusPlugin

    return SalusPlugin(config)


PLUGIN = PluginSpec(
    name="salus",
    factory=_factory,
    config=SalusConfig,
    description="SALUS: memory lanes + iteration-boundary PACK/SRTF/FAIR sharing of one device",
    slots=("scheduler", "allocator"),
)
