"""How the processes of a cluster run start, importable without torch (the CLI uses it
before it has imported anything heavy).

Ranks fork from a forkserver that has imported torch and the runtime once, so no rank
repeats those imports; where the platform has no forkserver, they are spawned. Under
``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) this process is one rank and
nothing is started.
"""

from __future__ import annotations

import ast
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for every rank and its ``env://`` rendezvous reads: with all of them
set this process is one rank of a launch (:func:`under_torchrun`)."""
TORCHRUN_INTEGERS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
"""What torchrun sets too and a rank reads as a number, where it is set (other launchers
that start the ranks themselves may leave it out)."""
PRELOAD = ["accelopt.drivers.rank_preload"]
"""What the forkserver imports before it forks the first rank: torch and the runtime, with
the garbage collector paused, then frozen (``drivers/rank_preload.py`` says why)."""
PRELOAD_DDP = ["accelopt.drivers.rank_preload_ddp"]
"""The same and dynamo, for ranks that wrap their models in ``DistributedDataParallel``
(all-reduce mode), whose constructor imports it: once in the forkserver, not in each rank."""
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


def quiet_cpp_warnings() -> None:
    """Torch's C++ log level ERROR in the ranks, unless the user chose one. Why: when a rank
    dies (a plugin raising on a server while the workers still set up their gloo groups),
    each peer's store client logs its broken socket as a warning with ~40 C++ stack frames,
    ~50 lines before the launcher's one line naming the rank that failed and why. Torch reads
    the level when it is imported, so the forkserver's preload calls this before torch, and
    a torchrun rank (its own top-level process) in :func:`rank_server_started_early`."""
    os.environ.setdefault(CPP_LOG_LEVEL, "ERROR")


SCRATCH_PREFIX = "accelopt-rank"
"""Under torchrun, a rank other than 0 whose command names no ``hydra.run.dir`` runs in a
temporary directory with this prefix (``cli/run_dirs.py``), removed when it ends."""


def under_torchrun(env: dict[str, str] | None = None) -> bool:
    """Whether this process is one rank of a torchrun launch (:data:`TORCHRUN_VARS` all
    set). A launch that is declared (WORLD_SIZE set, or RANK with MASTER_ADDR or MASTER_PORT)
    but incomplete, or whose numbers cannot be a rank of that world, is refused in one line
    (:class:`~accelopt.errors.UserError`): taken for a local run, ``RANK=1 WORLD_SIZE=3``
    without a MASTER_ADDR started a whole local cluster on every machine and exited 0; and
    ``RANK=abc`` ended in a traceback, ``RANK=5 WORLD_SIZE=3`` in a rendezvous that waited
    its whole timeout. A variable alone that is no launch is left alone (a local run): a
    RANK that some schedulers export for their own use, or a MASTER_ADDR and MASTER_PORT a
    job script exports for the ranks it starts later."""
    env = dict(os.environ) if env is None else env
    present = [v for v in TORCHRUN_VARS if env.get(v)]
    if not _declares_launch(present):
        return False
    missing = [v for v in TORCHRUN_VARS if v not in present]
    if missing:
        from accelopt.errors import UserError

        raise UserError(
            f"{_listed([f'{v}={env[v]}' for v in present])} "
            f"declare{'s' if len(present) == 1 else ''} a torchrun launch but "
            f"{_listed(missing)} {'is' if len(missing) == 1 else 'are'} not set; start the "
            "ranks with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), "
            f"set the missing ones, or unset {_listed(present)} for a local run")
    torchrun_rank(env)
    return True


def _listed(words: list[str]) -> str:
    """``a, b and c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _declares_launch(present: list[str]) -> bool:
    """Whether the torchrun variables set declare a launch: a world size, or a rank with
    where to meet the others."""
    return "WORLD_SIZE" in present or ("RANK" in present and len(present) > 1)


def torchrun_rank(env: dict[str, str] | None = None) -> tuple[int, int]:
    """This torchrun rank's (RANK, WORLD_SIZE), read as numbers; refused in one line
    (:class:`~accelopt.errors.UserError`) unless they are integers with
    0 <= RANK < WORLD_SIZE, MASTER_PORT is a port, and LOCAL_RANK and LOCAL_WORLD_SIZE,
    where set, are integers with 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE."""
    env = dict(os.environ) if env is None else env
    values = {v: _integer(env, v) for v in ("RANK", "WORLD_SIZE", "MASTER_PORT",
                                            *TORCHRUN_INTEGERS) if env.get(v)}
    problem = _rank_problem(values)
    if problem:
        from accelopt.errors import UserError

        raise UserError(problem)
    return values["RANK"], values["WORLD_SIZE"]


