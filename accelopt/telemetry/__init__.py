"""Background telemetry (GPU via NVML, or this process's CPU/RSS without one)."""

from __future__ import annotations

from accelopt.telemetry.sampler import TelemetrySampler

__all__ = ["TelemetrySampler"]
