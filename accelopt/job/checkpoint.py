"""Checkpoints at iteration boundaries, written atomically, and resume.

Each job has its own file (``checkpoints/<job_id>.pt``): jobs in different lanes reach their
boundaries at different times, and a job's state (model, optimizer, random state, iteration
number) is independent of every other job's. A file is written to a temporary name in the same
directory and renamed over the old one, so a kill at any instant leaves either the previous
checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from accelopt.atomic import atomic_open
from accelopt.errors import UserError, error_text
from accelopt.host import PluginAnswerError
from accelopt.job.job import STATE_SAVE, Job, misfit
from accelopt.records import JobResult

CHECKPOINT_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
_RESULT_FIELDS = ("status", "lane", "error", "iterations_done", "service_s", "samples",
                  "final_loss", "losses")


def has_checkpoints(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a job's checkpoint (one process: ``<job>.pt``; a cluster
    run: ``<job>/rankR.itN.pt``): what ``run.resume`` continues from."""
    return any((Path(run_dir) / CHECKPOINT_DIR).rglob("*.pt"))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through :func:`accelopt.atomic.atomic_open` (temp file + rename): a
    Ctrl-C or SIGTERM during the write stops the run once the file is complete, so a stop
    at any instant leaves a checkpoint to resume from and the one line that says how."""
    with atomic_open(path, "wb") as handle:
        torch.save(obj, handle)


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write a job's checkpoint (``state["job"]`` from ``Job.state_dict``). A plugin state
    ``torch.save`` cannot write (a lambda, an open file) stops the run in one line naming
    the plugin and the key, where pickle's error named neither."""
    try:
        atomic_torch_save(state, path)
    except OSError:
        raise
    except Exception:
        culprit = _unsaveable_plugin_state(state.get("job", {}).get("plugins", {}))
        if culprit is None:
            raise
        name, value, why = culprit
        raise PluginAnswerError(name, STATE_SAVE, value, "a dict torch.save can write "
                                f"(tensors and plain values); {why}") from None


def _unsaveable_plugin_state(states: dict[str, Any]) -> tuple[str, Any, str] | None:
    """The first plugin whose saved state ``torch.save`` cannot write: (its name, the state,
    which key fails and why), or ``None``."""
    for name, state in states.items():
        for key, value in state.items():
            try:
                torch.save(value, io.BytesIO())
            except Exception as exc:  # noqa: BLE001 - pickle raises several types
                return name, state, f"key '{key}': {error_text(exc)}"
    return None


class Checkpointer:
    """Saves a job's state every ``every`` iterations and when it finishes."""

    def __init__(self, run_dir: Path, every: int, save_weights: bool,
                 settings: dict[str, Any] | None = None) -> None:
        if every < 0:
            raise UserError(f"run.checkpoint_every must be >= 0 (0 = off), got {every}")
        self.dir = run_dir / CHECKPOINT_DIR
        self.weights_dir = run_dir / WEIGHTS_DIR
        self.every = every
        self.save_weights = save_weights
        self.settings = settings
        """The run's plugin settings (:func:`plugin_settings`), recorded in every checkpoint
        beside its job spec (:data:`PLUGIN_SETTINGS`)."""
        self.written = 0
        self.clock: Callable[[], float] | None = None
        """The driver's clock (seconds since the run started): how long each job has run,
        kept in its checkpoint so a resumed job's JCT counts the part before the resume."""
        self.clock_offset = 0.0
        """A resumed run: the clock of the run it resumed (:func:`resumed_clock`), so the
        ``clock_s`` its own checkpoints record goes on from there across resumes."""
        self.finished: dict[str, dict[str, Any]] = {}
        """A resumed run: the saved job state (``state["job"]``) of each job restored as
        finished (:func:`restore`), by job id, until :meth:`after_finish` writes its files
        from it. Why: those files are written before the run starts, and a plugin that
        changed the model (gpu_kernels' pruning after N iterations) changes the job built
        dense again only when it gets its state back, once the run has started: written
        from the job, the weights were the dense model as built (untrained, of the
        unpruned shapes) and the checkpoint held no plugin state."""

    def after_iteration(self, job: Job, result: JobResult) -> None:
        if self.every and job.iteration % self.every == 0 and not job.done:
            self.save(job, result)

    def save(self, job: Job, result: JobResult, job_state: dict[str, Any] | None = None
             ) -> None:
        """Write ``job``'s checkpoint (its state: ``job_state``, else ``job.state_dict()``).
        ``elapsed_s`` is the time since its arrival (its JCT once done); in a resumed run
        its arrival is on this run's clock (:func:`arrive_on_resumed_clock`), so that is the
        time since its arrival in the first run, however many resumes ago."""
        if result.status == "done" and result.jct_s is not None:
            elapsed = result.jct_s
        else:
            now = self.clock() if self.clock is not None else job.info.arrival_s
            elapsed = max(0.0, now - job.info.arrival_s) + result.carried_s
        state = {
            "job": job.state_dict() if job_state is None else job_state,
            "result": {k: getattr(result, k) for k in _RESULT_FIELDS},
            "timing": {"elapsed_s": elapsed, "queueing_s": result.queueing_s,
                       "clock_s": self.clock_offset + (self.clock() if self.clock else 0.0)},
            "spec": asdict(job.spec),
            PLUGIN_SETTINGS: self.settings,
        }
        save_checkpoint(state, self.dir / f"{job.info.job_id}.pt")
        self.written += 1

    def after_finish(self, job: Job, result: JobResult) -> None:
        """Write a finished job's checkpoint and weights; a job restored as finished
        (:attr:`finished`) gets them from the state it was restored from, as its run left
        it (the weights bitwise those it trained), whatever its model is until the
        plugins have their states back."""
        restored = self.finished.pop(job.info.job_id, None)
        if self.every:
            self.save(job, result, restored)
        if self.save_weights and result.status == "done":
            weights = job.model.state_dict() if restored is None else restored["model"]
            atomic_torch_save(weights, self.weights_dir / f"{job.info.job_id}.pt")


