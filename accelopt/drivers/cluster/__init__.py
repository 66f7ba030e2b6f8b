"""Distributed runtime: parameter-server and all-reduce data parallelism on
torch.distributed, with every transfer going through the send/recv hook point.

The single-process runner calls :func:`run_cluster` when ``cluster.mode != none``; see
``docs/distributed.md``.
"""

from __future__ import annotations

from accelopt.drivers.cluster.faults import RankFailed
from accelopt.drivers.cluster.launch import run_cluster, under_torchrun
from accelopt.drivers.cluster.netns import ShapingError
from accelopt.drivers.cluster.outcome import ClusterOutcome
from accelopt.drivers.cluster.settings import ClusterSettings, settings_from
from accelopt.drivers.cluster.transport import CommunicationError, TransferOrderError

__all__ = [
    "ClusterOutcome",
    "ClusterSettings",
    "CommunicationError",
    "RankFailed",
    "ShapingError",
    "TransferOrderError",
    "run_cluster",
    "settings_from",
    "under_torchrun",
]
