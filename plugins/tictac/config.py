"""Configuration of the tictac plugin (``plugins.tictac.<key>=...``)."""

from __future__ import annotations

from dataclasses import dataclass, field

HEURISTIC_CHOICES = ("tac", "tic", "priority", "random", "reverse", "named", "off")
ORDERED_BY = {"priority": "tac"}
"""The per-iteration order a heuristic ranks its tensors by (priority: TAC's, the order
the next forward needs them)."""
EXECUTIONS = ("eager", "dataflow")


@dataclass
class TictacConfig:
    """Keys users set as ``plugins.tictac.<key>=value``.

    ``heuristic``: tac, tic, priority (cross-iteration priority scheduling: servers update
    each tensor as its gradients arrive and send it for the next iteration at once,
    workers push gradients by the next forward's need, both through a credit window of
    ``credit_bytes``), random (a fresh seeded order every iteration, TensorFlow's
    behaviour), reverse, named (``named_parameters()`` order) or off (the transport's own
    order). ``execution``: the worker's compute model the orders are computed for (eager =
    PyTorch program order; dataflow = TensorFlow's any-ready-op). ``force``: enforce TIC/TAC
    even when the simulator predicts less gain than the plugin's own overhead.
    ``bandwidth_bytes_per_s`` (0 = the shaped network's rate, then the transport's measured
    rate) and ``message_s`` (per-transfer cost; -1 = fit it from the transport) feed the
    time oracle. ``order_file``: a saved priority list to use (checked against the model).
    """

    heuristic: str = "tac"
    execution: str = "eager"
    seed: int = 0
    force: bool = False
    oracle_runs: int = 5
    bandwidth_bytes_per_s: float = 0.0
    message_s: float = -1.0
    replan_iteration: int = 2
    """Warm-up iterations, counted from the first iteration the run executes (past 0 where
    it was resumed): the link is measured in them, then planned again with it, and tuning
    starts."""
    order_file: str = ""
    credit_bytes: int = 0
    """priority: bytes in flight per link before the next transfer by priority starts (0:
    start each transfer as soon as it is posted; -1: measure ``tune_credits`` and the
    default order in turn after the warm-up and keep the fastest)."""
    tune_credits: list[int] = field(default_factory=lambda: [0, 65536])
    partition_bytes: int = 0
    """priority: the largest chunk a payload goes as, so a large low-priority tensor on the
    link is preempted between chunks by a higher-priority one (0: whole tensors; -1: measure
    ``tune_partitions``, each with every window)."""
    tune_partitions: list[int] = field(default_factory=lambda: [0, 262144])
    pace: float = 0.0
    """priority, with a window: pace each link at this fraction of its share of the shaped
    rate (the shaped rate over the transfers that share the bottleneck: the workers on the
    server's link, twice that on one bus), so what the window holds back waits in the
    priority queue rather than in the kernel's (0: credit returns when sends complete)."""
    tune_block: int = 2
    """Iterations per candidate in a tuning round, at least 2 (the first of a block is not
    timed)."""
    tune_rounds: int = 2
