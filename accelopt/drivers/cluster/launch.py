"""Starting the processes of a cluster run and collecting what they measured.

Locally, :func:`run_cluster` starts one process per rank (``drivers/processes.py``:
forked from a forkserver that has imported the runtime once, else spawned),
optionally inside a shaped network namespace, watches them and returns a
:class:`ClusterOutcome`. Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
this process *is* one rank: nothing is spawned, and rank 0's outcome carries every rank's data.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

from accelopt.collector import collector_paused
from accelopt.drivers.cluster import faults, netns
from accelopt.drivers.cluster.carried import Carried
from accelopt.drivers.cluster.outcome import ClusterOutcome, build_outcome
from accelopt.drivers.cluster.rank import (
    RankResult,
    SoFar,
    pick_backend,
    read_so_far,
    result_path,
    run_rank,
    so_far_path,
)
from accelopt.drivers.cluster.rendezvous import TORCHRUN, NeverJoined, refuse_at_rendezvous
from accelopt.drivers.cluster.settings import (
    NUMBERS,
    ClusterSettings,
    cluster_number,
    settings_from,
)
from accelopt.drivers.processes import (
    SCRATCH_PREFIX,
    rank_context,
    release_before_exit,
    stop_forkserver,
    torchrun_rank,
    under_torchrun,
)
from accelopt.errors import ConfigError, Terminated, UserError, first_line, raise_terminated
from accelopt.job import job_specs
from accelopt.job.specs import check_datasets
from accelopt.plugin import Registry, one_line_for_plugins


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def validate(cfg: DictConfig, settings: ClusterSettings) -> None:
    """Every job must be able to run data-parallel (several jobs share the processes in
    either mode, one iteration at a time)."""
    specs = job_specs(cfg)
    for spec in specs:
        if spec.kind != "train":
            raise ConfigError(
                f"job '{spec.name}': cluster runs train; set kind: train or cluster.mode=none"
            )
        if spec.batch_size < settings.workers:
            raise ConfigError(
                f"job '{spec.name}': batch_size {spec.batch_size} is smaller than "
                f"cluster.workers={settings.workers}; every worker needs at least one sample"
            )


def refuse_start_while_starting_a_rank() -> None:
    """A rank process imports the script that started the run again (multiprocessing's
    spawn and forkserver), and a script calling accelopt at its top level starts a cluster
    run again there: multiprocessing's error is a screen of text per rank, and the run's
    line only said that rank 0 exited before its first iteration."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise UserError("a cluster run was started while a rank process was being started: "
                        "each rank imports the script that started the run, and this one "
                        "starts a run when imported; put that call under "
                        "`if __name__ == \"__main__\":`")


def run_cluster(cfg: DictConfig, *, run_dir: str | os.PathLike[str] = ".",
                console: Any = None, registry: Registry | None = None,
                while_ranks_start: Callable[[], None] | None = None,
                when_jobs_end: Callable[[], None] | None = None) -> ClusterOutcome:
    """Run the workload's jobs data-parallel as ``cfg.cluster`` says (several jobs share the
    processes, one iteration at a time: ``drivers/cluster/driver.py``). ``registry``: the
    parent's plugins; those added to it in code are sent to the ranks (``carried.py``).
    ``while_ranks_start``: work of this process for after the run (e.g. imports) to do just
    before the ranks are forked, while the forkserver may still be importing the runtime.
    ``when_jobs_end``: called on another thread of this process as soon as the leader has
    run the last iteration, while the ranks still hand over their results (not at all if
    the run fails first, nor under torchrun); it must be quick and must not raise."""
    refuse_start_while_starting_a_rank()
    if under_torchrun():
        return _run_torchrun(cfg, str(run_dir), registry)
    settings, backend_note, carried = _launch_checks(cfg, registry)  # before a rank starts
    check_datasets(job_specs(cfg))  # what only the data tells, before a rank starts
    t0 = time.time()
    if settings.shaped:
        netns.check_possible()
    if console is not None:
        console.print(_banner(settings))
        if backend_note:
            console.print(backend_note)
    with tempfile.TemporaryDirectory(prefix="accelopt-cluster-") as work, own_mp_helpers():
        if while_ranks_start is not None:
            while_ranks_start()
        try:
            ranks = _spawn(cfg, settings, t0, work, str(run_dir), carried, when_jobs_end)
        except BaseException as exc:  # a rank failed, Ctrl-C, SIGTERM: how far the jobs got
            exc.ended = faults.read_ended(work)  # type: ignore[attr-defined]
            exc.reached = faults.reached(work, exc)  # type: ignore[attr-defined]
            exc.so_far = read_so_far(work)  # type: ignore[attr-defined]
            exc.never_started = never_started(  # type: ignore[attr-defined]
                exc, work, settings.world_size)
            raise
    with collector_paused():
        return build_outcome(ranks, settings)


