"""The execution service as a long-lived process: ``accelopt serve``.

One process owns the device. Jobs are submitted over a local Unix socket (owner-only
permissions) while others run; the core executor (kept open: ``Executor(keep_open=True)``)
admits them through salus's lanes and switches between them at iteration boundaries under the
configured policy. A job belongs to the service, not to the client that submitted it: the
client may exit at once. Each job writes its results to ``<root>/jobs/<job_id>/``
(``job.json`` with status, metrics, losses and the trained model's held-out quality;
``weights.pt`` when it finished). They are written on a thread of their own, not under the
executor's lock: scoring a model on its held-out set takes a while, and the other jobs'
iterations must not wait for it. A submit the service refuses (an unknown model, a model that
raises while profiled, a job whose profile can never fit the capacity) writes nothing and takes
no number; a workload's jobs are all profiled before any is taken, so they arrive together, and
one refused refuses them all. A job an earlier service on the
root left unended (killed with it) is marked failed by the next service that starts there.

Protocol: one JSON object per line each way. Requests: ``{"op": "submit", "job": {...}}``
(JobConfig keys), ``{"op": "submit", "workload": "tiny"}``, ``{"op": "submit", "factory":
"module:function", "args": {...}}`` (the function returns a JobConfig, a dict of its keys
naming ``model``, or a ``Job``), ``{"op": "status"}``, ``{"op": "cancel", "id": "..."}``,
``{"op": "ping"}``, ``{"op": "wait", "id": "...", "timeout_s": 60}`` (block until the job
ended and its files are written; answers the state ``status`` shows), ``{"op": "shutdown"}`` (stop accepting, let the jobs
finish, exit). Replies carry ``"ok": true`` or ``"ok": false, "error": "one line"``; a
malformed request gets an error reply and the service keeps running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import signal
import socket
import socketserver
import stat
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from accelopt import UserError
from accelopt.atomic import atomic_open, refuse_unwritable
from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.local import CANCELLED, ENDED, Executor
from accelopt.drivers.setup import memory_capacity, pick_device
from accelopt.errors import Terminated, did_you_mean, error_text, first_line
from accelopt.host import PluginHost
from accelopt.job import Job, job_specs
from accelopt.job.job import first_step_failed
from accelopt.job.profile import measure_profile
from accelopt.job.quality import score_result
from accelopt.records import JobResult
from accelopt.report import job_metrics
from accelopt.report.metrics import finite
from accelopt.types import AllocationRequest, JobInfo
from accelopt.workloads.refs import import_path_fix

MAX_REQUEST = 1 << 20


def default_socket() -> Path:
    env = os.environ.get("ACCELOPT_SALUS_SOCKET")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path.home() / ".accelopt"
    return base / "accelopt-salus.sock"


SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
"""The longest Unix socket path, in bytes: ``sun_path`` (108 bytes on Linux, 104 on macOS and
the BSDs) less its terminating NUL."""


def check_socket_path(path: Path) -> None:
    """Refuse, in one line with the fix, a socket path longer than a Unix socket takes.

    Why before any bind or connect: ``socket`` raises a bare ``OSError("AF_UNIX path too
    long")``, which ``accelopt serve``, ``submit`` and ``status`` reported as a crash of the
    plugin (and ``serve`` after it had made the socket's directory and lock file)."""
    size = len(os.fsencode(str(path)))
    if size > SOCKET_PATH_MAX:
        raise UserError(f"the socket path {path} is {size} bytes, over the {SOCKET_PATH_MAX}-"
                        "byte limit of a Unix socket path; pass a shorter --socket or "
                        "$ACCELOPT_SALUS_SOCKET")


def _import_fix(exc: BaseException, module: str) -> str:
    """How to let the service import a factory's ``module``: its own package on the import
    path (:func:`import_path_fix`; "start it where it can (its working directory)" sent a
    user back to where it had failed), or, for a module the user's module imports, that
    module installed where the service runs. Any other failure (no such attribute, a
    submodule missing) says itself."""
    own = import_path_fix(exc, module, "accelopt serve")
    if own or not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return own
    if module == exc.name or module.startswith(f"{exc.name}."):
        return ""  # the user's own package, found, without that module: the error says it
    return (f"; {module} imports {exc.name!r}, which is not installed where the service "
            f"runs (its Python: {sys.executable}): install it there")


@dataclasses.dataclass
class ServeOptions:
    socket: Path
    root: Path
    policy: str = "pack"
    capacity: str = ""
    max_lanes: int = -1
    threads: int = 0
    device: str = "cpu"


class Service:
    """The executor, the salus plugin and the request handlers of one ``accelopt serve``.

    Constructing one checks every option and writes nothing: ``--capacity abc`` or
    ``--device tpu`` refused after ``<root>/jobs`` was made left an empty root behind. Job
    directories are made as jobs are submitted (:func:`serve` makes ``<root>/jobs`` once
    the service starts)."""

    def __init__(self, options: ServeOptions) -> None:
        from accelopt_plugins.salus import PLUGIN, SalusConfig
        from accelopt_plugins.salus.plugin import SERVE_SETTINGS

        self.options = options
        self.root = options.root
        # a root the service cannot write is said now, not at the first job's end; it is
        # made by :func:`serve` once every option passed (a refused start leaves nothing)
        refuse_unwritable(self.root / "jobs", "give --root a directory you can write")
        self.device = pick_device(options.device)
        config = SalusConfig(policy=options.policy, capacity=options.capacity,
                             max_lanes=options.max_lanes, threads=options.threads)
        self.plugin = PLUGIN.instantiate(config)
        self.plugin.setting_names = SERVE_SETTINGS  # its warnings name --threads, --max-lanes
        self.host = PluginHost([(PLUGIN, self.plugin)])
        run_cfg = OmegaConf.structured(AccelConfig)
        run_cfg.run.device = str(self.device)
        self.host.call("accelopt_configure", config=config, run_config=run_cfg)
        capacity = self.plugin.capacity or memory_capacity("auto", self.device)
        self.plugin.device = str(self.device)
        self.plugin.check_threads(max(1, self.plugin.max_lanes))  # said at start, not at a job
        self.executor = Executor(self.host, [], capacity_bytes=capacity, device=str(self.device),
                                 profiler=measure_profile, on_finish=self._job_finished,
                                 keep_open=True)
        self._ids = _last_job_number(self.root / "jobs")
        """Numbers go on from the jobs a previous service left in ``root`` (a restart after a
        crash): a number reused would write a new job over an old one's results."""
        self._lock = threading.Lock()
        self._outputs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="salus-outputs")
        self._written: dict[str, Future[None]] = {}
        """Per ended job whose files are being written (``wait`` answers once they are)."""
        self._interrupted: list[dict[str, Any]] = []
        """Status rows of the jobs a previous service left without results (:meth:`recover`)."""

    # -- requests --------------------------------------------------------------------------

    def handle(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            raise UserError('a request is a JSON object with an "op" string')
        op = request["op"]
        if op == "ping":
            return {"pid": os.getpid()}
        if op == "submit":
            return {"submitted": self._submit(self._specs(request))}
        if op == "status":
            return self.status()
        if op == "cancel":
            job_id = request.get("id")
            if not isinstance(job_id, str):
                raise UserError('cancel needs "id": a job id string')
            return {"message": self._cancel(job_id)}
        if op == "wait":
            job_id = request.get("id")
            if not isinstance(job_id, str):
                raise UserError('wait needs "id": a job id string')
            timeout = _wait_timeout(request.get("timeout_s", 60.0))
            deadline = time.monotonic() + timeout
            status = self._wait_state(job_id, self.executor.wait(job_id, timeout))
            written = self._written.get(job_id)
            if written is not None:
                try:
                    written.result(max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    pass  # the job ended; its files come later (the caller asked for no more)
            return {"status": status}
        if op == "shutdown":
            self.executor.close()
            return {"message": "stopping: no new jobs; running jobs finish first"}
        raise UserError(f"unknown op {op!r}; use submit, status, cancel, wait, ping or shutdown")

    def _wait_state(self, job_id: str, status: str) -> str:
        """The state ``wait`` answers, as ``status`` and ``job.json`` say it
        (:func:`_ended_state`): the executor's bare status answered "failed" for a job a user
        cancelled, which ``status`` listed as cancelled."""
        for info, result, _ in self.executor.snapshot():
            if result.status == status and (info.job_id == job_id or (
                    job_id.isdigit() and info.job_id.partition("-")[0].isdigit()
                    and int(info.job_id.partition("-")[0]) == int(job_id))):
                return _ended_state(result)
        return status

    def _specs(self, request: dict[str, Any]) -> list[Any]:
        given = [key for key in ("job", "workload", "factory") if key in request]
        if len(given) > 1:  # one was taken and the others dropped without a word
            raise UserError(f"submit takes one of \"job\", \"workload\" or \"factory\", got "
                            f"{' and '.join(repr(key) for key in given)}; send one per submit")
        if "args" in request and "factory" not in request:
            raise UserError('submit: "args" are a factory\'s arguments; with "job" put the keys '
                            'in "job", a workload takes none')
        if "workload" in request:
            name = str(request["workload"])
            path = Path(import_module("accelopt.configs").__file__).parent / "workload"
            known = sorted(p.stem for p in path.glob("*.yaml") if p.is_file())
            # a name, never a path: "../config" loaded the run's own config as a workload
            # (a raw multi-line ConfigKeyError and a traceback in the service's output)
            if name not in known:
                raise UserError(f"unknown workload {name!r}; built-in workloads: "
                                f"{', '.join(known)} (a built-in name, not a path)")
            cfg = OmegaConf.structured(AccelConfig)
            loaded = OmegaConf.load(path / f"{name}.yaml")
            if "workload" in loaded:  # a `@package _global_` workload (the embedded default)
                loaded = loaded.workload
            cfg.workload = OmegaConf.merge(cfg.workload, loaded)
            return job_specs(cfg)
        if "factory" in request:
            args = request.get("args")
            return [self._from_factory(str(request["factory"]), {} if args is None else args)]
        if "job" in request:
            return [_job_config(request["job"])]
        raise UserError('submit needs "job", "workload" or "factory"')

    def _from_factory(self, ref: str, args: Any) -> Any:
        # the request's mistake, said as one: "args": [1] was blamed on the factory
        # ("raised TypeError", with a traceback in the service's output)
        if not isinstance(args, dict) or not all(isinstance(key, str) for key in args):
            raise UserError(f'submit: "args" are the factory\'s keyword arguments, an object '
                            f'of name: value, got {type(args).__name__} {args!r:.80}')
        module, _, attr = ref.partition(":")
        try:
            fn = getattr(import_module(module), attr or "make_job")
        except (ImportError, AttributeError, ValueError) as exc:
            # the service imports it, not the client that asked: a module on the client's
            # path only read as the client's own problem
            raise UserError(f"the service (pid {os.getpid()}) cannot import {ref!r}: "
                            f"{type(exc).__name__}: {exc}{_import_fix(exc, module)}") from None
        try:
            made = fn(**args)
        except Exception as exc:  # the user's factory: one line back, its traceback here
            traceback.print_exc()
            raise UserError(f"factory {ref!r} raised {error_text(exc)} (its traceback is in "
                            "the service's output)") from None
        if isinstance(made, Job):
            return made
        ran = (f"the service (pid {os.getpid()}) called it and it ran to its end there; a "
               "factory builds a job (return a JobConfig, a dict of its keys naming its "
               "\"model\", or an accelopt Job) and the service trains it")
        if isinstance(made, dict) and not isinstance(made.get("model"), str):
            # a training function's metrics ({"loss": ...}) or the settings it trained with
            # ({"lr": ..., "iterations": ...}) were read as a job's keys: refused with a
            # confusing key error, or taken as a default mlp job nobody asked for
            shown = ", ".join(repr(key) for key in list(made)[:6]) or "no keys"
            raise UserError(f"{ref} returned a dict without \"model\" ({shown}), not a job: "
                            f"{ran}")
        if isinstance(made, (dict, JobConfig)):
            # through the schema a plain submit's keys go through: a JobConfig is a plain
            # dataclass, and its iterations="abc" reached the job's checks as a TypeError
            fields = made if isinstance(made, dict) else dataclasses.asdict(made)
            try:
                return _job_config(fields)
            except UserError as exc:
                raise UserError(f"{ref} returned a {exc}") from None
        # it ran here, to its end: a training function trained in the service's request
        # thread, and only then was this said
        raise UserError(f"{ref} returned {type(made).__name__}, not a job: {ran}")

    def _submit(self, specs: list[Any]) -> list[str]:
        """Take the jobs of one submit (one job, or a workload's), their ids in order.

        Every job is profiled (and checked to fit) first, then all are handed to the
        executor under its lock, so they arrive together (within microseconds) and none
        starts before the last arrives: a workload's jobs profiled and submitted one after
        another arrived up to 1.6 s apart, one ended before the last arrived, and the orders
        SRTF, FAIR and RR give jobs that wait together never showed. One job refused
        refuses the submit: the others are not taken either."""
        # under the lock to the end: a refused job (an unknown model, profiling failed)
        # takes no number, so the numbers a user sees have no gaps
        with self._lock:
            number = self._ids
            taken: list[tuple[Any, Job]] = []
            for spec in specs:
                number += 1
                job = self._numbered_job(spec, number)
                try:
                    self._refuse_never_fits(job)
                except UserError as exc:
                    if len(specs) == 1:
                        raise
                    raise UserError(f"{exc}; no job of this submit was taken") from None
                taken.append((spec, job))
            # each job's directory is made before the executor takes any job: a directory
            # that cannot be made (a name too long for the file system) refused the submit
            # after the job was taken, and it ran with nowhere to write its results
            made = self._make_job_dirs([job for _, job in taken])
            try:
                with self.executor.lock:  # no job starts before the last one arrived
                    for _, job in taken:  # refused (shutting down): no files, no numbers
                        self.executor.submit(job)
            except BaseException:
                for job_dir in made:
                    with contextlib.suppress(OSError):
                        job_dir.rmdir()
                raise
            self._ids = number
        for spec, job in taken:
            job_dir = self.root / "jobs" / job.info.job_id
            if not isinstance(spec, Job):  # its arrival as job.json has it (at the submit)
                spec = dataclasses.replace(spec, arrival_s=job.info.arrival_s)
                (job_dir / "config.json").write_text(
                    json.dumps(dataclasses.asdict(spec), indent=1))
        return [job.info.job_id for _, job in taken]

    def _make_job_dirs(self, jobs: list[Job]) -> list[Path]:
        """Make ``jobs``' directories, all or none: one that cannot be made removes those
        made and refuses the submit in one line. Returns what was made, to remove in that
        order if the executor refuses the jobs (the root and ``jobs/`` too where this made
        them: a refused submit leaves no files)."""
        made: list[Path] = []
        parents = [p for p in (self.root / "jobs", self.root) if not p.exists()]
        for job in jobs:
            job_dir = self.root / "jobs" / job.info.job_id
            try:
                job_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                for done in made + parents:
                    with contextlib.suppress(OSError):
                        done.rmdir()
                raise UserError(f"job {job.info.name!r} refused: its directory {job_dir} "
                                f"cannot be made ({exc.strerror or exc}); no job of this "
                                "submit was taken") from None
            made.append(job_dir)
        return made + parents

    def _numbered_job(self, spec: Any, number: int) -> Job:
        """The job ``spec`` (a JobConfig, or a ``Job`` a factory built) with its id
        ``NNN-name``; it arrives when the executor takes it (:meth:`Executor.submit`)."""
        now = self.executor.now()
        if isinstance(spec, Job):
            spec.info = dataclasses.replace(spec.info, job_id=f"{number:03d}-{spec.info.name}",
                                            arrival_s=now)
            return spec
        spec = dataclasses.replace(spec, arrival_s=now)
        return Job(spec, job_id=f"{number:03d}-{spec.name}", device=self.device)

    def _refuse_never_fits(self, job: Job) -> None:
        """Profile ``job`` (as :meth:`Executor.submit` would, with the executor's profiler and
        its refusal) and refuse it in one line if no lane can ever hold it. The capacity is
        fixed and the profile measured, so the lane manager's admission would only reject it
        later: the submit printed a job id and exited 0, the job took a number and a
        directory, and only ``status`` said "rejected". The check is the admission's own
        (:meth:`LaneManager.never_fits`)."""
        profiler = self.executor.profiler
        if profiler is None:
            return
        if job.info.profile is None:
            try:
                job.with_profile(profiler(job))
            except Exception as exc:  # the job's own code: refused as the executor refuses it
                raise UserError(f"job {job.info.name!r} refused: "
                                f"{first_step_failed(job, exc)}") from None
        profile = job.info.profile
        if profile is None:
            return
        with self.executor.lock:  # the plugin's hooks make and change its lanes under it
            manager = self.plugin.manager or self.plugin._lanes(AllocationRequest(
                job=job.info, phase="admission", persistent_bytes=profile.persistent_bytes,
                ephemeral_bytes=profile.ephemeral_bytes, device=str(self.device),
                capacity_bytes=self.executor.capacity_bytes))
            never = manager.never_fits(profile.persistent_bytes, profile.ephemeral_bytes)
        if never is not None:
            raise UserError(f"job {job.info.name!r} refused: it {never}")

    def _cancel(self, job_id: str) -> str:
        """Cancel a job: the executor's line (when it stopped, which lane it left) and, for a
        job this cancel took out of a lane, whether salus reclaimed the lane or it runs on
        with its other jobs (only the plugin's lane manager knows). Held under the
        executor's lock throughout, so nothing else ends a job meanwhile."""
        with self.executor.lock:
            before = {info.job_id for info, result, _ in self.executor.snapshot()
                      if result.status not in ENDED}
            message = self.executor.cancel(job_id)
            after = self.executor.snapshot()
            ended = [result for info, result, _ in after
                     if info.job_id in before and result.status in ENDED]
            running = [(info, result) for info, result, busy in after
                       if busy and info.job_id in before and result.status not in ENDED
                       and message.startswith(f"{info.job_id} ")]
            if running:
                return _stops_later(message, *running[0])
            if len(ended) != 1 or not ended[0].lane:
                return message  # not yet in a lane, or ended already
            manager = self.plugin.manager
            lane = None if manager is None else manager.lanes.get(ended[0].lane)
            if lane is None:
                return f"{message}, which was reclaimed"
            return f"{message}, which runs on with {', '.join(sorted(lane.jobs))}"

    # -- outputs -----------------------------------------------------------------------------

    def _job_finished(self, job: Job, result: JobResult) -> None:
        """The executor's end-of-job callback (under its lock): hand the files over."""
        job_id = job.info.job_id
        self._written[job_id] = written = self._outputs.submit(self._write_outputs, job, result)
        # once written, wait() has nothing to wait for: a long-lived service keeps none
        written.add_done_callback(lambda _, job_id=job_id: self._written.pop(job_id, None))

    def _write_outputs(self, job: Job, result: JobResult) -> None:
        """Score the trained model on its held-out set (as ``accelopt run`` does, outside the
        job's timed work) and write ``job.json`` and ``weights.pt``."""
        try:
            score_result(result, job.spec, job.model, job.dataset, job.device)
            state = _ended_state(result)
            if state == "cancelled":  # it said "the job did not finish (failed)"
                result.quality_note = "the job did not finish (cancelled)"
            job_dir = self.root / "jobs" / job.info.job_id
            job_dir.mkdir(parents=True, exist_ok=True)
            # the state `accelopt status` shows: a cancelled job is no failure of its own
            _write_job_json(job_dir, result, state, self.plugin.lanes_note())
            if result.status == "done":
                with atomic_open(job_dir / "weights.pt", "wb") as fh:
                    torch.save(job.model.state_dict(), fh)
        except Exception:  # a full disk: said in the service's output, the service goes on
            print(f"accelopt serve: could not write job {job.info.job_id}'s files:",
                  file=sys.stderr)
            traceback.print_exc()

    def recover(self) -> list[str]:
        """Mark the jobs a previous service on this root left unended (it was killed while
        they ran, or before their files were written) as failed: their ``job.json`` says
        so and ``status`` lists them, instead of a directory with a config and nothing else.
        Called once this service holds the root (never while another writes into it);
        returns their ids."""
        for job_dir in sorted(_job_dirs(self.root / "jobs")):
            if (job_dir / "job.json").exists():
                continue
            result = JobResult(_info_from_config(job_dir), status="failed", error=INTERRUPTED)
            # the killed service kept no record of the job's progress: its iterations (and
            # samples) are unknown, not the 0 a fresh result holds (it may have run most)
            _write_job_json(job_dir, result, "failed", progress_known=False)
            self._interrupted.append(_status_row(result.job, result, busy=False,
                                                 progress_known=False))
        return [row["id"] for row in self._interrupted]

    def fail_unended(self, exc: BaseException) -> list[str]:
        """The executor stopped on ``exc``: refuse new jobs, let the ended jobs' files be
        written, then give every job that had not ended its failed ``job.json`` with the error
        line (as ``accelopt run`` marks its unended jobs), instead of a directory with a
        config and nothing else until the next service's :meth:`recover`. A job's
        ``job.json`` already written is never replaced. Returns the ids it failed."""
        from accelopt.runtime.run import error_line

        self.executor.close()  # a submit answered now would leave a job nobody runs
        self.finish_outputs()
        error = f"the service stopped: {error_line(exc)}"
        failed = []
        for info, result, _ in self.executor.snapshot():
            job_dir = self.root / "jobs" / info.job_id
            if result.status in ENDED or (job_dir / "job.json").exists():
                continue
            ended = dataclasses.replace(result, status="failed", error=error)
            with contextlib.suppress(OSError):  # a full disk must not hide the error
                job_dir.mkdir(parents=True, exist_ok=True)
                _write_job_json(job_dir, ended, "failed", self.plugin.lanes_note())
                failed.append(info.job_id)
        return failed

    def finish_outputs(self) -> None:
        """Wait for every ended job's files (the service is stopping)."""
        self._outputs.shutdown(wait=True)

    def status(self) -> dict[str, Any]:
        jobs = [*self._interrupted,
                *(_status_row(*job) for job in self.executor.snapshot())]
        with self.executor.lock:
            manager = self.plugin.manager
            lanes = [] if manager is None else [
                {"id": lane.lane_id, "size": lane.size, "used": lane.need,
                 "jobs": sorted(lane.jobs), "busy": lane.in_flight}
                for lane in manager.lanes.values()
            ]
            used = manager.used if manager else 0
        return {"policy": self.plugin.policy.name, "device": str(self.device),
                "capacity": self.executor.capacity_bytes, "used": used, "lanes": lanes,
                "jobs": jobs, "note": self.plugin.lanes_note(), "pid": os.getpid()}


def _stops_later(message: str, info: JobInfo, result: JobResult) -> str:
    """The cancel line of a job inside an iteration: the cancel answers at once (it does
    not wait for the iteration to end), so it cannot yet say after how many iterations the
    job stopped or whether its lane was reclaimed; it says which iteration runs and where
    the rest will be said (the bare "will stop at the end of its current iteration" left a
    user who read the documented line waiting for what it never said)."""
    done, total = result.iterations_done, info.iterations
    return (f"{message} (iteration {done + 1} of {total}); `accelopt status` then shows it "
            "cancelled, its iterations done, and its lane gone if it held no other job (its "
            "job.json too)")


def _wait_timeout(timeout: Any) -> float:
    """A ``wait`` request's ``timeout_s``: a finite number >= 0, refused in one line
    otherwise, capped at ``threading.TIMEOUT_MAX`` (what a lock's wait takes: an inf or a
    1e10 raised OverflowError in the answer and a traceback in the service's log)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 <= timeout < math.inf:
        raise UserError(f'wait: "timeout_s" must be a number of seconds >= 0 (finite), got '
                        f"{timeout!r}")
    return min(float(timeout), threading.TIMEOUT_MAX)


def _write_job_json(job_dir: Path, result: JobResult, status: str,
                    lanes_note: str | None = None, progress_known: bool = True) -> None:
    """A job's ``job.json``: its metrics with the ``status`` ``accelopt status`` shows, its
    losses and (where the service knows them) its lanes. One writer for an ended job, a job
    the service stopped on, and one a killed service left (``progress_known=False``: its
    ``iterations`` and ``samples`` are ``null``, unknown, not a false 0)."""
    row = {**job_metrics(result), "status": status, "jct_s": _jct(result)}
    if not progress_known:
        row.update(iterations=None, samples=None)
    document: dict[str, Any] = {"job": row, "losses": result.losses}
    if lanes_note is not None:
        document["lanes_note"] = lanes_note
    with atomic_open(job_dir / "job.json", "w") as fh:  # a diverged loss as null, not NaN
        json.dump(finite(document), fh, indent=1, default=str, allow_nan=False)


def _jct(result: JobResult) -> float | None:
    """A job's completion time, ``None`` for one that ran no iteration (cancelled while it
    waited, or failed before its first step ended): it completed nothing, and the time to
    its cancel read as a JCT in ``status``."""
    return None if result.iterations_done == 0 else result.jct_s


def _status_row(info: JobInfo, result: JobResult, busy: bool,
                progress_known: bool = True) -> dict[str, Any]:
    """One job as ``status`` lists it (``progress_known=False``: a job a killed service left,
    its ``done`` is ``None``, unknown)."""
    state = _ended_state(result)
    if state == "pending":
        state = "running" if busy else ("admitted" if result.lane else "waiting")
    profile = info.profile
    quality = result.quality
    return {
        "id": info.job_id, "name": info.name, "model": info.model,
        "state": state, "lane": result.lane,
        "done": result.iterations_done if progress_known else None,
        "iterations": info.iterations, "jct_s": _jct(result),
        "persistent": profile.persistent_bytes if profile else None,
        "ephemeral": profile.ephemeral_bytes if profile else None,
        "error": result.error,
        "quality_metric": quality.metric if quality else None,
        "quality": quality.value if quality else None,
        "quality_p_at_5": quality.p_at_5 if quality else None,
        # a job that trained to its end on a loss of nan is "done", as in a run's
        # metrics.json; these say so (the row read as a job done well)
        "diverged": result.diverged_at is not None,
        "quality_note": result.quality_note,
    }


INTERRUPTED = ("the service stopped before the job ended (killed or crashed while it ran, or "
               "before its results were written); submit it again")


def _info_from_config(job_dir: Path) -> JobInfo:
    """The job a directory holds, as its ``config.json`` says (a job submitted as an
    accelopt ``Job`` has none: its id, read as ``NNN-name``, is all there is)."""
    _, _, name = job_dir.name.partition("-")
    fields: dict[str, Any] = {}
    try:
        loaded = json.loads((job_dir / "config.json").read_text())
        fields = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass

    def field(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = fields.get(key, default)
        return value if isinstance(value, kind) and not isinstance(value, bool) else default

    return JobInfo(job_id=job_dir.name, name=field("name", str, name),
                   model=field("model", str, "?"), kind=field("kind", str, "train"),
                   arrival_s=float(field("arrival_s", (int, float), 0.0)),
                   iterations=field("iterations", int, 0),
                   batch_size=field("batch_size", int, 0))


def _job_config(fields: Any) -> JobConfig:
    if not isinstance(fields, dict):
        raise UserError('"job" must be an object of JobConfig keys (model, iterations, ...)')
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), fields)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "job"
        keys = [f.name for f in dataclasses.fields(JobConfig)]
        if key not in keys:  # a mistyped key: the closest one, and every key
            raise UserError(f"bad job: unknown key '{key}'{did_you_mean(str(key), keys)} "
                            f"(JobConfig keys: {', '.join(keys)})") from None
        raise UserError(f"bad job: {key}: {first_line(exc)}") from None
    spec = OmegaConf.to_object(merged)
    assert isinstance(spec, JobConfig)
    if spec.name == "job":
        spec.name = f"{spec.model}"
    return spec


# -- the socket server ----------------------------------------------------------------------


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        service: Service = self.server.service  # type: ignore[attr-defined]
        try:
            line = self.rfile.readline(MAX_REQUEST + 1)
        except OSError:
            return  # the client went away: nothing to answer
        if not line:
            return
        try:
            if len(line) > MAX_REQUEST:
                raise UserError(f"request longer than {MAX_REQUEST} bytes")
            try:
                request = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"malformed request: not JSON ({exc})") from None
            if isinstance(request, dict):  # the close answers one left unanswered by its op
                self.server.ops[id(self.request)] = request.get("op")  # type: ignore[attr-defined]
            reply = {"ok": True, **service.handle(request)}
        except UserError as exc:
            reply = {"ok": False, "error": str(exc)}
        except Exception as exc:  # a bug or a user factory's error: answer, keep serving
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        self.server.answer(self.request, reply)  # type: ignore[attr-defined]


STOPPED_BEFORE_ANSWERING = ("the service stopped before answering (it was shutting down and "
                            "accepts no new jobs); submit to a new one")
"""The answer :meth:`_Server.close` gives a request still being handled when its grace
ended (a submit whose profiling outlasted it): the client read "closed the connection without
answering", not knowing whether its job was taken."""

STOPPED_WHILE_WAITING = ("the service stopped while this wait ran, before the job ended: it "
                         "was stopped now (a second signal, or an error), and a job it had "
                         "not ended is marked failed; its job.json says how it ended")
"""The answer :meth:`_Server.close` gives a ``wait`` still waiting: a service stopped now
leaves its unended jobs unended in the executor (failed only in their ``job.json``), and
such a wait read the submit's "submit to a new one"."""


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """One thread per connection, daemon (a client that never sends must not keep the
    process alive), each kept so that closing the server can wait for the answers being
    written: the reply to ``shutdown`` was lost when the process exited first."""

    daemon_threads = True
    request_queue_size = 128
    """The listen backlog (socketserver's default is 5): with more clients connecting at
    once than that, the others' connects failed with EAGAIN while the service was idle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handlers: list[tuple[threading.Thread, socket.socket]] = []
        self._answering = threading.Lock()
        self._answered: set[int] = set()
        """The connections (by ``id``) answered or being answered: each gets one answer."""
        self.ops: dict[int, Any] = {}
        """Each connection's (by ``id``) request ``op``, once read."""

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address), daemon=True)
        self.handlers = [(t, r) for t, r in self.handlers if t.is_alive()] + [(thread, request)]
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._answering:
            self._answered.discard(id(request))  # an id may be reused once it is closed
            self.ops.pop(id(request), None)
        super().shutdown_request(request)

    def answer(self, request: socket.socket, reply: dict[str, Any]) -> bool:
        """Write ``reply`` on ``request`` unless it was answered already (by :meth:`close`);
        whether this call wrote it."""
        with self._answering:
            if id(request) in self._answered:
                return False
            self._answered.add(id(request))
        with contextlib.suppress(OSError):  # the client was killed before reading its answer
            request.sendall((json.dumps(reply, default=str) + "\n").encode())
        return True

    def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting, give the requests being answered up to ``grace_s`` to finish,
        answer the ones still running with :data:`STOPPED_BEFORE_ANSWERING` (a ``wait``:
        :data:`STOPPED_WHILE_WAITING`), close the socket."""
        self.shutdown()
        deadline = time.monotonic() + grace_s
        for thread, _ in list(self.handlers):
            thread.join(max(0.0, deadline - time.monotonic()))
        for thread, request in list(self.handlers):
            if thread.is_alive():
                error = (STOPPED_WHILE_WAITING if self.ops.get(id(request)) == "wait"
                         else STOPPED_BEFORE_ANSWERING)
                self.answer(request, {"ok": False, "error": error})
        self.server_close()


def _take_lock(lock: Path, busy: str) -> Any:
    """Hold ``lock`` for the server's lifetime; a second serve cannot take it and gets
    ``busy`` (with ``{pid}``, the holder's) in one line. The holder removes the file when
    it stops (:func:`_drop_lock`), so a lock taken on a file removed meanwhile is no lock:
    it is taken again on the file now at that path."""
    while True:
        handle = open(lock, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            pid = handle.read().strip() or "?"
            handle.close()
            raise UserError(busy.replace("{pid}", pid)) from None
        if _same_file(handle, lock):
            break
        handle.close()  # its holder removed it between our open and our lock
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _same_file(handle: Any, path: Path) -> bool:
    try:
        here, there = os.fstat(handle.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _drop_lock(handle: Any, lock: Path) -> None:
    """Remove the lock file, still holding it (a serve that opened it meanwhile finds it
    gone and takes the new one: :func:`_take_lock`), then release it."""
    try:
        if _same_file(handle, lock):
            lock.unlink()
    except OSError:
        pass  # a directory we cannot write: the file stays, harmless
    handle.close()


def _stale_socket(path: Path) -> bool:
    """Whether ``path`` is a socket left behind (True) or absent (False); anything else at
    that path is the user's, never removed: a one-line refusal."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not stat.S_ISSOCK(mode):
        kind = "directory" if stat.S_ISDIR(mode) else (
            "symbolic link" if stat.S_ISLNK(mode) else "file")
        raise UserError(f"{path} is a {kind}, not a socket, and is left as it is; give "
                        "--socket a path that is free (or a stopped service's socket)")
    return True


class _Stopper:
    """``accelopt serve``'s SIGINT and SIGTERM handler. The first signal stops accepting
    jobs (as a ``shutdown`` request) and says so in one line; the running jobs finish. The
    second stops now: every lane ends after its current iteration and the executor's run
    raises ``KeyboardInterrupt`` (SIGINT) or ``Terminated`` (SIGTERM), so the unended jobs
    are marked failed (:meth:`Service.fail_unended`) and the command exits 130 or 143.
    (Both only closed the executor, silently: a long job ran on, and only SIGKILL stopped
    the service, losing what the jobs had done.)"""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.signalled = False

    def __call__(self, signum: int, frame: Any) -> None:
        executor = self.service.executor
        if self.signalled:
            executor.close(stop_now=Terminated() if signum == signal.SIGTERM
                           else KeyboardInterrupt())
            return
        self.signalled = True
        executor.close()
        unended = sum(result.status not in ENDED for _, result, _ in executor.snapshot())
        _say(f"accelopt serve: stopping: waiting for {_jobs(unended)}; signal again to stop "
             "now\n")


def _jobs(count: int) -> str:
    return f"{count} job{'' if count == 1 else 's'}"


def _say(line: str) -> None:
    """``line`` on stderr, written at once: safe in a signal handler (a ``print`` there,
    interrupting another print to the same stream, raised RuntimeError)."""
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), line.encode())


