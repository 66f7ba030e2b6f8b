"""Configuration of the tictac plugin (``plugins.tictac.<key>=...``)."""

from __future__ import annotations

from dataclasses import dataclass

HEURISTICS = ("tac", "tic", "random", "reverse", "named", "off")


@dataclass
class TictacConfig:
    """Keys users set as ``plugins.tictac.<key>=value``.

    ``heuristic`` chooses the order (tac, tic, random, reverse, named, or off = transport
    default); ``force`` enforces even when the simulator predicts no gain (self-limiting off).
    """

    heuristic: str = "tac"
    seed: int = 0
    force: bool = False
    oracle_runs: int = 5
    bandwidth_bytes_per_s: float = 0.0  # 0 = use the transport's measured bandwidth
    cache: bool = True
    min_gain_fraction: float = 0.0  # extra margin over the measured overhead
