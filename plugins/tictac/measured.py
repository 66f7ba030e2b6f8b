"""What a real parameter-server run measured, as inputs of the cross-iteration simulator
(``crossiter.py``).

The simulator's own inputs come from the oracle (each op timed alone, at its fastest) and
from the link's shaped rate. A run differs from both in ways the oracle cannot see: a
worker's backward also posts every gradient (the transport's Python runs between the
autograd kernels), so the forward/backward split moves, not only their sum; every transfer
costs the transport a fixed time on top of its bytes (posting, gloo's round trip), which a
fit of arrival gaps reads as zero on a shaped link whose burst lets small transfers through
together; and the server spends time between the last gradient's arrival and the first
parameter's departure (averaging, the optimizer, posting) that an update rate in bytes/s
leaves out. This module reads those facts from a run's timeline (the ranks' ``compute``
spans and the transfers on their ``link`` tracks), so the default run of a pair can
calibrate the simulation of both of its sides: one calibration, taken from the run without
the plugin, so the difference it predicts between the schedules is predicted, not fitted.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class SpanLike(Protocol):
    """The fields of :class:`accelopt.records.Span` read here."""

    name: str
    track: str
    process: str
    start_s: float
    end_s: float
    args: Mapping[str, Any]


@dataclass(frozen=True)
class Measured:
    """Medians over a run's steady iterations (after its warm-up)."""

    forward_s: float
    """A worker's forward compute per iteration."""
    backward_s: float
    """A worker's backward compute per iteration (the gradients' posting included)."""
    message_s: float
    """Per transfer, beyond its bytes over the link's rate: from the parameter phases (the
    server posts every parameter at once; first post to last arrival, minus the bytes' time
    on the link, over the transfers)."""
    server_s: float
    """The server's turnaround: the iteration's last gradient in to the next iteration's
    first parameter out."""
    iterations: int
    """How many steady iterations the medians are over."""


def measure(spans: Iterable[SpanLike], bytes_per_s: float, warmup: int = 2,
            job: str | None = None) -> Measured | str:
    """The facts of a default-order run (no early update: its parameters leave the server
    together, after the last gradient), or why its timeline cannot give them. ``bytes_per_s``:
    the busiest link's rate as the simulator takes it (shared: the bus; hosts: the server's
    link). ``job``: the job to read in a timeline of several (its id, as the spans' ``job``
    argument names it); a timeline of one job needs none. ``warmup``: the iterations left out,
    counted from the timeline's first (a resumed run's starts past 0)."""
    if bytes_per_s <= 0:
        return f"the link's rate must be positive, got {bytes_per_s}"
    spans = list(spans)
    jobs = sorted({str(s.args["job"]) for s in spans if "job" in s.args})
    if job is None and len(jobs) > 1:
        return f"the timeline has {len(jobs)} jobs ({', '.join(jobs)}); name one"
    if job is not None and job not in jobs:
        return f"no job {job!r} in the timeline (its jobs: {', '.join(jobs) or 'none named'})"
    if job is not None:
        spans = [s for s in spans if s.args.get("job") == job]
    first = _first_iteration(spans)
    compute: dict[tuple[str, int, str], float] = defaultdict(float)
    phases: dict[tuple[str, int], list[float]] = {}
    for s in spans:
        iteration = s.args.get("iteration")
        if not isinstance(iteration, int) or iteration < first + warmup:
            continue
        # a run's trace names a compute span "<job> forward" where several jobs share it
        step = s.name.rsplit(" ", 1)[-1]
        if s.track == "compute" and "worker" in s.process and step in ("forward", "backward"):
            compute[(s.process, iteration, step)] += s.end_s - s.start_s
        elif s.track.startswith("link") and s.args.get("kind") in ("param", "grad"):
            # per kind and iteration: first start, last end, bytes, transfers
            phase = phases.setdefault((str(s.args["kind"]), iteration),
                                      [s.start_s, s.end_s, 0.0, 0.0])
            phase[0], phase[1] = min(phase[0], s.start_s), max(phase[1], s.end_s)
            phase[2] += float(s.args.get("bytes", 0))
            phase[3] += 1
    forward = [v for (_, _, name), v in compute.items() if name == "forward"]
    backward = [v for (_, _, name), v in compute.items() if name == "backward"]
    params = {i: p for (kind, i), p in phases.items() if kind == "param"}
    grads = {i: p for (kind, i), p in phases.items() if kind == "grad"}
    turnarounds = [params[i + 1][0] - grads[i][1] for i in grads if i + 1 in params]
    if not forward or not backward:
        return "no worker forward/backward spans after the warm-up (a PS run's timeline?)"
    if len(turnarounds) < 2:
        return (f"{len(turnarounds)} steady iterations with both gradients and parameters "
                "on the links; need 2 or more")
    if statistics.median(turnarounds) < 0:
        return ("parameters leave the server before the last gradient arrives (an early "
                "update): calibrate from the run without the plugin")
    per_message = [((end - start) - nbytes / bytes_per_s) / count
                   for start, end, nbytes, count in params.values()]
    return Measured(forward_s=statistics.median(forward),
                    backward_s=statistics.median(backward),
                    message_s=max(0.0, statistics.median(per_message)),
                    server_s=statistics.median(turnarounds),
                    iterations=len(turnarounds))


def _first_iteration(spans: Iterable[SpanLike]) -> int:
    """The first iteration the timeline's run executed (past 0 where it was resumed from a
    checkpoint): the warm-up counts from it, as the run's own warm-up does."""
    return min((s.args["iteration"] for s in spans if isinstance(s.args.get("iteration"), int)),
               default=0)
