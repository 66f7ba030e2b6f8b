"""Property tests of the SALUS lane manager and the FAIR policy (pure Python, no torch).

The driver below mirrors the core executor's admission semantics: a job arrives and is
offered to the lane manager; if deferred it waits in a pending queue that is rescanned in
arrival order after every release. Each property is checked against an independent
re-computation from the lanes' contents, not against the manager's own helpers.
"""

from __future__ import annotations

import math

import pytest
from accelopt_plugins.salus.lanes import LaneManager
from accelopt_plugins.salus.policies import Fair
from hypothesis import given, settings
from hypothesis import strategies as st

from accelopt import JobInfo, JobProfile, JobState

pytestmark = pytest.mark.timeout(120)

sizes = st.integers(min_value=0, max_value=400)
job_mix = st.lists(st.tuples(sizes, sizes), min_size=1, max_size=12)
events = st.lists(
    st.tuples(st.sampled_from(["arrive", "finish", "iter_start", "iter_end"]),
              st.integers(0, 50)),
    max_size=40,
)


def independent_fits(m: LaneManager, p: int, e: int) -> bool:
    """Could this job be placed now? Recomputed from the lanes, not from m.fits()."""
    pa = math.ceil(m.headroom * m.persistent_headroom * p)
    ea = math.ceil(m.headroom * e)
    need = pa + ea
    if need > m.capacity:
        return False
    used = sum(lane.size for lane in m.lanes.values())
    free = m.capacity - used
    if (m.max_lanes <= 0 or len(m.lanes) < m.max_lanes) and need <= free:
        return True
    for lane in m.lanes.values():
        ps = sum(j.persistent for j in lane.jobs.values())
        es = max((j.ephemeral for j in lane.jobs.values()), default=0)
        if ps + pa + max(es, ea) - lane.size <= free:
            return True
    return False


def independent_safety(m: LaneManager) -> None:
    total = 0
    for lane in m.lanes.values():
        ps = sum(j.persistent for j in lane.jobs.values())
        es = max(j.ephemeral for j in lane.jobs.values())
        assert ps + es <= lane.size, f"lane {lane.lane_id} over its size"
        total += lane.size
    all_p = sum(j.persistent for lane in m.lanes.values() for j in lane.jobs.values())
    lane_e = sum(max(j.ephemeral for j in lane.jobs.values()) for lane in m.lanes.values())
    assert all_p + lane_e <= total <= m.capacity
    if m.max_lanes > 0:
        assert len(m.lanes) <= m.max_lanes
    assert set(m.job_lane) == {j for lane in m.lanes.values() for j in lane.jobs}


class Driver:
    """The executor's admission loop around a LaneManager."""

    def __init__(self, m: LaneManager, jobs: list[tuple[int, int]]) -> None:
        self.m = m
        self.jobs = jobs
        self.pending: list[int] = []
        self.admitted: list[int] = []
        self.ever_admitted: set[int] = set()
        self.rejected: set[int] = set()
        self.next_arrival = 0

    def offer(self, i: int) -> bool:
        p, e = self.jobs[i]
        answer = self.m.admit(f"j{i}", p, e)
        if answer.reject is not None:
            assert "too much" in answer.reject
            self.rejected.add(i)
            return True
        if answer.lane is not None:
            self.admitted.append(i)
            self.ever_admitted.add(i)
            return True
        return False

    def rescan(self) -> None:
        for i in list(self.pending):
            if self.offer(i):
                self.pending.remove(i)
        # "admitted as soon as it fits": nothing still pending fits now.
        for i in self.pending:
            p, e = self.jobs[i]
            assert not independent_fits(self.m, p, e), f"job {i} fits but is still pending"

    def arrive(self) -> None:
        i = self.next_arrival
        self.next_arrival += 1
        p, e = self.jobs[i]
        need = math.ceil(self.m.headroom * self.m.persistent_headroom * p) + math.ceil(
            self.m.headroom * e)
        if not self.offer(i):
            self.pending.append(i)
        if need > self.m.capacity:
            assert i in self.rejected, "a job larger than the device must be rejected at once"
        self.rescan()

    def finish(self, k: int) -> None:
        i = self.admitted.pop(k % len(self.admitted))
        self.m.release(f"j{i}")
        self.rescan()