def _rank_problem(values: dict[str, int]) -> str:
    """What is wrong with a torchrun rank's numbers, and the fix ("": nothing)."""
    rank, world, port = values["RANK"], values["WORLD_SIZE"], values["MASTER_PORT"]
    local_rank = values.get("LOCAL_RANK", 0)
    local_world = values.get("LOCAL_WORLD_SIZE", world)
    same = "give every rank the same WORLD_SIZE and its own RANK below it"
    if world < 1:
        return f"WORLD_SIZE={world} must be at least 1; {same}"
    if not 0 <= rank < world:
        return f"RANK={rank} must be in 0..{world - 1} (WORLD_SIZE={world}); {same}"
    if not 0 < port < 65536:
        return f"MASTER_PORT={port} is not a port (1..65535); give every rank the same port"
    if not 0 < local_world <= world:
        return (f"LOCAL_WORLD_SIZE={local_world} must be in 1..{world} (WORLD_SIZE={world}): "
                "the ranks on this machine")
    if not 0 <= local_rank < local_world:
        return (f"LOCAL_RANK={local_rank} must be in 0..{local_world - 1} "
                f"(LOCAL_WORLD_SIZE={local_world}): this rank's number on its machine")
    return ""


def _integer(env: dict[str, str], name: str) -> int:
    """``env[name]`` as an integer, refused in one line (a torchrun variable) otherwise."""
    try:
        return int(env[name].strip())
    except ValueError:
        from accelopt.errors import UserError

        raise UserError(f"{name}={env[name]!r} is not an integer; start the ranks with "
                        f"torchrun (it sets {name}), or give it a number") from None


def preloads_dynamo(modes: Iterable[str]) -> bool:
    """Whether the ranks' forkserver imports dynamo too (:data:`PRELOAD_DDP`): with
    ``allreduce`` among the cluster modes. That preload takes ~1.1 s longer, so the launcher
    reaches the point where it forks the first rank well before the forkserver is ready and
    can do work of its own meanwhile at no cost to the run."""
    return "allreduce" in modes


def rank_context(modes: Iterable[str] = ("ps",)) -> Any:
    """The multiprocessing context ranks start from: the preloading forkserver, else spawn.
    ``modes``: the cluster modes of the runs it will start; with ``allreduce`` among them
    the ranks use ``DistributedDataParallel`` (:data:`PRELOAD_DDP`). They decide the preload
    of a forkserver this call starts, not of one already running. The forkserver is
    stopped with the run that started it (``launch.own_mp_helpers``) or with the invocation
    that started it early (:func:`rank_server_started_early`)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD_DDP if preloads_dynamo(modes) else PRELOAD)
    return ctx


class EarlyServer:
    """The forkserver :func:`rank_server_started_early` started (or nothing, when it started
    none): :meth:`stop` it once it turns out not to be needed."""

    def __init__(self, server: Any = None) -> None:
        self._server = server

    @property
    def running(self) -> bool:
        return self._server is not None

    def stop(self) -> None:
        """Stop the server now (idempotent): the invocation turned out to start no cluster
        run, and a local run should have both cores to itself."""
        if self._server is not None:
            stop_forkserver(self._server)
            self._server = None


@contextlib.contextmanager
def rank_server_started_early(modes: Iterable[str]) -> Iterator[EarlyServer]:
    """Start the forkserver now, while the caller still composes the config and imports the
    runtime: its own imports (torch, the runtime: ~2 s on 2 cores) run on the other core
    meanwhile, and every cluster run of the invocation (comparison runs too) forks its
    ranks from it. Stopped on leaving (or by the handle's ``stop``), so the invocation
    leaves no process behind. ``modes``: the cluster modes of the invocation's runs (as for
    :func:`rank_context`); none but ``none``, under torchrun, or no forkserver: nothing
    happens. Under torchrun it sets the ranks' C++ log level as the forkserver's preload
    does (:func:`quiet_cpp_warnings`): ``accelopt run`` calls this before torch is
    imported, and a rank that cannot reach its peers printed ~40 lines of C++ stack frames
    of its store client's warnings before its one line."""
    torchrun = under_torchrun()  # the first look: a launch that is wrong is refused here
    if torchrun:
        quiet_cpp_warnings()  # torch is not imported yet (the command's first step)
    modes = set(modes) - {"none"}
    if not modes or torchrun or "forkserver" not in multiprocessing.get_all_start_methods():
        yield EarlyServer()
        return
    from multiprocessing import forkserver

    rank_context(modes)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    started = getattr(server, "_forkserver_pid", None) is None
    if started:
        forkserver.ensure_running()
    handle = EarlyServer(server if started else None)
    try:
        yield handle
    finally:
        handle.stop()


