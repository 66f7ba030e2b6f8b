"""Errors that reach the user as one line, without a traceback.

``UserError`` and its subclasses mean "the input is wrong, here is the fix": the CLI prints
``error: <message>`` and exits with code 2. ``PluginHookError`` means a plugin's own code
raised: it names the plugin and the hook, and exits with code 1 (the traceback is shown
with ``--debug``).
"""

from __future__ import annotations

from collections.abc import Sequence


def listed(items: Sequence[str], shown: int = 3, sep: str = ", ") -> str:
    """The first ``shown`` of ``items`` joined, and how many more: a one-line message names a
    few of many (keys, layers, jobs) without growing with them."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


CUT = (":", ",", "(", "[", "{")
"""A line ending so goes on in the next one (``Validation error for field 'vocab_size':``)."""


def one_line(text: str) -> str:
    """``text``'s non-blank lines, stripped, joined by spaces: a multi-line message (torch's,
    a library's validation error) inside one of accelopt's lines."""
    return " ".join(ln.strip() for ln in text.splitlines() if ln.strip())


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (``""`` when it has none): an error inside a
    one-line message. A first line that is cut (it ends with ``:`` or an open bracket) takes
    the lines after it up to one that is not, joined: kept alone, the message ended at
    "Validation error for field 'vocab_size':", its reason left off."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    end = 1
    while end < len(lines) and lines[end - 1].rstrip().endswith(CUT):
        end += 1
    return one_line("\n".join(lines[:end]))


def error_text(exc: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone without one): someone else's
    error (a user's code, torch) quoted in one of accelopt's lines."""
    text = first_line(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def did_you_mean(name: str, options: Sequence[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the option closest to a mistyped ``name`` (``prefix``
    before it: a key's parent), else ``""``: the hint every "unknown ..." line ends with."""
    import difflib

    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


class AccelOptError(Exception):
    """Base class of every error accelopt raises on purpose."""

    exit_code = 1
    hook: str | None = None
    """The hook this error came out of, when a plugin raised it (set by the host)."""


class UserError(AccelOptError):
    """Bad input from the user: unknown plugin, wrong type, impossible request."""

    exit_code = 2


class ConfigError(UserError):
    """The run configuration does not validate."""


class PluginResolutionError(UserError):
    """The selected plugins cannot be combined (unknown, conflicting, missing, cyclic)."""


class PluginHookError(AccelOptError):
    """A plugin raised inside one of its hooks."""

    def __init__(self, plugin: str, hook: str, error: BaseException) -> None:
        self.plugin = plugin
        self.hook = hook
        self.error = error
        super().__init__(
            f"plugin '{plugin}' raised in hook {hook}: {type(error).__name__}: {error}"
        )


class RankFailed(AccelOptError):
    """A process of a cluster run died or raised; the run was stopped. In a cluster run every
    rank runs every job's iterations, so a job that raises there stops the run (where one
    process only fails that job): ``accelopt.run`` raises this, naming the rank, its pid,
    the iteration and job it was in and the cause, and ``metrics.json`` gives that job the
    cause and marks the other jobs that had not finished as failed with this line."""

    def __new__(cls, *args: object, exit_code: int = 1, **kwargs: object) -> RankFailed:
        # bad input found on a rank (exit code 2) is a UserError there as in one process:
        # `except accelopt.UserError` around accelopt.run catches it in every mode
        if cls is RankFailed and exit_code == UserError.exit_code:
            cls = RankRefused
        return super().__new__(cls, *args)

    def __init__(self, message: str, *, rank: int, pid: int | None, iteration: int | None,
                 cause: str, exit_code: int = 1, job_id: str = "") -> None:
        super().__init__(message)
        self.rank, self.pid, self.iteration, self.cause = rank, pid, iteration, cause
        self.job_id = job_id
        """The job whose iteration the rank was running when it failed (``""``: none, or
        the failure was a peer's consequence): its own code or a plugin's hook raised
        there, and ``metrics.json`` gives that job the cause and the others the run's
        stop."""
        self.exit_code = exit_code
        """The rank's own error's exit code, as the same error exits in one process: 3 when
        a job's own code raised (one process fails that job and exits 3), 2 when it raised a
        ``UserError`` elsewhere (bad input found on a rank, e.g. by a plugin's hook)."""
        self.ended: dict[str, dict[str, object]] = {}
        """The jobs that had ended before the run stopped, as the leader recorded them (job
        id -> status, error, iterations, JCT and queueing delay): their evidence says so."""


class RankRefused(RankFailed, UserError):
    """A :class:`RankFailed` whose rank found bad input (a plugin's refusal, a rendezvous
    port in use): a :class:`UserError` too, exit code 2."""


class JobFailed(AccelOptError):
    """A job raised mid-iteration; the run goes on without it."""


class JobsUnfinished(AccelOptError):
    """The run completed, but some jobs failed or were rejected (outputs are written)."""

    exit_code = 3


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a CI runner's timeout, a scheduler's preemption) turned into an
    exception in the main thread, so a run stops as on Ctrl-C: rank processes stopped,
    partial ``metrics.json``, trace and log kept. A ``KeyboardInterrupt`` so that every
    ``except Exception`` lets it through, as it lets Ctrl-C through."""

    exit_code = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM killed


REPEATED_SIGTERM_S = 1.0
"""A SIGTERM this soon after the one being handled is the same stop, not a second one."""

_last_sigterm: list[float] = []
"""When :func:`raise_terminated` last raised (``time.monotonic``), if it has."""


def raise_terminated(signum: int, _frame: object) -> None:
    """A SIGTERM handler: :class:`Terminated` in the main thread, once per stop. A SIGTERM
    within :data:`REPEATED_SIGTERM_S` of the last one is ignored: ``timeout`` (and a CI
    runner's time limit) signals the command and then its whole process group, so one stop
    arrives as two signals milliseconds apart, and the second one, raised inside the first
    one's clean-up (the lanes being joined, the outputs being written), left a run's
    metrics.json and metrics.csv disagreeing, or its trace and timeline unwritten. A later
    SIGTERM still stops the clean-up at once."""
    import time

    now = time.monotonic()
    if _last_sigterm and now - _last_sigterm[0] < REPEATED_SIGTERM_S:
        return
    _last_sigterm[:] = [now]
    raise Terminated()


def raised_by_hook(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a hook call (a plugin's error stops the run; an error of a
    job's own code fails that job alone)."""
    return isinstance(exc, AccelOptError) and exc.hook is not None