@settings(max_examples=1000, deadline=None)
@given(
    capacity=st.integers(min_value=50, max_value=1500),
    max_lanes=st.integers(min_value=0, max_value=4),
    headroom=st.sampled_from([(1.0, 1.0), (1.05, 1.1)]),
    jobs=job_mix,
    script=events,
)
def test_lane_manager_safety_liveness_and_promptness(capacity, max_lanes, headroom, jobs, script):
    m = LaneManager(capacity, max_lanes=max_lanes, headroom=headroom[0],
                    persistent_headroom=headroom[1])
    d = Driver(m, jobs)
    in_flight: set[int] = set()
    for kind, k in script:
        if kind == "arrive" and d.next_arrival < len(jobs):
            d.arrive()
        elif kind == "finish" and d.admitted:
            i = d.admitted[k % len(d.admitted)]
            in_flight.discard(i)
            d.finish(k)
        elif kind == "iter_start" and d.admitted:
            i = d.admitted[k % len(d.admitted)]
            lane = m.lane_of(f"j{i}")
            busy = lane.in_flight is not None and lane.in_flight != f"j{i}"
            granted = m.reserve_iteration(f"j{i}")
            assert granted == (not busy), "one iteration at a time per lane, and only that"
            if granted:
                in_flight.add(i)
        elif kind == "iter_end" and in_flight:
            i = sorted(in_flight)[k % len(in_flight)]
            in_flight.discard(i)
            m.end_iteration(f"j{i}")
        independent_safety(m)
    # Drain: everything left arrives, then jobs finish one by one; every admissible job
    # must get admitted at some point (no job waits forever).
    while d.next_arrival < len(jobs):
        d.arrive()
        independent_safety(m)
    steps = 0
    while d.admitted:
        d.finish(0)
        independent_safety(m)
        steps += 1
        assert steps <= len(jobs)
    assert not d.pending, f"jobs {d.pending} never admitted"
    assert not m.lanes, "empty lanes must be removed"
    for i, (p, e) in enumerate(jobs):
        need = math.ceil(m.headroom * m.persistent_headroom * p) + math.ceil(m.headroom * e)
        assert (i in d.ever_admitted) == (need <= capacity)
        assert (i in d.rejected) == (need > capacity)


def _state(job_id: str, arrival: float, service: float, done: int) -> JobState:
    profile = JobProfile(1, 2, 1, 0.01, "cpu", "test")
    info = JobInfo(job_id, job_id, "mlp", "train", arrival, 10**9, 1, profile)
    return JobState(info, "L0", done, service, None, 0.0)


@settings(max_examples=300, deadline=None)
@given(
    times=st.lists(st.integers(1, 5), min_size=2, max_size=6),
    arrivals=st.lists(st.integers(0, 30), min_size=6, max_size=6),
)
def test_fair_never_starves(times, arrivals):
    """FAIR (least service first) in one lane: after the last arrival, a waiting job runs
    within (K-1) * (b/a + 1) + 1 boundaries, where a..b bounds iteration times."""
    fair = Fair()
    k = len(times)
    arrive = {f"j{i}": arrivals[i] for i in range(k)}
    service = dict.fromkeys(arrive, 0.0)
    done = dict.fromkeys(arrive, 0)
    last_run = {}
    a, b = min(times), max(times)
    bound = (k - 1) * (b // a + 1) + 1
    latest = max(arrivals[:k])
    settle = latest + k * (latest * b // a + b + 1)  # a latecomer catches up first
    for step in range(settle + 10 * bound):
        ready = [_state(j, arrive[j], service[j], done[j]) for j in arrive if arrive[j] <= step]
        if not ready:
            continue
        chosen = fair.select("L0", ready, float(step))
        assert service[chosen] == min(service[s.job.job_id] for s in ready)
        service[chosen] += times[int(chosen[1:])]
        done[chosen] += 1
        last_run[chosen] = step
        if step > settle:
            for j in arrive:
                assert step - last_run.get(j, -10**9) <= bound, f"{j} starves"
    assert all(done[j] > 0 for j in arrive)


def test_jobs_spread_over_the_lanes_instead_of_queueing_behind_one():
    """Two lanes allowed, eight equal jobs arriving at once: four per lane (joining the
    tightest lane alone queued seven behind one lane while the other emptied); the spread
    holds whether a lane has room for another job or must grow for it."""
    from accelopt_plugins.salus.lanes import LaneManager

    for capacity in (10_000, 1_000_000):  # lanes grow for each job / plenty of room
        m = LaneManager(capacity, max_lanes=2)
        lanes = [m.admit(f"j{i}", 100, 50).lane for i in range(8)]
        assert None not in lanes
        assert sorted(lanes.count(lane) for lane in set(lanes)) == [4, 4], lanes


def test_rejection_states_the_configured_headroom_and_the_capacity_setting():
    """The formula in the rejection uses the headroom factors that produced the number (2 x
    (1.1 x P + E) is not "1.05 x ..."), and the hint names the setting that gave the
    capacity."""
    m = LaneManager(1000, headroom=2.0, persistent_headroom=1.5,
                    capacity_setting="run.memory_capacity")
    reject = m.admit("j", 300, 200).reject
    assert reject is not None and "\n" not in reject
    assert "needs 1.3 KiB (2 x (1.5 x persistent 300 B + ephemeral 200 B))" in reject
    assert reject.endswith("raise the capacity (run.memory_capacity)")
    default = LaneManager(100).admit("j", 300, 200).reject
    assert default is not None and "(1.05 x (1.1 x persistent" in default