def refuse_unguarded_main(caller: str = "accelopt.run") -> None:
    """Refuse, in one line and before any process starts, a cluster run started from the top
    level of a script. Rank processes import the script that started the run again (as
    multiprocessing does, so that what it defines, e.g. a plugin class, exists in them), and
    a call outside ``if __name__ == "__main__":`` would start the run again in each of them,
    which fails there with pages of multiprocessing's traceback and leaves the launcher with
    only "rank 0 exited before its first iteration". Nothing to check for an interactive
    session, ``python -c`` or a notebook (no script is imported again). ``caller``: the
    function the user called, named in the message."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if name == "__main__" or name.endswith(".__main__"):
        return  # `python -m package`: multiprocessing does not import a package's __main__
    if not os.path.isfile(path):  # `python - <<EOF`: multiprocessing re-runs '<stdin>' by path
        from accelopt.errors import UserError

        raise UserError(
            f"{caller} with a cluster mode from a script read from {path}: the ranks of a "
            "cluster run re-run the script that started it by its path, which this one has "
            "not; save it as a file, with the call under `if __name__ == \"__main__\":`")
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    if _under_main_guard(tree.body, line) is False:
        from accelopt.errors import UserError

        raise UserError(
            f"{caller} is called at the top level of {path} (line {line}): the ranks of a "
            "cluster run import that script again, so each would start the run again; put "
            "the call under `if __name__ == \"__main__\":`")


def not_found_in_ranks(obj: object) -> str:
    """Why ``obj``, a class or function that pickle sends to a rank by its module and name,
    is not found there by them, as a clause naming the fix; '' where it is (or is not
    ``__main__``'s). A rank's ``__main__`` is the script imported again (``__mp_main__``),
    so a class defined in an interactive session (``python -c``, ``python -i``, a notebook),
    in a package's ``__main__.py`` (``python -m``, not imported again) or under the script's
    ``if __name__ == "__main__":`` (imported, not run) pickles, then fails in every rank with
    "Can't get attribute", and the launcher saw only ranks that exited before their first
    iteration."""
    if getattr(obj, "__module__", None) != "__main__":
        return ""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    elsewhere = "; define it in a module file and import it"
    if main is None or not path:
        return ("is defined in an interactive session (python -c, python -i, a notebook), "
                f"which they cannot import{elsewhere}")
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if name == "__main__" or name.endswith(".__main__"):
        return f"is defined in {path}, run by `python -m`, which they do not import{elsewhere}"
    if not os.path.isfile(path):
        return f"is defined in a script read from {path}, which they cannot import{elsewhere}"
    import inspect

    try:
        lines, first = inspect.findsource(obj)  # type: ignore[arg-type]
        tree = ast.parse("".join(lines))
    except (OSError, TypeError, SyntaxError, ValueError):
        return ""  # no source to tell by: the rank's own error will say it
    if _under_main_guard(tree.body, first + 1):
        return (f"is defined under `if __name__ == \"__main__\":` in {path} (line "
                f"{first + 1}), which they do not run; define it at module level of the script "
                "(above the guard), or in a module file that it imports")
    return ""


def _under_main_guard(body: list[ast.stmt], line: int) -> bool | None:
    """Whether the statement holding ``line`` lies inside ``if __name__ == "__main__":``,
    however deep (in a ``try:``, a ``with``, a function called at the top level...);
    ``None`` when no statement of ``body`` holds it."""
    for node in body:
        if not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if _is_main_guard(node):
            return True
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                statements = [s for item in inner
                              for s in (item.body if hasattr(item, "body")
                                        and not isinstance(item, ast.stmt) else [item])]
                if _under_main_guard(statements, line):
                    return True
        return False
    return None


def _is_main_guard(node: object) -> bool:
    """``if __name__ == "__main__":`` (either side of the comparison)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, *test.comparators]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    texts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(texts) == 1


def release_before_exit() -> None:
    """What a normal interpreter exit would release and ``os._exit`` skips: multiprocessing's
    exit finalizers, which unlink the named semaphores libraries made in this process (tqdm's
    write lock, made by ``torch.fx.Interpreter`` when tictac measures a model) so that the
    resource tracker does not report them as leaked after the run; and the finalizer that
    removes the ``pymp-*`` temporary directory this process made (the forkserver's socket
    lives there: one directory per run was left in /tmp). That one has a negative priority,
    among those a normal exit runs last, after joining queue feeder threads, which could wait
    here for a reader that is gone; so it alone of those is run. Call it just before
    ``os._exit``; it never raises."""
    from multiprocessing import util

    with contextlib.suppress(Exception):
        util._run_finalizers(0)  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        # its own finalizer: a no-op in a forked child (a rank), which inherits the parent's
        # directory, where the forkserver the parent still uses has its socket
        for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]
            if getattr(finalizer, "_callback", None) is util._remove_temp_dir:  # type: ignore[attr-defined]
                finalizer()


def stop_forkserver(server: Any) -> None:
    """Stop multiprocessing's forkserver ``server`` if it runs, without waiting for it to
    shut down: it holds nothing but the imports it preloaded, and a normal exit tears torch
    down module by module (1.3 s of the default run's wall time). Killed, then reaped."""
    import signal

    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        server._stop()