def serve(options: ServeOptions, ready: Any = print) -> int:
    """Run the service until a shutdown request (or a first SIGTERM/SIGINT) and its jobs
    finish; a second signal stops it now, raising that signal's error (:class:`_Stopper`)."""
    path = options.socket
    check_socket_path(path)
    _stale_socket(path)  # a file of the user's there: refused before anything is made
    service = Service(options)  # every option checked, nothing written: a refusal leaves none
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_path = path.with_name(path.name + ".lock")
    lock = _take_lock(lock_path,
                      f"another accelopt serve (pid {{pid}}) is already running on {path}; stop "
                      f"it with `accelopt serve --stop --socket {path}` or pick another --socket")
    root_lock = None
    root_lock_path = options.root / "serve.lock"
    try:
        if _stale_socket(path):
            path.unlink()  # its server is gone (we hold the lock)
        (options.root / "jobs").mkdir(parents=True, exist_ok=True)  # checked by Service
        # job numbers are per root: two services on other sockets numbering into one root
        # from the same last number, the second wrote over the first's jobs
        root_lock = _take_lock(root_lock_path,
                               f"another accelopt serve (pid {{pid}}) writes its jobs into --root "
                               f"{options.root}; give this one another --root")
        service.recover()  # a previous service's unended jobs: failed, listed by status
        old_umask = os.umask(0o177)
        try:
            server = _Server(str(path), _Handler)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        server.service = service  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, name="salus-socket", daemon=True).start()

        stop = _Stopper(service)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        ready(f"accelopt serve: listening on {path} (pid {os.getpid()}, policy "
              f"{service.plugin.policy.name}, {service.plugin.lanes_note()}); job outputs "
              f"in {options.root}/jobs/")
        try:
            try:
                service.executor.run()
            except BaseException as exc:  # a policy's or plugin's error, an interrupt
                failed = service.fail_unended(exc)
                if isinstance(exc, KeyboardInterrupt) and failed:
                    _say(f"accelopt serve: stopped now; {_jobs(len(failed))} marked failed "
                         f"in {options.root}/jobs/\n")
                raise
            service.finish_outputs()
        finally:
            server.close()
            with contextlib.suppress(UserError, OSError):
                if _stale_socket(path):  # ours (a socket: nothing else is removed)
                    path.unlink()
        return 0
    finally:
        if root_lock is not None:
            _drop_lock(root_lock, root_lock_path)
        _drop_lock(lock, lock_path)


