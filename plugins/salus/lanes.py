"""The SALUS lane manager: admission of jobs into memory lanes, as the authors designed it.

A device of capacity C is shared by *lanes*. Lane L is a memory budget (``size``) that holds
its jobs' persistent bytes plus room for ONE iteration's ephemeral bytes (iterations inside a
lane run one at a time, so the lane needs the maximum, not the sum, of its jobs' ephemeral
bytes). The safety condition, checked after every change (``check()``):

* per lane: sum(P_j in L) + max(E_j in L) <= size(L)
* over the device: sum of all P + sum over lanes of max E <= sum of lane sizes <= C

Admission (SALUS's code): a job asks for ``need = headroom * (persistent_headroom * P + E)``.
1. If ``need`` bytes are free and fewer than ``max_lanes`` lanes exist, open a new lane
   (preferred: more lanes = more concurrency).
2. Else join an existing lane: lanes that can take the job without growing, the one with
   the fewest jobs first (the lanes run concurrently, so a job behind a shorter queue starts
   sooner: joining the tightest lane alone put every job of an 8-run sweep behind one lane
   while the other emptied), then best fit (increasing free memory); then lanes that can
   grow into free device memory, again the fewest jobs first, then least growth.
3. Else defer; the caller rescans every pending job (in arrival order) whenever memory frees,
   so a later small job may pass an earlier big one.
A job with ``need > C`` can never fit and is rejected with the amount it is over.

Lanes are budgets over one pool of memory (the CUDA caching allocator, or on a CPU plain
accounting), so "re-layout" is a resize: whenever a lane's ephemeral memory is empty (an
iteration boundary: ``idle``) it is shrunk to exactly what its jobs need, returning the slack
to the free pool; a lane is removed when its last job leaves. Growing is always safe (no
running iteration loses room); shrinking only happens at a boundary.

This module is pure Python (no torch), so the property tests can drive it thousands of times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from accelopt.units import format_bytes, how_to_fit


@dataclass
class LaneJob:
    """One admitted job's accounted memory (already inflated by the headroom factors)."""

    job_id: str
    persistent: int
    ephemeral: int


@dataclass
class Lane:
    """A memory budget in which iterations run one at a time."""

    lane_id: str
    size: int
    jobs: dict[str, LaneJob] = field(default_factory=dict)
    in_flight: str | None = None
    """The job whose iteration currently holds the lane's ephemeral memory (second guard)."""

    @property
    def persistent(self) -> int:
        return sum(j.persistent for j in self.jobs.values())

    @property
    def max_ephemeral(self) -> int:
        return max((j.ephemeral for j in self.jobs.values()), default=0)

    @property
    def need(self) -> int:
        """What the safety condition requires of this lane's size."""
        return self.persistent + self.max_ephemeral

    @property
    def free(self) -> int:
        return self.size - self.need

    def need_with(self, job: LaneJob) -> int:
        return self.persistent + job.persistent + max(self.max_ephemeral, job.ephemeral)


@dataclass(frozen=True)
class Admission:
    """The lane manager's answer: ``lane`` set = admitted; ``reject`` set = never fits;
    neither = deferred (``reason`` says why)."""

    lane: str | None = None
    reject: str | None = None
    reason: str = ""
    opened: bool = False


class SafetyViolation(AssertionError):
    """The safety condition does not hold (a bug in the lane manager, never a user error)."""


