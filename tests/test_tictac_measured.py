"""What a run measured, read from its timeline for the cross-iteration simulator
(plugins/tictac/measured.py): exact figures from a timeline built by hand, and the
timelines it cannot calibrate from refused in one line."""

from __future__ import annotations

import pytest
from accelopt_plugins.tictac.measured import Measured, measure

from accelopt.records import Span

pytestmark = pytest.mark.timeout(30)

RATE = 100.0
"""Bytes per second of the link in these timelines."""


def default_run(iterations: int = 5, early: bool = False, job: str = "00-a") -> list[Span]:
    """Two workers, two 100-byte tensors, the default order: each iteration a worker
    computes forward 1 s (in two spans) and backward 2 s; the gradients' phase ends at
    ``t + 3``; the server turns around in 0.5 s and posts the four parameters (2 tensors x 2
    workers) at once; on the link each takes 1 s of bytes plus 0.25 s, one after another."""
    spans: list[Span] = []
    t = 0.0
    for i in range(iterations):
        for rank in (1, 2):
            worker = f"rank {rank} (worker)"
            args = {"rank": rank, "iteration": i, "job": job}
            spans += [Span("forward", "compute", t, t + 0.4, "compute", args, worker),
                      Span("forward", "compute", t + 0.4, t + 1.0, "compute", args, worker),
                      Span("backward", "compute", t + 1.0, t + 3.0, "compute", args, worker)]
            spans.append(Span("w", f"link {rank}->0", t + 2.0, t + 3.0, "comm",
                              {"iteration": i, "kind": "grad", "bytes": 100, "job": job},
                              "rank 0 (server)"))
        posted = t + 3.0 + 0.5 - (4.0 if early else 0.0)
        for k in range(4 if i + 1 < iterations else 0):
            spans.append(Span("w", f"link 0->{1 + k % 2}", posted, posted + 1.25 * (k + 1),
                              "comm", {"iteration": i + 1, "kind": "param", "bytes": 100,
                                       "job": job},
                              f"rank {1 + k % 2} (worker)"))
        t = posted + 5.0
    return spans


def test_a_default_runs_facts_are_read_exactly():
    got = measure(default_run(), RATE, warmup=2)
    assert isinstance(got, Measured)
    assert got.forward_s == pytest.approx(1.0)  # the two forward spans summed
    assert got.backward_s == pytest.approx(2.0)
    assert got.message_s == pytest.approx(0.25)  # (5 s - 4 x 1 s of bytes) / 4 transfers
    assert got.server_s == pytest.approx(0.5)
    assert got.iterations == 2  # iterations 2 and 3 have their next parameters' phase


def test_the_warm_up_is_left_out():
    """Half the iterations are a slow warm-up: counted, they would move the median."""
    slow = [Span(s.name, s.track, s.start_s, s.end_s + (10.0 if s.name == "backward" else 0),
                 s.category, s.args, s.process) if s.args.get("iteration", 0) < 3 else s
            for s in default_run(iterations=6)]
    got = measure(slow, RATE, warmup=3)
    assert isinstance(got, Measured) and got.backward_s == pytest.approx(2.0)


def test_the_warm_up_counts_from_a_resumed_runs_first_iteration():
    """A run resumed at iteration 50 has its own slow warm-up there; counted from 0 it was
    read as steady."""
    slow = [Span(s.name, s.track, s.start_s, s.end_s + (10.0 if s.name == "backward" else 0),
                 s.category, {**s.args, "iteration": s.args["iteration"] + 50}, s.process)
            if s.args.get("iteration", 0) < 3 else
            Span(s.name, s.track, s.start_s, s.end_s, s.category,
                 {**s.args, "iteration": s.args["iteration"] + 50}, s.process)
            for s in default_run(iterations=6)]
    got = measure(slow, RATE, warmup=3)
    assert isinstance(got, Measured) and got.backward_s == pytest.approx(2.0)


def test_one_job_is_read_from_a_timeline_of_several():
    """A multi-job run's trace names compute spans "<job> forward"; another job, slower in
    every phase, must not move the figures."""
    other = [Span(f"b {s.name}" if s.track == "compute" else s.name, s.track, s.start_s,
                  s.start_s + 3 * (s.end_s - s.start_s), s.category, s.args, s.process)
             for s in default_run(job="01-b")]
    mine = [Span(f"a {s.name}" if s.track == "compute" else s.name, s.track, s.start_s,
                 s.end_s, s.category, s.args, s.process) for s in default_run()]
    got = measure(mine + other, RATE, warmup=2, job="00-a")
    assert isinstance(got, Measured)
    assert (got.forward_s, got.backward_s, got.message_s, got.server_s) == pytest.approx(
        (1.0, 2.0, 0.25, 0.5))
    assert "2 jobs (00-a, 01-b); name one" in measure(mine + other, RATE)
    assert "no job 'c'" in measure(mine, RATE, job="c")


@pytest.mark.parametrize(("spans", "rate", "problem"), [
    (default_run(), 0.0, "rate must be positive"),
    ([s for s in default_run() if s.track != "compute"], RATE, "no worker forward/backward"),
    (default_run(iterations=4), RATE, "1 steady iterations"),
    (default_run(early=True), RATE, "early update"),
])
def test_timelines_it_cannot_calibrate_from_say_why(spans, rate, problem):
    got = measure(spans, rate, warmup=2)
    assert isinstance(got, str) and problem in got