# -- the client -----------------------------------------------------------------------------


BUSY_RETRY_S = 5.0
"""How long :func:`request` retries a connect the service's full backlog refused."""


SUBMIT_TIMEOUT_S = 600.0
"""How long ``accelopt submit`` waits for its answer: the service profiles the jobs in the
request's thread before it answers, which under load outlasted the 30 s other requests get."""


def request(path: Path, message: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request, return the reply; a one-line UserError if no service answers."""
    sock = _connect(path, timeout_s)
    try:
        with sock:
            sock.sendall((json.dumps(message) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        if message.get("op") == "submit":  # sent: the service may have taken it meanwhile
            raise UserError(_unanswered_submit(path, f"did not answer within {timeout_s:g} s")
                            ) from None
        raise UserError(f"the service on {path} did not answer within {timeout_s:g} s") from None
    except ConnectionError as exc:
        raise UserError(f"the service on {path} dropped the connection ({exc.strerror or exc})"
                        "; it may have stopped (see its output)") from None
    if not data:
        raise UserError(f"the service on {path} closed the connection without answering")
    return json.loads(data)


def _unanswered_submit(path: Path, what: str) -> str:
    """The line for a submit sent and never answered: its jobs may still have been taken (the
    service goes on profiling and takes them after the client stopped waiting), so a plain
    "did not answer" read as a failure, and the submit made again ran the job twice."""
    return (f"the service on {path} {what}; the submit may still have been taken (the "
            "service goes on with it): check `accelopt status` for the job before submitting "
            "it again")


def _connect(path: Path, timeout_s: float) -> socket.socket:
    """A connection to the service. A connect its full backlog refuses (EAGAIN: a socket
    with a timeout does not wait for room, and the raw ``BlockingIOError`` reached the
    caller) is tried again for up to :data:`BUSY_RETRY_S` (at most ``timeout_s``), then said
    in one line."""
    check_socket_path(path)
    deadline = time.monotonic() + min(timeout_s, BUSY_RETRY_S)
    pause = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise UserError(f"no accelopt serve is running on {path}; start one with "
                            "`accelopt serve` (or pass --socket)") from None
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise UserError(f"the service on {path} is busy: it took no new connection "
                                f"for {min(timeout_s, BUSY_RETRY_S):g} s; try again") from None
        except TimeoutError:
            sock.close()
            raise UserError(f"the service on {path} did not answer within {timeout_s:g} "
                            "s") from None
        except BaseException:
            sock.close()
            raise
        time.sleep(pause)  # the backlog drains as the service accepts
        pause = min(2 * pause, 0.1)


def _numbered(jobs: Path) -> list[Path]:
    """The ``NNN-name`` entries under ``jobs`` (job directories, a number taken)."""
    if not jobs.is_dir():
        return []
    return [p for p in jobs.glob("*-*") if p.name.partition("-")[0].isdigit()]


def _job_dirs(jobs: Path) -> list[Path]:
    """The ``NNN-name`` job directories under ``jobs``."""
    return [p for p in _numbered(jobs) if p.is_dir()]


def _last_job_number(jobs: Path) -> int:
    """The largest ``NNN`` of the ``NNN-name`` job directories under ``jobs`` (0: none)."""
    return max((int(p.name.partition("-")[0]) for p in _numbered(jobs)), default=0)


def _ended_state(result: JobResult) -> str:
    """A job's status as the service reports it, in ``status`` and in its ``job.json``:
    ``cancelled`` for a job a user cancelled (the executor records it as failed)."""
    if result.status == "failed" and CANCELLED in result.error:
        return "cancelled"
    return result.status
