"""Scheduling policies, decided at every iteration boundary of a lane, and their registry.

A policy answers one question: of the admitted, unfinished jobs of this lane, whose
iteration runs next? Jobs that are not chosen are preempted simply by not running their next
iteration; their state stays resident (SALUS's cheap switch). ``max_lanes`` is how many
lanes the policy wants the lane manager to open (0 = as many as fit).

Mapping of SALUS's policies onto lanes (one device):

* ``pack``: as many lanes as fit run concurrently; inside a lane, arrival order.
* ``fifo``: one lane; earliest arrival runs to completion (the executor's default order).
* ``srtf``: one lane, so it is a real preemptive single-server schedule; smallest remaining
  time (refined iteration time x remaining iterations) first.
* ``fair``: one lane; least service time first (equal progress).
* ``rr``: one lane; the job that ran least recently goes next (one iteration each, in turn).
* ``las``: one lane; least attained service first (Tiresias, NSDI'19): the same ranking as
  ``fair``, named for what it is when used as a *knowledge-free* stand-in for SRTF: it needs
  no job length, and short jobs finish early because every job starts at zero service.
* ``dlas``: one lane; Tiresias's discretised LAS: priority queues by attained service
  (thresholds ``Dlas.thresholds_s``), FIFO inside a queue, so jobs of one queue run to the
  next threshold instead of time-sharing each iteration (far fewer switches than ``las``).
  On one device the second dimension (GPUs per job) is 1 for every job.
* ``gittins``: one lane; Tiresias's Gittins index: knows the *distribution* of job lengths
  (from past jobs' iteration counts, ``plugins.salus.history``, and every job that finishes
  in the run), never a job's own; runs the job most likely to finish soon per second of
  device time, given the iterations it has already run. Without a history it is ``las``.

What each policy knows, and when: ``fifo``/``pack`` the arrival order; ``fair``/``las``/
``dlas`` the service each job has received so far (measured, nothing about its future);
``gittins`` the iterations each job has run and the lengths of jobs that finished before;
``srtf`` the job's remaining iterations (from its config: ``iterations`` minus those run)
times its iteration time: the profiled iteration (measured offline, before the clock) until
the job has run two iterations, then an exponential moving average of its measured
iterations (the first one, which pays the job's warm-up, is left out).

``plugins.salus.max_lanes=N`` overrides the lane count of any policy; each lane then applies
the policy to its own jobs.

Adding a policy, three ways, none of which needs salus to import your code:

* a package of your own declares an entry point in the group ``accelopt_salus.policies``
  (``lifo = "my_package:Lifo"``) and installs itself: ``plugins.salus.policy=lifo`` finds it
  in every process of a run (ranks, ``run.compare`` reference runs, ``accelopt bench`` sets);
* ``@register_policy("name")`` on a class in code that runs before the run (a notebook, a
  test); it is sent to a cluster's ranks with the run;
* an import path, ``plugins.salus.policy=my_module:MyPolicy`` (imported for you).

The names above are salus's own: a package or module that registers one of them too, before
or after salus, is refused in one line naming both where that name is selected, telling it
to rename; every other policy keeps working.

A policy is any class with ``select(lane, ready, now_s) -> job_id``; optionally
``observe(job_id, seconds)``, a ``max_lanes`` class attribute (default 1) and an
``iteration_time`` attribute, which salus sets to its refined estimate of a job's iteration
(``JobState -> seconds``). Subclassing :class:`Policy` gives all of these, but an installed
package need not import salus to be one.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from importlib import import_module
from pathlib import Path
from typing import ClassVar

from accelopt import ConfigError, JobState, UserError, extension_point
from accelopt.drivers.scheduling import arrival_order

IterationTime = Callable[[JobState], float]


def _profile_seconds(state: JobState) -> float:
    if state.last_iteration_seconds is not None:
        return state.last_iteration_seconds
    profile = state.job.profile
    return profile.iteration_seconds if profile is not None else 0.0


arrival_key = arrival_order
"""Earliest arrival first; ties by submission order (the core's FIFO key, shared)."""


class Policy:
    """Base class: override :meth:`select`; optionally :meth:`observe`."""

    name: ClassVar[str] = ""
    max_lanes: ClassVar[int] = 1
    """Lanes this policy wants by default (0 = as many as fit)."""

    def __init__(self) -> None:
        self.iteration_time: IterationTime = _profile_seconds
        """Seconds one iteration of a job takes: the plugin installs its refined estimate."""

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        """Return the ``job_id`` of one of ``ready`` (never empty)."""
        raise NotImplementedError

    def observe(self, job_id: str, seconds: float) -> None:
        """An iteration of ``job_id`` just took ``seconds`` (default: ignore)."""

    def remaining_seconds(self, state: JobState) -> float:
        return self.iteration_time(state) * state.remaining_iterations

    def note(self) -> str | None:
        """What the report row should say about how this policy decided, where that is not
        what its name promises (a fallback it took); default: nothing."""
        return None


GROUP = "accelopt_salus.policies"
POLICIES = extension_point(GROUP)
"""Every policy by name: salus's own, packages' entry points, and those registered in code."""


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy selectable as ``plugins.salus.policy=<name>``. A name is
    taken once: another class registered under the same name is refused (``UserError``); a
    name salus's own policies use, or an installed package declares too, is refused where it
    is selected, so a module or package that takes a built-in name disables that policy
    alone, not salus."""
    return _registrar(name, builtin=False)


def _builtin_policy(name: str) -> Callable[[type], type]:
    """:func:`register_policy` for salus's own policies: their names are never the ones to
    rename, whichever module registered a clashing class first (see ``ExtensionPoint``)."""
    return _registrar(name, builtin=True)


def _registrar(name: str, builtin: bool) -> Callable[[type], type]:
    """The decorator both registrations share: register, then name the class after it."""

    def add(cls: type) -> type:
        POLICIES.register(name, cls, builtin=builtin)
        if "name" not in vars(cls) or not vars(cls)["name"]:
            cls.name = name  # type: ignore[attr-defined]
        return cls

    return add


class _Adapted(Policy):
    """A policy class that does not subclass :class:`Policy`, with the defaults filled in."""

    def __init__(self, inner: object, name: str) -> None:
        super().__init__()
        self.inner = inner
        self.name = getattr(inner, "name", "") or name  # type: ignore[misc]
        self.max_lanes = int(getattr(inner, "max_lanes", 1))  # type: ignore[misc]

    def __setattr__(self, key: str, value: object) -> None:
        object.__setattr__(self, key, value)
        if key == "iteration_time" and hasattr(self, "inner") and hasattr(self.inner, key):
            setattr(self.inner, key, value)

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return self.inner.select(lane, ready, now_s)  # type: ignore[attr-defined]

    def observe(self, job_id: str, seconds: float) -> None:
        observe = getattr(self.inner, "observe", None)
        if callable(observe):
            observe(job_id, seconds)


def as_policy(cls: object, ref: str) -> Policy:
    """An instance of the policy class ``cls`` (named ``ref`` in errors)."""
    if not isinstance(cls, type) or not callable(getattr(cls, "select", None)):
        raise ConfigError(f"plugins.salus.policy: {ref!r} is not a policy class (it needs a "
                          "select(lane, ready, now_s) method)")
    try:
        instance = cls()
    except Exception as exc:
        raise ConfigError(f"plugins.salus.policy: {ref!r}() failed: {type(exc).__name__}: "
                          f"{exc}") from None
    _check_max_lanes(cls, instance)
    return instance if isinstance(instance, Policy) else _Adapted(instance, ref)


def _check_max_lanes(cls: type, instance: object) -> None:
    """Refuse, in one line naming the attribute, a policy whose ``max_lanes`` is no lane
    count: ``max_lanes = "two"`` reached ``int()`` and stopped the plugin's creation with a
    bare ``ValueError`` that named neither the policy nor the values it may take."""
    value = getattr(instance, "max_lanes", 1)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return
    where = f"{cls.__module__}:{cls.__qualname__}.max_lanes"
    raise ConfigError(f"plugins.salus.policy: {where} is {value!r}; it must be a whole number "
                      ">= 0 (1: one job's iteration at a time, N: up to N lanes, 0: as many "
                      "lanes as fit)")


AUTO = "auto"


def resolve_auto(ref: str, cluster_mode: str) -> str:
    """``auto`` -> ``srtf`` in a parameter-server cluster (one job's iteration at a time: a
    single lane, where PACK degenerates to arrival order), ``pack`` otherwise."""
    if ref != AUTO:
        return ref
    return "srtf" if cluster_mode not in ("", "none") else "pack"


def make_policy(ref: str) -> Policy:
    """A registered or installed name, or ``module:Class`` to import; one-line ConfigError
    otherwise."""
    if ":" in ref:
        module, _, attr = ref.partition(":")
        try:
            cls = getattr(import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"plugins.salus.policy: cannot import {ref!r} ({type(exc).__name__}: {exc}); "
                "use module:Class of a policy class"
            ) from None
        return as_policy(cls, ref)
    try:
        cls = POLICIES.get(ref)
    except UserError as exc:
        raise ConfigError(f"plugins.salus.policy: {exc}") from None
    if cls is None:
        raise ConfigError(f"plugins.salus.policy: unknown policy {ref!r}; {_choices()}")
    return as_policy(cls, ref)


def _choices() -> str:
    """The names a run may select, for an unknown one's error; a name two objects claim is
    no choice until one is renamed, so it is listed apart, as clashing."""
    clashing = POLICIES.clashing()
    usable = sorted({AUTO, *POLICIES.names()} - set(clashing))
    line = f"choose one of {', '.join(usable)} or give module:Class"
    if clashing:
        line += (f" ({', '.join(clashing)}: claimed by two policies, refused until one is "
                 "renamed; select it to see which)")
    return line


@_builtin_policy("fifo")
class Fifo(Policy):
    """One job at a time, in arrival order, to completion (the baseline)."""

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return min(ready, key=arrival_key).job.job_id


@_builtin_policy("pack")
class Pack(Policy):
    """Utilization: as many lanes as fit run concurrently; arrival order inside a lane."""

    max_lanes = 0

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return min(ready, key=arrival_key).job.job_id


@_builtin_policy("srtf")
class Srtf(Policy):
    """Shortest remaining time first (preemptive at iteration boundaries). Equal estimates
    (in a cluster, jobs not measured yet all count 0 s) go to the job with the fewest
    iterations left, then by arrival."""

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return min(ready, key=lambda s: (self.remaining_seconds(s), s.remaining_iterations,
                                         *arrival_key(s))).job.job_id


@_builtin_policy("fair")
class Fair(Policy):
    """Least device time used so far first: equal progress, no starvation."""

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return min(ready, key=lambda s: (s.service_seconds, *arrival_key(s))).job.job_id


@_builtin_policy("rr")
class RoundRobin(Policy):
    """One iteration each, in turn: the job chosen least recently goes next."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = itertools.count()
        self._last: dict[str, int] = {}

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        chosen = min(ready, key=lambda s: (self._last.get(s.job.job_id, -1), *arrival_key(s)))
        self._last[chosen.job.job_id] = next(self._clock)
        return chosen.job.job_id


@_builtin_policy("las")
class Las(Fair):
    """Least attained service first (Tiresias's LAS): knows no job length, only the device
    time each job has had; a new job starts at zero and so runs before longer-served ones."""


@_builtin_policy("dlas")
class Dlas(Policy):
    """Discretised LAS (Tiresias): queue ``k`` holds the jobs whose attained service lies in
    ``[thresholds_s[k-1], thresholds_s[k])``; the lowest non-empty queue runs, FIFO inside it.
    Why discretise: plain LAS switches whenever two jobs' services cross (every iteration
    when they are equal); queues keep a job running until it crosses a threshold. Subclass
    to set other thresholds (seconds of device time, ascending)."""

    thresholds_s: ClassVar[tuple[float, ...]] = (1.0, 10.0)

    def queue(self, state: JobState) -> int:
        """The priority queue of ``state``: how many thresholds its service has passed."""
        return sum(state.service_seconds >= t for t in self.thresholds_s)

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return min(ready, key=lambda s: (self.queue(s), *arrival_key(s))).job.job_id


@_builtin_policy("gittins")
class Gittins(Policy):
    """Tiresias's Gittins index (NSDI'19, after Gittins 1989), the optimal policy for average
    JCT among those that know no job's length, only the distribution lengths come from.

    Of a job that has run ``a`` iterations, the index is the best ratio, over how many more
    iterations ``d`` one would give it, of the chance it finishes within them to the
    iterations they are expected to cost: ``max_d P(N <= a + d | N > a) / E[min(N - a, d) |
    N > a]``, with ``N`` the lengths of past jobs (:meth:`learn`). Divided by the job's
    iteration time it is a chance of finishing per second; the highest runs. Why not LAS:
    LAS assumes the longer a job has run the longer it will run, which is true of heavy
    tails but not of a cluster whose jobs mostly run a few standard lengths; the index
    knows, from the history, when a job is about to finish. A job that has outlived every
    past length has no index: it runs after those that have one, least attained service
    first (LAS, which is also the whole policy while the history is empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []
        """Past jobs' iteration counts, sorted."""
        self._index: dict[int, float | None] = {}
        self.choices = 0
        """Choices between several ready jobs, and how many the index decided (the others
        went least attained service first: no past job had run longer than the chosen)."""
        self.by_index = 0

    def learn(self, lengths: Iterable[int]) -> None:
        """Add past jobs' lengths (iterations) to the distribution (one sort per call, not
        one insertion per length: a history file may hold many)."""
        self.lengths = sorted([*self.lengths, *(int(n) for n in lengths if n > 0)])
        self._index.clear()

    def finished(self, job_id: str, iterations: int) -> None:
        """A job of this run finished after ``iterations``: one more sample of the lengths."""
        self.learn([iterations])

    def index(self, attained: int) -> float | None:
        """The Gittins index (chance of finishing per iteration) after ``attained``
        iterations; ``None`` when no past job ran longer."""
        if attained not in self._index:
            self._index[attained] = gittins_index(self.lengths, attained)
        return self._index[attained]

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        def key(state: JobState) -> tuple[float, ...]:
            index = self.index(state.iterations_done)
            if index is None:
                return (1, state.service_seconds, *arrival_key(state))
            seconds = self.iteration_time(state)
            rate = index / seconds if seconds > 0 else float("inf")  # unmeasured: probe it
            return (0, -rate, *arrival_key(state))

        chosen = min(ready, key=key)
        if len(ready) > 1:
            self.choices += 1
            self.by_index += self.index(chosen.iterations_done) is not None
        return chosen.job.job_id

    def note(self) -> str | None:
        """Without past lengths the policy is LAS: say so, or a reader takes its figures
        for the Gittins index's."""
        if not self.choices or self.by_index == self.choices:
            return None
        return (f"{self.by_index} of {self.choices} choices by the Gittins index; the others "
                "least attained service first (LAS), no past job having run longer"
                + ("" if self.by_index else
                   ": give past lengths with plugins.salus.history"))


def gittins_index(lengths: Sequence[int], attained: int) -> float | None:
    """``max_d P(N - a <= d) / E[min(N - a, d)]`` over the sorted ``lengths`` longer than
    ``attained`` (``a``), ``N`` drawn from them; ``None`` if there is none. The maximum is
    reached at one of the remaining lengths, so only those are tried: one pass over them."""
    remaining = [n - attained for n in lengths[bisect.bisect_right(lengths, attained):]]
    count = len(remaining)
    if not count:
        return None
    best, below = 0.0, 0
    for k, d in enumerate(remaining):
        below += d
        if k + 1 < count and remaining[k + 1] == d:
            continue  # ties: the ratio is taken once all of them are counted
        finished = k + 1
        expected = (below + (count - finished) * d) / count
        best = max(best, (finished / count) / expected)
    return best


def read_history(path: str) -> list[int]:
    """Past jobs' lengths from ``plugins.salus.history``: positive integers separated by
    whitespace or commas, ``#`` to the end of a line a comment. One-line ``ConfigError`` if
    the file cannot be read, holds anything else, or holds no length."""
    source = Path(path).expanduser()
    try:
        text = source.read_text()
    except OSError as exc:
        raise ConfigError(f"plugins.salus.history: cannot read {path!r} ({exc.strerror}); give "
                          "a file of past jobs' lengths in iterations") from None
    lengths = []
    for number, line in enumerate(text.splitlines(), 1):
        for word in re.split(r"[\s,]+", line.split("#", 1)[0].strip()):
            if not word:
                continue
            if not (word.isascii() and word.isdigit()) or int(word) == 0:
                raise ConfigError(f"plugins.salus.history: {path}:{number}: {word!r} is not a "
                                  "job length (a positive number of iterations)")
            lengths.append(int(word))
    if not lengths:
        raise ConfigError(f"plugins.salus.history: {path} holds no job length; list past "
                          "jobs' iteration counts, one per line")
    return lengths