def never_started(exc: BaseException, work: str, world: int) -> bool:
    """Whether a cluster run that failed with ``exc`` was refused rather than stopped: bad
    input (a :class:`UserError`, e.g. a job's model factory raising as the ranks build their
    jobs) found before any rank ran an iteration, and every rank's own failure bad input too
    (or a peer's consequence). Such a run is treated as a one-process run refused before it
    started: exit 2, one line, and nothing of its outputs kept, so the same directory takes
    the fixed command (kept, its evidence refused the rerun as "already holds a run")."""
    if not isinstance(exc, UserError) or getattr(exc, "iteration", None) is not None:
        return False
    if faults.read_ended(work) or any(faults.Progress.read(work, rank) is not None
                                      for rank in range(world)):
        return False  # an iteration ran: the run started, its evidence is kept
    for note in Path(work).glob("failure-*.json"):
        try:
            said = json.loads(note.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not (said.get("user_error") or said.get("communication")):
            return False
    return True


@contextlib.contextmanager
def own_mp_helpers() -> Iterator[None]:
    """Starting rank processes also starts multiprocessing's helpers (the resource tracker,
    the forkserver); those this run started are stopped afterwards, so the run leaves no
    process behind."""
    from multiprocessing import forkserver, resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    was_running = tracker is None or getattr(tracker, "_pid", None) is not None
    server = getattr(forkserver, "_forkserver", None)
    server_was_running = server is None or getattr(server, "_forkserver_pid", None) is not None
    try:
        yield
    finally:
        if not server_was_running:
            stop_forkserver(server)
        if not was_running and getattr(tracker, "_pid", None) is not None:
            with contextlib.suppress(Exception):
                tracker._stop()  # type: ignore[union-attr]


def _banner(s: ClusterSettings) -> str:
    def n(count: int, what: str) -> str:
        return f"{count} {what}" + ("s" if count != 1 else "")

    who = n(s.workers, "worker") + (" + " + n(s.servers, "server") if s.mode == "ps" else "")
    def rate(bps: int | None) -> str:
        return f"{bps / 1e6:g} Mbit/s" if bps else "unlimited"

    lat = f", {s.latency_s * 1e3:g} ms" if s.latency_s else ""
    if s.network == "shared":
        return f"cluster: {s.mode} mode, {who}, shaped loopback {rate(s.bandwidth_bps)}{lat}"
    if s.network == "hosts":
        odd = "".join(f", {s.link_name(r)} {rate(bps)}" for r, bps in s.link_bandwidth_bps)
        return (f"cluster: {s.mode} mode, {who}, a host per rank, links "
                f"{rate(s.bandwidth_bps)}{lat}{odd}")
    return f"cluster: {s.mode} mode, {who}"


def _spawn(cfg: DictConfig, settings: ClusterSettings, t0: float, work: str,
           run_dir: str, carried: Carried,
           when_jobs_end: Callable[[], None] | None = None) -> list[RankResult]:
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    with _terminate_on_sigterm(), netns.network(settings.network, settings.links()) as ends:
        port = settings.master_port or (free_port() if settings.network != "hosts" else 29500)
        ctx = rank_context({settings.mode})
        store_ready = ctx.Event()  # rank 0's rendezvous store listens (rendezvous.py)
        jobs_ended = ctx.Event()  # the leader ran the last iteration
        # closing `stop` (the writing end) tells the ranks still running that the run stops,
        # so they leave their timelines so far; a pipe, not an Event: a rank that died
        # waiting on an Event would block every later set() (its sleeper never wakes)
        stop_read, stop = ctx.Pipe(duplex=False)
        children = []
        watchdog = faults.Watchdog(children, work)
        waiter = _WhenSet(jobs_ended, when_jobs_end) if when_jobs_end is not None else None
        try:
            for rank in range(settings.world_size):
                proc = ctx.Process(
                    target=child_main,
                    args=(rank, settings.world_size, cfg_yaml, port, t0, work, ends[rank],
                          ends[0].address, run_dir, carried, dict(os.environ), store_ready,
                          jobs_ended, os.getpid(), stop_read),
                    name=f"accelopt-rank{rank}",
                )
                proc.start()
                children.append(faults.Child(rank, settings.role(rank), proc))
            watchdog.wait()
        except BaseException:
            stop.close()
            _await_so_far(children, work)
            raise
        finally:
            stop.close()
            stop_read.close()
            watchdog.kill_all()
            if waiter is not None:
                waiter.stop()
            # A failed run's traceback keeps this frame, and with it the events'
            # semaphores, alive past own_mp_helpers, which stops the resource tracker it
            # started: the tracker would unlink them as leaked and their finalizers fail
            # at exit with a traceback each. Release them here, where the ranks are gone.
            children.clear()
            waiter = store_ready = jobs_ended = None
    results = []
    with collector_paused():
        for rank in range(settings.world_size):
            path = result_path(work, rank)
            if not path.exists():
                raise faults.RankFailed(f"rank {rank} exited without reporting results",
                                        rank=rank, pid=None, iteration=None,
                                        cause="no results")
            with open(path, "rb") as fh:
                results.append(pickle.load(fh))
    return results


SO_FAR_WAIT_S = 2.0
"""How long a stopped run waits for a live rank to start writing its timeline so far before
it kills it (a rank stopped or stuck writes nothing)."""
SO_FAR_WRITE_S = 20.0
"""How long it waits for a rank that has started writing (its temporary file is there): on
two loaded cores pickling a few thousand iterations took longer than 2 s, and the kill cut
every rank's timeline off (trace.json empty, the losses gone)."""


def _await_so_far(children: list[faults.Child], work: str) -> None:
    """Until every rank still running has written its timeline so far (or exited, or the
    deadlines passed): its writer thread does it while the rank's main thread may be
    blocked in a collective whose peer is gone."""
    start = time.monotonic()
    for c in children:
        final = so_far_path(work, c.rank)
        while c.process.exitcode is None and not final.exists():
            waited = time.monotonic() - start
            writing = any(final.parent.glob(f".{final.name}.*.tmp"))
            if waited >= (SO_FAR_WRITE_S if writing else SO_FAR_WAIT_S):
                break
            time.sleep(0.02)  # polling a file another process writes


class _OnStop(threading.Thread):
    """Calls ``callback`` once the launcher closes the other end of ``stop`` (a rank whose
    run stopped; its main thread may be blocked in a collective, this thread is not)."""

    def __init__(self, stop: Any, callback: Callable[[], None]) -> None:
        super().__init__(name="accelopt-on-stop", daemon=True)
        self._stop_end = stop
        self._callback = callback
        self.start()

    def run(self) -> None:
        try:
            self._stop_end.recv_bytes()
        except (EOFError, OSError):
            pass
        self._callback()


class _WhenSet(threading.Thread):
    """Calls ``callback`` once ``event`` is set, unless :meth:`stop` comes before it is."""

    def __init__(self, event: Any, callback: Callable[[], None]) -> None:
        super().__init__(name="accelopt-when-jobs-end", daemon=True)
        self._event = event
        self._callback = callback
        self._stopped = False
        self.start()

    def run(self) -> None:
        self._event.wait()
        if not self._stopped:
            self._callback()

    def stop(self) -> None:
        """Once no process can set the event any more (the ranks are gone): wait for the
        call if the event was set, else release the thread without one."""
        if not self._event.is_set():
            self._stopped = True
            self._event.set()
        self.join()


@contextlib.contextmanager
def _terminate_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into :class:`~accelopt.errors.Terminated` while children run, so cleanup
    (kill the ranks, delete the namespace) happens and the run keeps its evidence, as on
    Ctrl-C; only possible from the main thread (a run called from Python, where the command's
    own handler is not installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore_sigterm() -> None:
    """A torchrun rank that knows why the run failed ignores the SIGTERM torchrun sends
    when a peer exits: it would replace the rank's one line (and rank 0's evidence) with
    "terminated (SIGTERM)" while the rank is saying why. The rank exits on its own right
    after (torchrun SIGKILLs it if it does not)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def join_local_rank(rank: int, world: int, port: int,
                    endpoint: netns.Endpoint = netns.LOOPBACK,
                    master_addr: str = "127.0.0.1") -> str:
    """In a spawned local rank: enter its namespace (if any) and set the environment
    torch.distributed reads (gloo pinned to the rank's interface). Returns the rendezvous
    address (``tcp://master:port``)."""
    if endpoint.namespace is not None:
        netns.enter(endpoint.namespace)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME=endpoint.interface)
    return f"tcp://{master_addr}:{port}"


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""A rank's log lines look like the launcher's (Hydra's default job logging format)."""


def _log_where_the_launcher_does(run_dir: str) -> None:
    """A spawned rank's warnings (a blocking hook named by the watchdog, a transport's
    warning) go to its stderr, as the launcher's do, and into the run's ``accelopt.log``,
    appended line by line beside the other ranks' (without this they reached only the
    terminal: Python's last-resort handler, and no log kept them)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if Path(run_dir).is_dir():
        handlers.append(logging.FileHandler(Path(run_dir) / "accelopt.log", mode="a",
                                            encoding="utf-8", delay=True))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger("accelopt").addHandler(handler)


def _adopt_environment(environ: dict[str, str]) -> None:
    """A forked rank has the forkserver's environment, from when it started: take the
    launcher's as it is now (plugins named in ACCELOPT_PLUGINS, PYTHONPATH entries)."""
    import sys

    os.environ.clear()
    os.environ.update(environ)
    for entry in reversed(environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)


def child_main(rank: int, world: int, cfg_yaml: str, port: int, t0: float, work: str,
               endpoint: netns.Endpoint, master_addr: str, run_dir: str,
               carried: Carried | None = None, environ: dict[str, str] | None = None,
               store_ready: Any | None = None, jobs_ended: Any | None = None,
               launcher_pid: int | None = None, stop: Any | None = None) -> None:
    """Entry point of a rank process (module-level so the start method can import it).
    ``stop``: the reading end of a pipe the launcher closes when the run stops before this
    rank reports; the rank then leaves its timeline so far
    (:class:`~accelopt.drivers.cluster.rank.SoFar`)."""
    faults.die_with_parent()
    if launcher_pid is not None:
        faults.die_with_launcher(launcher_pid)
    if environ is not None:
        _adopt_environment(environ)
    settings = None
    progress = None
    so_far = SoFar()
    if stop is not None:
        left = threading.Event()  # set once this rank's timeline so far is written
        _OnStop(stop, lambda: (so_far.write(work, rank), left.set()))
        faults.sigterm_after(left)
    try:
        init_method = join_local_rank(rank, world, port, endpoint, master_addr)
        cfg = OmegaConf.create(cfg_yaml)
        settings = settings_from(cfg.cluster)
        _log_where_the_launcher_does(run_dir)
        # a plugin's warning here reads as the command's do: one line, not accelopt's source
        warnings.formatwarning = one_line_for_plugins(warnings.formatwarning)
        progress = faults.Progress(work, rank)
        run_rank(cfg, settings, rank=rank, world=world, t0_epoch=t0,
                 init_method=init_method, run_dir=run_dir, progress=progress,
                 carried=carried, results_dir=work, store_ready=store_ready,
                 jobs_ended=jobs_ended, so_far=so_far)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then exit 1
        role = settings.role(rank) if settings is not None else "?"
        at = progress.at if progress is not None else faults.At(None)
        try:
            so_far.write(work, rank)
            faults.write_failure(work, rank, role, at, exc)
        finally:
            release_before_exit()
            os._exit(1)
    release_before_exit()
    os._exit(0)  # skip interpreter teardown (gloo threads); results are on disk


def _torchrun_checks(cfg: DictConfig, run_dir: str, registry: Registry | None, rank: int,
                     world: int) -> tuple[ClusterSettings, Carried]:
    """What a torchrun rank checks before it joins the others (a local run's launcher checks
    the same before it starts a rank: :func:`_launch_checks`, and more), and the plugins
    it carries."""
    settings, _, carried = _launch_checks(cfg, registry)
    if world != settings.world_size:
        raise ConfigError(
            f"torchrun started {world} processes but cluster.mode={settings.mode} with "
            f"workers={settings.workers}, servers={settings.servers} needs "
            f"{settings.world_size}; make --nnodes x --nproc-per-node match"
        )
    if settings.shaped:
        raise ConfigError(
            "cluster.network shaping is for local runs; under torchrun the real network is "
            "used, so drop cluster.network.bandwidth/latency/topology"
        )
    if rank != 0 and int(cfg.run.get("checkpoint_every", 0) or 0) and (
            Path(run_dir).name.startswith(SCRATCH_PREFIX)):
        raise ConfigError(
            "run.checkpoint_every under torchrun: every rank writes its part of each "
            "checkpoint into the run directory, so give every machine the same one "
            "(hydra.run.dir=runs/<name>)"
        )
    return settings, carried


def _launch_checks(cfg: DictConfig, registry: Registry | None
                   ) -> tuple[ClusterSettings, str, Carried]:
    """The cluster settings, checked; the backend's note (a backend that cannot run is
    refused); and the plugins the ranks carry. A local launcher and a torchrun rank alike."""
    from accelopt.activation import selected_plugins

    settings = settings_from(cfg.cluster)
    validate(cfg, settings)
    backend_note = pick_backend(settings, cfg).note
    return settings, backend_note, Carried.of(registry, selected_plugins(cfg))


def _timeout_s(cfg: DictConfig | None) -> float:
    """``cluster.timeout_s``, or its default where that cannot be read (the refusal a rank
    is about to give may be about it, or its config could not be composed: ``None``)."""
    try:
        return cluster_number(cfg.cluster, "timeout_s")  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - any unreadable value: the default
        return float(NUMBERS["timeout_s"][0])


@contextlib.contextmanager
def refusals_said_at_rendezvous(cfg: DictConfig | None) -> Iterator[None]:
    """Under torchrun, a :class:`~accelopt.errors.UserError` raised inside (the run's own
    checks before the cluster starts: an unknown plugin on one machine, a run directory in
    use) is left in the rendezvous store before it propagates, as the cluster's own checks
    are (:func:`_run_torchrun`): the other ranks stop at once with this rank's line instead
    of naming it as never joined after ``cluster.timeout_s``. Elsewhere: nothing. ``cfg``
    ``None``: the command line's config is being composed (a mistake in it is refused
    there), so the rank waits the default ``cluster.timeout_s`` for its peers to read it."""
    try:
        yield
    except UserError as exc:
        if under_torchrun():
            rank, world = torchrun_rank()
            refuse_at_rendezvous(first_line(exc), rank=rank, world=world,
                                 timeout=timedelta(seconds=_timeout_s(cfg)))
        raise


def _run_torchrun(cfg: DictConfig, run_dir: str, registry: Registry | None) -> ClusterOutcome:
    """This process as one rank of a torchrun launch. A config this rank refuses is said in
    the rendezvous store before the rank stops (``rendezvous.refuse_at_rendezvous``), so the
    other ranks stop at once with its line instead of waiting out their timeout."""
    rank, world = torchrun_rank()
    try:
        settings, carried = _torchrun_checks(cfg, run_dir, registry, rank, world)
    except UserError as exc:
        refuse_at_rendezvous(first_line(exc), rank=rank, world=world,
                             timeout=timedelta(seconds=_timeout_s(cfg)))
        raise
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="accelopt-cluster-") as work:
        progress = faults.Progress(work, rank)
        try:
            gathered = run_rank(cfg, settings, rank=rank, world=world, t0_epoch=t0,
                                init_method=TORCHRUN, run_dir=run_dir, carried=carried,
                                progress=progress)
        except KeyboardInterrupt as exc:
            # torchrun follows a Ctrl-C with SIGTERM to its ranks: ignored, so this rank's
            # outputs and line say "interrupted (Ctrl-C)" alike, not the later SIGTERM
            _ignore_sigterm()
            if not isinstance(exc, Terminated):
                _how_far(exc, progress, work)
                raise
            _raise_torchrun_failure(exc, rank, world, settings, progress, work)
        except Exception as exc:
            _ignore_sigterm()
            _raise_torchrun_failure(exc, rank, world, settings, progress, work)
    if rank != 0 or gathered is None:
        return ClusterOutcome(primary=False)
    return build_outcome(gathered, settings)


def _how_far(exc: BaseException, progress: faults.Progress, work: str) -> None:
    """Attach to a Ctrl-C how far this rank's jobs got, as a local launcher does
    (:func:`run_cluster`) and a SIGTERM's line does (:func:`_raise_torchrun_failure`): the
    jobs that had ended (rank 0's record) and the iteration reached. Without it the run's
    evidence failed every job at iteration 0, a job that had finished included."""
    iteration = progress.at.iteration
    exc.ended = faults.read_ended(work)  # type: ignore[attr-defined]
    exc.reached = (  # type: ignore[attr-defined]
        None if iteration is None or iteration == faults.JOBS_ENDED else iteration)


def _raise_torchrun_failure(exc: BaseException, rank: int, world: int,
                            settings: ClusterSettings,
                            progress: faults.Progress, work: str) -> NoReturn:
    """Raise the one line of a torchrun rank whose run stopped on ``exc``. No watchdog
    here: the rank's own one line (a peer's, where it left one); the ranks that never
    joined are already named (no peer's line to look for)."""
    failure = exc if isinstance(exc, NeverJoined) else faults.torchrun_failure(
        exc, rank=rank, world=world, role=settings.role(rank), at=progress.at)
    if isinstance(failure, faults.RankFailed):
        failure.ended = faults.read_ended(work)  # rank 0's: the jobs that had ended
    # bad input before any iteration (iterations are collective: none ran anywhere)
    failure.never_started = (  # type: ignore[attr-defined]
        isinstance(failure, UserError) and progress.at.iteration is None
        and getattr(failure, "iteration", None) is None
        and not getattr(failure, "ended", None))
    if failure is exc:
        raise exc
    raise failure from exc