class LaneManager:
    """Admission, release and re-layout of memory lanes over a device of ``capacity`` bytes.

    ``max_lanes`` bounds concurrency (0 = as many lanes as fit, SALUS's PACK); a policy that
    wants one preemptive single-server schedule (SRTF) uses 1.
    """

    def __init__(
        self,
        capacity: int,
        *,
        max_lanes: int = 0,
        headroom: float = 1.05,
        persistent_headroom: float = 1.1,
        capacity_setting: str = "plugins.salus.capacity; accelopt serve --capacity",
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.max_lanes = int(max_lanes)
        self.headroom = float(headroom)
        self.persistent_headroom = float(persistent_headroom)
        self.capacity_setting = capacity_setting
        """Where the capacity came from, named in a rejection's hint (the plugin knows)."""
        self.lanes: dict[str, Lane] = {}
        self.job_lane: dict[str, str] = {}
        self._next_lane = 0
        self.peak_used = 0
        self.peak_lanes = 0
        self.peak_jobs = 0
        self.lanes_opened = 0
        self.relayouts = 0

    # -- accounting ----------------------------------------------------------------------

    def accounted(self, job_id: str, persistent: int, ephemeral: int) -> LaneJob:
        """Inflate a measured profile by SALUS's headroom: ``headroom * (persistent_headroom
        * P + E)``, 1.05 * (1.1 P + E) by default."""
        p = math.ceil(self.headroom * self.persistent_headroom * max(0, persistent))
        e = math.ceil(self.headroom * max(0, ephemeral))
        return LaneJob(job_id, p, e)

    @property
    def used(self) -> int:
        """Bytes reserved by lanes (the sum of lane sizes)."""
        return sum(lane.size for lane in self.lanes.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def lane_of(self, job_id: str) -> Lane | None:
        name = self.job_lane.get(job_id)
        return None if name is None else self.lanes[name]

    # -- admission -----------------------------------------------------------------------

    def admit(self, job_id: str, persistent: int, ephemeral: int) -> Admission:
        """Place a job, or say why not (see the module docstring for the algorithm)."""
        if job_id in self.job_lane:
            return Admission(lane=self.job_lane[job_id], reason="already admitted")
        never = self.never_fits(persistent, ephemeral)
        if never is not None:
            return Admission(reject=never)
        job = self.accounted(job_id, persistent, ephemeral)
        need = job.persistent + job.ephemeral
        lane_limit_ok = self.max_lanes <= 0 or len(self.lanes) < self.max_lanes
        if lane_limit_ok and need <= self.free:
            lane = Lane(f"L{self._next_lane}", size=need)
            self._next_lane += 1
            self.lanes_opened += 1
            self.lanes[lane.lane_id] = lane
            return self._place(job, lane, opened=True)
        fits = sorted(
            (lane for lane in self.lanes.values() if lane.need_with(job) <= lane.size),
            key=lambda lane: (len(lane.jobs), lane.free, lane.lane_id),
        )
        if fits:
            return self._place(job, fits[0])
        free = self.free
        growable = sorted(
            (
                (len(lane.jobs), lane.need_with(job) - lane.size, lane.lane_id, lane)
                for lane in self.lanes.values()
                if lane.need_with(job) - lane.size <= free
            ),
            key=lambda t: (t[0], t[1], t[2]),
        )
        if growable:
            _, growth, _, lane = growable[0]
            lane.size += growth
            return self._place(job, lane)
        return Admission(
            reason=(
                f"waiting for memory: needs {format_bytes(need)}, {format_bytes(free)} free of "
                f"{format_bytes(self.capacity)} in {len(self.lanes)} lane(s)"
            )
        )

    def never_fits(self, persistent: int, ephemeral: int) -> str | None:
        """Why a job of this measured profile can never be admitted (its accounted need is
        over the capacity), or ``None``. Admission rejects with it; a service asks it when a
        job is submitted, so that a job no lane can ever hold is refused then instead of
        being taken (a number, a directory) and rejected later. It depends only on the
        profile and the fixed capacity, never on the lanes open now."""
        job = self.accounted("", persistent, ephemeral)
        need = job.persistent + job.ephemeral
        return self._too_big(need, persistent, ephemeral) if need > self.capacity else None

    def _too_big(self, need: int, persistent: int, ephemeral: int) -> str:
        """Why a job can never fit, with the headroom factors that inflated its profile."""
        return (
            f"needs {format_bytes(need)} ({self.headroom:g} x ({self.persistent_headroom:g} x "
            f"persistent {format_bytes(persistent)} + ephemeral {format_bytes(ephemeral)})) but "
            f"the capacity is {format_bytes(self.capacity)}: "
            f"{format_bytes(need - self.capacity)} too much; "
            + how_to_fit(persistent, ephemeral, f"the capacity ({self.capacity_setting})")
        )

    def fits(self, job_id: str, persistent: int, ephemeral: int) -> bool:
        """Whether ``admit`` would place the job now (without placing it)."""
        if self.never_fits(persistent, ephemeral) is not None:
            return False
        job = self.accounted(job_id, persistent, ephemeral)
        need = job.persistent + job.ephemeral
        if (self.max_lanes <= 0 or len(self.lanes) < self.max_lanes) and need <= self.free:
            return True
        return any(lane.need_with(job) - lane.size <= self.free for lane in self.lanes.values())

    def _place(self, job: LaneJob, lane: Lane, *, opened: bool = False) -> Admission:
        lane.jobs[job.job_id] = job
        self.job_lane[job.job_id] = lane.lane_id
        self._note_peaks()
        self.check()
        how = "opened" if opened else "joined"
        return Admission(lane=lane.lane_id, opened=opened, reason=f"{how} lane {lane.lane_id}")

    # -- iterations (the second guard) ---------------------------------------------------

    def reserve_iteration(self, job_id: str, ephemeral: int | None = None) -> bool:
        """Reserve the lane's ephemeral memory for one iteration of ``job_id``.

        Refused while another iteration holds the lane, or if a refined ephemeral estimate no
        longer fits the lane and the lane cannot grow into free memory.
        """
        lane = self.lane_of(job_id)
        if lane is None:
            return False
        if lane.in_flight is not None and lane.in_flight != job_id:
            return False
        if ephemeral is not None:
            job = lane.jobs[job_id]
            want = math.ceil(self.headroom * ephemeral)
            if want > job.ephemeral:
                grown = LaneJob(job_id, job.persistent, want)
                others = Lane(lane.lane_id, lane.size, {k: v for k, v in lane.jobs.items()
                                                          if k != job_id})
                growth = others.need_with(grown) - lane.size
                if growth > 0:
                    if growth > self.free:
                        return False
                    lane.size += growth
                lane.jobs[job_id] = grown
        lane.in_flight = job_id
        self._note_peaks()
        self.check()
        return True

    def end_iteration(self, job_id: str) -> None:
        """The iteration ended: the lane's ephemeral memory is empty, so re-lay it out."""
        lane = self.lane_of(job_id)
        if lane is None:
            return
        if lane.in_flight == job_id:
            lane.in_flight = None
        self._relayout(lane)

    # -- release ---------------------------------------------------------------------------

    def release(self, job_id: str) -> str | None:
        """A job left: return its memory; remove its lane if empty, else shrink the lane.

        Returns the lane id it left (``None`` if it was never admitted).
        """
        name = self.job_lane.pop(job_id, None)
        if name is None:
            return None
        lane = self.lanes[name]
        lane.jobs.pop(job_id, None)
        if lane.in_flight == job_id:
            lane.in_flight = None
        if not lane.jobs:
            del self.lanes[name]
        else:
            self._relayout(lane)
        self.check()
        return name

    def _relayout(self, lane: Lane) -> None:
        """Shrink an idle lane to exactly what its jobs need (its ephemeral memory is empty)."""
        if lane.in_flight is None and lane.size > lane.need:
            lane.size = lane.need
            self.relayouts += 1

    # -- invariants ------------------------------------------------------------------------

    def _note_peaks(self) -> None:
        self.peak_used = max(self.peak_used, self.used)
        self.peak_lanes = max(self.peak_lanes, len(self.lanes))
        self.peak_jobs = max(self.peak_jobs, len(self.job_lane))

    def check(self) -> None:
        """Raise :class:`SafetyViolation` unless the safety condition holds."""
        total_p = 0
        total_e = 0
        for lane in self.lanes.values():
            if lane.need > lane.size:
                raise SafetyViolation(
                    f"lane {lane.lane_id}: persistent {lane.persistent} + max ephemeral "
                    f"{lane.max_ephemeral} > size {lane.size}"
                )
            if not lane.jobs:
                raise SafetyViolation(f"lane {lane.lane_id} is empty but still allocated")
            total_p += lane.persistent
            total_e += lane.max_ephemeral
        if total_p + total_e > self.capacity or self.used > self.capacity:
            raise SafetyViolation(
                f"device: persistent {total_p} + lane ephemeral {total_e} (lanes hold "
                f"{self.used}) > capacity {self.capacity}"
            )
        if self.max_lanes > 0 and len(self.lanes) > self.max_lanes:
            raise SafetyViolation(f"{len(self.lanes)} lanes > max_lanes {self.max_lanes}")
