"""The benchmark scripts' command-line conventions, in one place.

* argparse types (:func:`positive_int`, :func:`nonnegative_int`, :func:`positive_float`,
  :func:`nonnegative_float`, :func:`size`, :func:`rate`, :func:`rate_or_none`): a bad value
  is argparse's one-line usage error, exit 2, before any work;
* :func:`refuse_existing` and :func:`add_force`: never overwrite a user's results; an
  existing output path is refused in one line (exit 2) unless ``--force`` is given, a path
  that cannot be written (under a file; a directory for a file) even with it;
  :func:`refuse_not_a_directory`: an output directory that is a file (or under one);
* :func:`run`: runs a script's ``main`` the way the ``accelopt`` command runs, SIGTERM
  turned into :class:`~accelopt.errors.Terminated`, accelopt's own errors printed as one
  line (``<script>: error: <message>``), exit 2 for bad input, the error's code otherwise,
  143 on SIGTERM, 130 on Ctrl-C, 141 without a traceback when its output's reader has gone
  (``script | head``);
* :func:`run_child` and :func:`stopping`: child processes that do not outlive the script
  (stopped, with their own children, when it stops on an error, Ctrl-C or SIGTERM).

A sibling module, imported as the scripts import ``salus_common``: ``import _cli`` from a
script in ``benchmarks/`` (the script's folder is on ``sys.path``); scripts in
``benchmarks/gpu/`` put ``benchmarks/`` on ``sys.path`` first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from accelopt.errors import AccelOptError, Terminated, UserError, raise_terminated


def _number(kind: Callable[[str], Any], text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (repeats, rounds, iterations, workers...)."""
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer (>= 1)")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (0 often means "none" or "the default")."""
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(float, text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number (> 0)")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(float, text)
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number >= 0")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1]")
    return value


def size(text: str) -> str:
    """A byte size accelopt reads ('16MiB', '1GiB'), checked; the text is kept."""
    from accelopt.units import parse_bytes

    try:
        if parse_bytes(text) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a size > 0")
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def rate(text: str) -> str:
    """A link rate accelopt reads ('100mbit', '1gbit'), checked; the text is kept."""
    from accelopt.drivers.cluster.settings import parse_rate

    try:
        parse_rate(text, key="bandwidth")
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def rate_or_none(text: str) -> str:
    """:func:`rate`, or ``none`` (no shaping)."""
    return text if text == "none" else rate(text)


def comma_separated(item: Callable[[str], Any],
                    allow_empty: bool = False) -> Callable[[str], str]:
    """A comma-separated list, each item checked by the argparse type ``item``; the text is
    kept (the script splits it)."""

    def parse(text: str) -> str:
        items = [t for t in text.split(",") if t]
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError("give at least one value")
        for t in items:
            item(t)
        return text

    return parse


def names(known: Iterable[str]) -> Callable[[str], str]:
    """A comma-separated list of names, each one of ``known`` (an unknown one is a usage
    error); the text is kept (the script splits it)."""
    allowed = list(known)

    def parse(text: str) -> str:
        items = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in items if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))} (choose from {', '.join(allowed)})")
        if not items:
            raise argparse.ArgumentTypeError("give at least one name")
        return text

    return parse


def prog() -> str:
    return os.path.basename(sys.argv[0]) or "benchmark"