def clock_of(state: Any) -> float | None:
    """The run's clock when a checkpoint was written (one process: ``timing.clock_s``; a
    cluster rank's: ``clock_s``); ``None`` in a checkpoint written before it was kept."""
    if not isinstance(state, dict):
        return None
    timing = state.get("timing")
    value = timing.get("clock_s") if isinstance(timing, dict) else state.get("clock_s")
    return float(value) if isinstance(value, (int, float)) else None


@functools.lru_cache(maxsize=8)
def _newest_clock(files: tuple[tuple[str, int, int], ...]) -> float | None:
    clocks = []
    for name, _mtime, _size in files:
        try:
            state = torch.load(name, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # noqa: BLE001 - an unreadable file was refused before the run
            continue
        clock = clock_of(state)
        if clock is not None:
            clocks.append(clock)
    return max(clocks, default=None)


def resumed_clock(run_dir: str | Path) -> float | None:
    """How far the run resumed had got: the newest clock its checkpoints recorded (``None``:
    none recorded one). Each set of files is read once (a cluster rank asks for every job)."""
    files = []
    for path in sorted((Path(run_dir) / CHECKPOINT_DIR).rglob("*.pt")):
        with contextlib.suppress(OSError):
            stat = path.stat()
            files.append((str(path), stat.st_mtime_ns, stat.st_size))
    return _newest_clock(tuple(files))


def arrive_on_resumed_clock(job: Job, clock: float | None) -> None:
    """Put ``job``'s arrival on a resumed run's clock: ``clock`` (the run resumed had got
    that far, :func:`resumed_clock`) earlier than configured. A resumed run's clock starts
    at 0 where the old one stood at ``clock``, so a job that had arrived by then (it ran, or
    waited in the queue, with or without a checkpoint of its own) arrives at once, at a
    negative time, ahead of every job that arrived after it, and one that had not arrives
    ``arrival_s - clock`` after the resume. Its JCT (end - arrival), queueing delay (first
    start - arrival) and the makespan then count the time before the resume, the work lost
    after its own checkpoint included, and every time in the report (arrival, admission,
    start, end, spans) is on the one clock. Replaying the configured arrival on the new clock
    lost the time from the resume to it: the job was absent from scheduling meanwhile, and
    its JCT, queueing delay and the makespan came out short by it. ``None`` (checkpoints
    that recorded no clock): the arrival stays as configured, and a checkpoint's
    ``elapsed_s`` is carried instead (:func:`restore`)."""
    if clock:
        job.info = dataclasses.replace(job.info, arrival_s=job.info.arrival_s - clock)


def carried_time(state: dict[str, Any], done: bool, clock: float | None) -> float:
    """The time a job restored from ``state`` carries (``JobResult.carried_s``): its JCT,
    where it had finished (:func:`finished_before_the_resume` turns it into its end), or
    its ``elapsed_s`` where the run resumed recorded no clock; otherwise nothing, because
    its arrival on the resumed clock already counts the time before the resume
    (:func:`arrive_on_resumed_clock`)."""
    if done or clock is None:
        return float(state.get("elapsed_s", 0.0))
    return 0.0


PLUGIN_SETTINGS = "plugin_settings"
"""A checkpoint's record of the plugins its run used and each one's settings (the run
config's ``plugins`` section, :func:`plugin_settings`), beside its job spec: a resume whose
config changed them is refused before it writes anything (:func:`refuse_other_plugins`).
Absent from checkpoints written before it was kept (those resume unchecked)."""

def plugin_settings(cfg: Any) -> dict[str, Any] | None:
    """The ``plugins`` section of the run config ``cfg`` as plain values, as ``config.yaml``
    writes it and a resume reads it back (resolved, through YAML: an enum is its name), so
    the section a run used and the one its ``config.yaml`` holds compare equal unless the
    file was edited. ``None``: no config (a set of ready-made plugins), or one that cannot be
    written out (then nothing is recorded, and nothing checked)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return None
    try:
        node = cfg.get("plugins")
        if node is None:
            return {}
        plain = OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(node, resolve=True)))
    except Exception:  # noqa: BLE001 - an interpolation unresolvable here: nothing to record
        return None
    return plain if isinstance(plain, dict) else None


def plugin_difference(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """The first way ``current`` (a resume's plugin settings) differs from ``recorded`` (its
    checkpoint's), in words naming the plugin and the setting with the old and new values,
    and how many more there are; '' where they agree."""
    found: list[str] = []
    for name in recorded:
        if name not in current:
            found.append(f"plugin '{name}' was active and is no longer selected "
                         f"(plugins.{name} is gone)")
    for name in current:
        if name not in recorded:
            found.append(f"plugin '{name}' was not active and is selected now")
    for name, old in recorded.items():
        if name in current:
            _setting_differences(f"plugins.{name}", old, current[name], found)
    if not found and list(recorded) != list(current):
        found.append(f"the plugins ran in the order {', '.join(recorded)} and are listed "
                     f"{', '.join(current)} now (their hooks run in that order)")
    if not found:
        return ""
    more = f" (and {len(found) - 1} more difference(s))" if len(found) > 1 else ""
    return found[0] + more


_UNSET = object()


def _setting_differences(key: str, old: Any, new: Any, found: list[str]) -> None:
    """Append ``key``'s differences (each nested setting's, dotted) to ``found``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for sub in list(old) + [k for k in new if k not in old]:
            _setting_differences(f"{key}.{sub}", old.get(sub, _UNSET), new.get(sub, _UNSET),
                                 found)
    elif old != new:
        found.append(f"{key} was {_shown(old)} and is {_shown(new)} now")


def _shown(value: Any) -> str:
    """A setting's value as ``config.yaml`` spells it (``null``, ``true``, ``0.5``)."""
    if value is _UNSET:
        return "unset"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def refuse_other_plugins(path: Path, state: dict[str, Any], current: dict[str, Any] | None,
                         config: Path) -> None:
    """The checkpoint at ``path`` (its ``state``) must have been written with the plugins and
    plugin settings the resume runs with (``current``, from ``config``, the resumed run's
    ``config.yaml``), checked before a resumed run writes anything: an edited setting
    otherwise ran the rest of the job with the new value on state made with the old one (a
    pruning amount changed after the pruning: the weights were the old amount's, the new
    ``config.yaml`` recorded the new one), and a removed plugin was refused only when its
    state failed to load, after the new directory had been made. A checkpoint with no record
    (written before it was kept) is not checked."""
    recorded = state.get(PLUGIN_SETTINGS)
    if not isinstance(recorded, dict) or current is None:
        return
    difference = plugin_difference(recorded, current)
    if difference:
        raise UserError(f"run.resume: checkpoint {path} was written with other plugin "
                        f"settings than {config} holds: {difference}; resume with the original "
                        "settings (undo the edit of that config.yaml) or start a new run")


def spec_mismatch(path: Path) -> UserError:
    return UserError(f"checkpoint {path} was written for a different job spec; resume with "
                     "the run's own config (run.resume=<that run dir>)")


def refuse_other_spec(path: Path, spec: Any) -> None:
    """The checkpoint at ``path`` must be of ``spec``'s job (checked before a resumed run
    writes anything; memory-mapped, so its tensors are not read)."""
    state = read_checkpoint(path, UNREADABLE_HINT)
    if state.get("spec") != asdict(spec):
        raise spec_mismatch(path)


UNREADABLE_HINT = ("to restart that job from scratch, copy the run directory, delete the file "
                   "in the copy and resume the copy (the directory resumed is only read)")
"""What to do about a one-process run's unreadable checkpoint."""


def read_checkpoint(path: Path, hint: str) -> dict[str, Any]:
    """The checkpoint at ``path``, memory-mapped (its tensors are not read), or a one-line
    :class:`UserError` ending with ``hint``: checked for every file a resume carries before
    it writes anything, so a damaged file leaves no new directory behind."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user problem
        raise UserError(f"cannot read checkpoint {path}: {error_text(exc)}; {hint}") from None
    if not isinstance(state, dict):
        raise UserError(f"cannot read checkpoint {path}: it holds a {type(state).__name__}, "
                        f"not a checkpoint; {hint}")
    return state


def load_into(path: Path, job: Job) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``job`` (model, optimizer, random state,
    iteration) and return the whole saved state. Each way it can be wrong is one line: an
    unreadable file, another job's spec, or a state that does not fit the model."""
    try:
        state = torch.load(path, map_location=job.device, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user problem
        raise UserError(f"cannot read checkpoint {path}: {error_text(exc)}; "
                        f"{UNREADABLE_HINT}") from None
    if state.get("spec") != asdict(job.spec):
        raise spec_mismatch(path)
    try:
        job.load_state_dict(state["job"], source=str(path))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise misfit(str(path), job.info.name, exc) from None
    return state


def finished_before_the_resume(result: JobResult) -> None:
    """The row of a job that had finished before the run was resumed (nothing more to
    run): its times as they were, from its arrival (on the resumed run's clock, before it
    started: :func:`arrive_on_resumed_clock`): it ends its carried time (its JCT) after
    it, and first started its queueing delay after it. It ended at its arrival with its
    JCT carried, which put its end before its own first start and moved its start back in
    the makespan instead of its end forward (a resumed run's makespan came out shorter than
    a job's arrival plus its JCT)."""
    arrival = result.job.arrival_s
    result.end_s = arrival + result.carried_s
    if result.carried_queueing_s is not None:
        result.first_start_s = arrival + result.carried_queueing_s
        result.carried_queueing_s = None
    result.carried_s = 0.0


def started_before_the_resume(result: JobResult) -> None:
    """A job that had started before the run was resumed (its checkpoint carried its
    queueing delay) first started then, not at its first iteration after the resume: its
    first start is its arrival (on the resumed run's clock, :func:`arrive_on_resumed_clock`)
    plus that delay, negative where it was before the resume, so ``first_start_s -
    arrival_s`` is its queueing delay, as the report says. It was the resumed run's first
    iteration, which put the first start after the resume and disagreed with the queueing
    delay carried beside it. Its queueing delay is then its first start's, as for any job."""
    if result.carried_queueing_s is not None:
        result.first_start_s = result.job.arrival_s + float(result.carried_queueing_s)
        result.carried_queueing_s = None


def restore(run_dir: Path, jobs: list[Job],
            checkpointer: Checkpointer | None = None) -> dict[str, JobResult]:
    """Load each job's latest checkpoint from ``run_dir``; return the restored results.

    Every job's arrival moves onto the resumed run's clock (:func:`arrive_on_resumed_clock`),
    so a job that had arrived is there from the start, with or without a checkpoint; one
    without a checkpoint starts from scratch. A checkpoint whose job spec differs from the
    job being resumed is refused (it would silently train something else).
    ``checkpointer`` (the resumed run's) goes on with the old run's clock, and keeps the
    saved state of each job that had finished (:attr:`Checkpointer.finished`) to write its
    files from.
    """
    results: dict[str, JobResult] = {}
    clock = resumed_clock(run_dir)
    if checkpointer is not None:
        checkpointer.clock_offset = clock or 0.0
    for job in jobs:
        arrive_on_resumed_clock(job, clock)
        path = run_dir / CHECKPOINT_DIR / f"{job.info.job_id}.pt"
        if not path.exists():
            continue
        state = load_into(path, job)
        result = JobResult(job.info)
        for key, value in state["result"].items():
            setattr(result, key, value)
        timing = state.get("timing", {})
        result.carried_s = carried_time(timing, result.status == "done", clock)
        result.carried_queueing_s = timing.get("queueing_s")
        if result.status == "done":
            finished_before_the_resume(result)
            if checkpointer is not None:
                checkpointer.finished[job.info.job_id] = state["job"]
        else:
            started_before_the_resume(result)
            if result.status not in ("failed", "rejected"):
                result.status = "pending"
        results[job.info.job_id] = result
    return results