def summary(doc: str | None) -> str:
    """A script's ``--help`` description: its docstring's first paragraph on one line (the
    first line alone stopped mid-sentence)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def fail(message: str, code: int = 2) -> NoReturn:
    """``<script>: error: <message>`` on stderr, then exit ``code`` (2: bad input)."""
    print(f"{prog()}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def add_force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="overwrite existing output files (refused without it: a "
                             "benchmark never overwrites a user's results)")


def refuse_existing(path: str | os.PathLike[str], force: bool, flag: str = "",
                    directory: bool = False) -> None:
    """Exit 2 with one line when ``path`` exists, unless ``force``: never overwrite a
    user's results. ``flag`` names the option that chose the path. Refused even with
    ``force``: a path that cannot be written (a folder above it is a file; a directory
    where the script writes a file, unless ``directory``), which would otherwise fail
    with a traceback once the benchmark has run."""
    where = f"{flag} {path}" if flag else str(path)
    _refuse_under_a_file(path, where)
    if not directory and os.path.isdir(path):
        fail(f"{where} is a directory; give the name of a file to write")
    if force or not os.path.lexists(path):
        return
    fail(f"{where} exists; not overwriting results (pass --force to regenerate it)")


def refuse_not_a_directory(path: str | os.PathLike[str], flag: str = "") -> None:
    """Exit 2 with one line when the output directory ``path`` cannot be made: it, or a
    folder above it, is an existing file (a results file given for a directory)."""
    where = f"{flag} {path}" if flag else str(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        fail(f"{where} is a file, not a directory; give a directory for the results (it is "
             "created if missing)")
    _refuse_under_a_file(path, where)


def _refuse_under_a_file(path: str | os.PathLike[str], where: str) -> None:
    for parent in Path(path).parents:  # the nearest existing one decides (".": the cwd)
        if os.path.lexists(parent):
            if not parent.is_dir():
                fail(f"{where}: {parent} is a file, not a directory; give a path in a "
                     "directory")
            return


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's ``main`` as the ``accelopt`` command runs: SIGTERM raises
    :class:`Terminated` in the main thread (so ``finally`` blocks run, child processes are
    stopped and temporary directories removed), and errors accelopt raises on purpose are
    one line, not a traceback. Exits with ``main``'s return value (``None``: 0)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)
    try:
        code = main()
    except UserError as exc:  # bad input: the usage error's exit code
        print(f"{prog()}: error: {exc}", file=sys.stderr, flush=True)
        code = 2
    except AccelOptError as exc:  # RankFailed and the others: one line, their own code
        print(f"{prog()}: error: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    except Terminated:
        print(f"{prog()}: terminated (SIGTERM)", file=sys.stderr, flush=True)
        code = Terminated.exit_code
    except KeyboardInterrupt:
        print(f"{prog()}: interrupted", file=sys.stderr, flush=True)
        code = 130
    except BrokenPipeError:  # `script | head`: the reader left; no traceback for it
        _drop_stdout()
        code = 141  # as a shell reports a command killed by SIGPIPE
    sys.exit(code)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so flushing it at exit does not raise a second
    BrokenPipeError (the recipe of Python's signal documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _stop(proc: Any, grace_s: float) -> None:
    """Stop a ``subprocess.Popen`` (with its process group when it leads one) or a
    ``multiprocessing.Process``: SIGTERM, then SIGKILL after ``grace_s``; reaped."""
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is not None:
            return
        group = _own_group(proc)
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if group:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if group:  # what the child left in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        return
    if proc.pid is None or not proc.is_alive():
        return
    proc.terminate()
    proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


@contextlib.contextmanager
def stopping(procs: Sequence[Any] | list[Any], grace_s: float = 5.0) -> Iterator[None]:
    """Child processes (``Popen`` or ``multiprocessing.Process``, the list may grow inside
    the block) that do not outlive the block when it ends with an exception (an error,
    Ctrl-C, SIGTERM as :class:`Terminated`): each still running is stopped and reaped."""
    try:
        yield
    except BaseException:
        main = threading.current_thread() is threading.main_thread()
        # a second SIGTERM must not interrupt the clean-up and leave the rest running
        before = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
        try:
            for proc in procs:
                with contextlib.suppress(Exception):
                    _stop(proc, grace_s)
        finally:
            if main:  # the script may go on (a failed variant is reported, the rest run)
                signal.signal(signal.SIGTERM, before)
        raise


def popen(command: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a new process group (so :func:`stopping` stops the child's own
    children with it)."""
    return subprocess.Popen(command, start_new_session=True, **kwargs)


def run_child(command: Sequence[str], *, timeout: float | None = None,
              check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose child (and the processes it starts) is stopped when the
    script stops: the child runs in its own process group, which is terminated on an
    exception (Ctrl-C, SIGTERM, a timeout) before it propagates."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    proc = popen(command, **kwargs)
    with stopping([proc]):
        out, err = proc.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def ensure_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p`` (for an output directory already checked by :func:`refuse_existing`)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out
