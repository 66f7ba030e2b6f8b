"""The ``accelopt`` command: run, plugins, matrix, new-plugin, and plugins' own subcommands.

User mistakes print ``error: <one line>`` and exit 2; a plugin's own exception exits 1 with
a line naming the plugin and hook. ``--debug`` (anywhere on the line) or
``ACCELOPT_DEBUG=1`` shows the traceback as well (the exit code stays the same).
``accelopt --version`` prints the versions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelopt.errors import (
    AccelOptError,
    Terminated,
    UserError,
    did_you_mean,
    error_text,
    raise_terminated,
)
from accelopt.plugin import Registry, one_line_for_plugins

if TYPE_CHECKING:
    from accelopt.types import CliCommand

CORE_COMMANDS: dict[str, str] = {
    "run": "run the configured workload (Hydra overrides; -m for a sweep)",
    "plugins": "list installed plugins",
    "matrix": "print valid plugin combinations for a CI matrix / Hydra sweep",
    "new-plugin": "scaffold an installable third-party plugin package",
    "bench": "ablation: one workload under several plugin sets, gains and interactions",
}

USAGE = """usage: accelopt COMMAND [ARGS...]

  accelopt run                                  the default workload, no plugins
  accelopt run +plugins=[noop] workload=trace   compose plugins and pick a workload
  accelopt run -m '+plugins=[],[noop]'          Hydra multirun sweep
  accelopt bench --plugins a,b workload=trace   ablation with interaction effects
  accelopt plugins | matrix | new-plugin NAME

commands:
"""


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("ACCELOPT_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    warnings.simplefilter("default", RuntimeWarning)
    warnings.formatwarning = one_line_for_plugins(warnings.formatwarning)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)  # stop as on Ctrl-C, evidence kept
    guard = StdoutGuard(sys.stdout) if sys.stdout is not None else None  # None: pythonw
    if guard is not None:
        sys.stdout = guard
    try:
        code = dispatch(args, debug)
    except AccelOptError as exc:
        if debug:  # the traceback as well, and still the error's own exit code
            import traceback

            traceback.print_exc(file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        code = Terminated.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # written past the guard (to the descriptor): the reader left
        if guard is not None:
            guard.reader_left()
        code = 0
    finally:
        if guard is not None and sys.stdout is guard:  # in-process callers get theirs back
            sys.stdout = guard.original
    sys.exit(code)


class StdoutGuard:
    """``sys.stdout`` while a command runs: a reader that leaves (``accelopt run ... | head
    -1``) must not stop the run. Without it the first print after the reader left raised
    ``BrokenPipeError`` inside the run (or a sweep's first point), which ended with exit 1,
    nothing on stderr, the later points never run and ``accelopt.log`` cut short. At the
    first broken pipe the rest of stdout goes nowhere: file descriptor 1 is pointed at
    ``os.devnull`` (so the interpreter's last flush and anything writing the descriptor
    itself fail no more), and so are this stream's later writes. What reads the stream's
    attributes (``isatty``, ``encoding``, rich's console) sees the original one."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self._target = original
        self.broken = False

    def write(self, text: str) -> int:
        try:
            return self._target.write(text)
        except BrokenPipeError:
            self.reader_left()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._target.flush()
        except BrokenPipeError:
            self.reader_left()

    def reader_left(self) -> None:
        if self.broken:
            return
        self.broken = True
        try:
            fd = self.original.fileno()
        except (AttributeError, OSError, ValueError):  # not a file: nothing else to point
            fd = None
        if fd is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        self._target = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - process-long

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


def console() -> None:
    """The installed ``accelopt`` command (and ``python -m accelopt.cli.main``): :func:`main`,
    then the process ends at once with its exit code, output flushed and logging shut down.

    Why not a normal interpreter exit: with torch, dynamo and matplotlib imported, Python's
    shutdown tears every module down one by one, about 1 s on 2 cores after everything the
    user waited for is written. Nothing needs it: every output file is closed (written
    atomically), rank processes and the forkserver have been stopped and reaped, and
    multiprocessing's exit finalizers run
    (:func:`~accelopt.drivers.processes.release_before_exit`). An exception other than an
    exit (a bug: its traceback) takes the normal path. Code calling :func:`main` in-process
    (tests, notebooks) is not affected."""
    whole_lines_on_stderr()
    try:
        main()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it, exit 1
        print(code, file=sys.stderr)
        code = 1
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    from accelopt.drivers.processes import release_before_exit

    release_before_exit()
    os._exit(code)


def whole_lines_on_stderr(stream: Any = None) -> None:
    """Make each line printed to the process's stderr one write to its descriptor. Python
    writes stderr through, so ``print(line, file=sys.stderr)`` is two writes (the line, then
    its newline), and the ranks of one torchrun launch, which share the descriptor, printed
    their refusals run together: ``...or run without torchrunerror: cluster.mode=none...``.
    Line buffering flushes each line with its newline, so nothing waits longer than its line
    (and a carriage return flushes as well, for progress on the same line)."""
    stream = sys.stderr if stream is None else stream
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None and getattr(stream, "write_through", False):
        with contextlib.suppress(ValueError, OSError):  # a closed or detached stream
            reconfigure(write_through=False, line_buffering=True)


def dispatch(args: list[str], debug: bool) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(Registry.discover()))
        return 0
    if args[0] in ("--version", "-V", "version"):
        print(version_line())
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        return _run(rest, debug)
    if command == "plugins":
        from accelopt.cli.commands import list_plugins

        return list_plugins(rest)
    if command == "matrix":
        from accelopt.cli.commands import matrix

        return matrix(rest)
    if command == "bench":
        from accelopt.bench.runner import bench_command

        return bench_command(rest)
    if command == "new-plugin":
        from accelopt.cli.scaffold import new_plugin_command

        return new_plugin_command(rest)
    registry = Registry.discover()
    plugin_commands = plugin_cli_commands(registry)
    if command in plugin_commands:
        return plugin_commands[command](rest)
    known = [*CORE_COMMANDS, *plugin_commands]
    raise UserError(f"unknown command '{command}'{did_you_mean(command, known)} (commands: "
                    f"{', '.join(known)})")


def version_line() -> str:
    """``accelopt 0.1.0 (python 3.11.7, torch 2.13.0)``: torch's version from its package
    metadata, so printing it does not import torch."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from accelopt import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"accelopt {__version__} (python {platform.python_version()}, torch {torch_version})"


def _run(rest: list[str], debug: bool) -> int:
    from accelopt.collector import no_run_started, pause_until_run_starts

    pause_until_run_starts()  # no full collections over the imports (accelopt/collector.py)
    try:
        return _run_paused(rest, debug)
    finally:
        no_run_started()  # a command refused before its run leaves the collector as it was


def _run_paused(rest: list[str], debug: bool) -> int:
    from accelopt.drivers.processes import rank_server_started_early

    rest = primary_config_flags(rest)  # before anything reads the line: checks, Hydra, -m
    # The default run is a cluster run: start its ranks' forkserver before even Hydra is
    # imported, so the forkserver's imports overlap this process's imports and config
    # composition; stopped at once when the composed config turns out to run locally.
    with rank_server_started_early(modes_before_composing(rest)) as early:
        from accelopt.cli.config_errors import HYDRA_PASSTHROUGH_FLAGS, refuse_bad_config_flags
        from accelopt.cli.hydra_run import (
            drop_empty_plugin_selection,
            plugin_selections,
            prepare,
            run_hydra,
        )
        from accelopt.cli.run_dirs import pin_run_dir
        from accelopt.cli.sweep_settings import force_settings_of_swept_plugins

        refuse_bad_config_flags(rest)
        rest = drop_empty_plugin_selection(rest)
        registry = Registry.discover()
        multirun = "-m" in rest or "--multirun" in rest
        if multirun:  # a plugin's setting reaches the points of the sweep that select it
            rest = force_settings_of_swept_plugins(
                rest, plugin_selections(hydra_overrides(rest)))
        overrides = hydra_overrides(rest)
        passthrough = any(a.split("=")[0] in HYDRA_PASSTHROUGH_FLAGS for a in rest)
        # a torchrun rank's mistake in its command line stops its peers at once, with it
        with _refusal_said_to_the_peers():
            modes, pinned = prepare(overrides, registry, multirun=multirun and not passthrough)
        if not passthrough:  # the directory checked is the one claimed and written
            rest = pin_run_dir(rest, pinned)
        if not modes or passthrough:
            early.stop()
        elif not early.running:  # a workload's own cluster mode: start it now, as before
            with rank_server_started_early(modes):
                return run_hydra(rest, registry, debug)
        return run_hydra(rest, registry, debug)


def _refusal_said_to_the_peers() -> contextlib.AbstractContextManager[None]:
    """Under torchrun, a mistake in a rank's command line (an unknown plugin on one machine)
    is left in the rendezvous store, so the other ranks stop at once with its line instead
    of naming it as never joined after cluster.timeout_s
    (``launch.refusals_said_at_rendezvous``). Elsewhere nothing, and nothing imported: the
    cluster's modules bring torch, which the command imports after composing."""
    from accelopt.drivers.processes import under_torchrun

    if not under_torchrun():
        return contextlib.nullcontext()
    from accelopt.drivers.cluster.launch import refusals_said_at_rendezvous

    return refusals_said_at_rendezvous(None)


def modes_before_composing(args: list[str]) -> set[str]:
    """The cluster modes to start the ranks' forkserver for before an ``accelopt run`` line's
    config is composed: the ``cluster.mode`` the line names, or ``ps`` when it names neither
    a mode nor a workload (the default workload is a parameter-server run); none otherwise
    (a workload's own mode is known only once composed, and the server then starts after
    composing, for a cluster run only). A wrong guess costs a forkserver started and stopped
    on the other core while the config is composed."""
    values = dict(a.replace(" ", "").lstrip("+").split("=", 1) for a in args if "=" in a)
    if "cluster.mode" in values:
        return {values["cluster.mode"]} - {"none"}
    return set() if "workload" in values else {"ps"}


PRIMARY_HYDRA_SETTINGS = ("run.dir", "sweep.dir", "job.name")
"""accelopt's own ``hydra:`` settings (``configs/config.yaml``) that a primary config of
one's own without a ``hydra:`` section is given (:func:`primary_config_flags`): without them
its run wrote into Hydra's ``outputs/<date>/<time>`` and its log into ``hydra_run.log``."""


def primary_config_flags(args: list[str]) -> list[str]:
    """An ``accelopt run`` line with Hydra's config flags as the user meant them, for every
    step that reads it (the checks composed before Hydra, Hydra itself, ``-m`` sweeps).

    - ``--config-dir D`` (``-cd``) where D holds the primary config (``--config-name``'s,
      ``config`` unless given), as a run directory holds its ``config.yaml``: Hydra only adds
      D to its search path, after accelopt's own configs, whose primary config is also named
      ``config``, so a rerun of a saved run ran the packaged default, exit 0. It becomes
      ``--config-path D`` (D absolute), which reads D's file. Without that file (D holds
      config groups: ``workload/NAME.yaml``), or with a ``--config-path`` given, it stays a
      search-path addition.
    - ``--config-path P`` relative: Hydra takes it from accelopt's package, not from the
      working directory; it becomes absolute, from the working directory.
    - A primary config of one's own with no ``hydra:`` section (a run's saved
      ``config.yaml``): accelopt's run and sweep directories and job name
      (:data:`PRIMARY_HYDRA_SETTINGS`) where the line gives none, so its run lands in
      ``runs/`` with its ``accelopt.log`` as every run does."""
    from accelopt.cli.config_errors import CONFIG_FLAGS

    found: list[tuple[int, str, str, bool]] = []  # (index, flag's long name, value, "=")
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag not in CONFIG_FLAGS:
            i += 1
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        found.append((i, CONFIG_FLAGS[flag], value, bool(eq)))
        i += 1 if eq else 2
    names = [value for _, long, value, _ in found if long == "config-name"]
    stem = (names[-1] if names else "config").removesuffix(".yaml")
    paths = [f for f in found if f[1] == "config-path"]
    dirs = [f for f in found if f[1] == "config-dir" and f[2]]
    replaced: dict[int, tuple[str, str, bool]] = {}
    primary: str | None = None
    if paths:
        for index, _, value, joined in paths:
            if value and "://" not in value:
                replaced[index] = ("--config-path", _absolute(value), joined)
        index, _, value, joined = paths[-1]
        primary = replaced[index][1] if index in replaced else None
    elif dirs:
        index, _, value, joined = dirs[-1]  # Hydra reads the last --config-dir only
        if os.path.isfile(os.path.join(_absolute(value), f"{stem}.yaml")):
            replaced[index] = ("--config-path", _absolute(value), joined)
            primary = _absolute(value)
    out: list[str] = []
    for i, arg in enumerate(args):
        if i in replaced:
            flag, value, joined = replaced[i]
            out += [f"{flag}={value}"] if joined else [flag, value]
        elif not (i - 1 in replaced and not replaced[i - 1][2]):
            out.append(arg)
    if primary is not None:
        out += _accelopt_hydra_settings(os.path.join(primary, f"{stem}.yaml"), out)
    return out


def _absolute(path: str) -> str:
    """``path`` (``~`` expanded) from the working directory."""
    return os.path.abspath(os.path.expanduser(path))


def _accelopt_hydra_settings(primary: str, args: list[str]) -> list[str]:
    """The overrides of :data:`PRIMARY_HYDRA_SETTINGS` that a run of the primary config file
    ``primary`` needs: none where the file has a ``hydra:`` section of its own (or cannot be
    read: Hydra's error then says why), else accelopt's, each one the line does not set
    (``hydra.run.dir`` for a single run, ``hydra.sweep.dir`` for ``-m``)."""
    from omegaconf import DictConfig, OmegaConf

    from accelopt.cli.config_errors import config_dir

    try:
        own = OmegaConf.load(primary)
    except Exception:  # noqa: BLE001 - Hydra reads it next and names the problem
        return []
    if not isinstance(own, DictConfig) or "hydra" in own:
        return []
    ours = OmegaConf.to_container(OmegaConf.load(os.path.join(config_dir(), "config.yaml")),
                                  resolve=False)
    multirun = "-m" in args or "--multirun" in args
    given = {a.lstrip("+").split("=", 1)[0] for a in args if not a.startswith("-")}
    settings = []
    for key in PRIMARY_HYDRA_SETTINGS:
        if key == ("run.dir" if multirun else "sweep.dir") or f"hydra.{key}" in given:
            continue
        value: object = ours["hydra"]  # type: ignore[index,call-overload]
        for part in key.split("."):
            value = value[part]  # type: ignore[index]
        settings.append(f"hydra.{key}={value}")
    return settings


FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name",
                    "-cn", "--config-dir", "-cd", "--experimental-rerun", "--shell-completion",
                    "-sc"}
INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def hydra_overrides(args: list[str]) -> list[str]:
    """The overrides of an ``accelopt run`` line: everything but Hydra's own flags and their
    values (``--cfg job``, ``--info defaults``)."""
    overrides: list[str] = []
    skip = False
    config_dirs: list[str] = []
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            flag, _, value = arg.partition("=")
            if flag in ("--config-dir", "-cd"):
                value = value or (args[i + 1] if i + 1 < len(args) else "")
                if value:
                    config_dirs.append(value)
            skip = arg in FLAGS_WITH_VALUE or (
                arg in ("--info", "-i") and i + 1 < len(args) and args[i + 1] in INFO_TOPICS)
            continue
        overrides.append(arg)
    if config_dirs and not any(o.startswith("hydra.searchpath=") for o in overrides):
        # what --config-dir adds to Hydra's search path, for the checks composed before it
        dirs = ",".join(f"file://{os.path.abspath(d)}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{dirs}]")
    return overrides


def plugin_cli_commands(registry: Registry) -> dict[str, Callable[[list[str]], int]]:
    """Subcommands contributed by installed plugins through ``accelopt_cli_commands``; what
    could not be taken is a one-line warning each (:func:`contributed_commands`)."""
    from accelopt.plugin import PluginWarning

    contributed, refused = contributed_commands(registry)
    for note in refused:
        warnings.warn(note, PluginWarning, stacklevel=2)
    return {name: _one_line_command(plugin, name, command.run)
            for name, (plugin, command) in contributed.items()}


def contributed_commands(registry: Registry) -> tuple[dict[str, tuple[str, CliCommand]],
                                                      list[str]]:
    """name -> (plugin, command) for every subcommand installed plugins contribute, and a note
    for each one refused: a core command's name (``run`` stays accelopt's), a name another
    plugin took first, or a plugin whose ``accelopt_cli_commands`` raised or answered what
    is not a list of ``CliCommand`` (skipped, so one plugin cannot break the help of all)."""
    from accelopt.host import PluginHost

    commands: dict[str, tuple[str, CliCommand]] = {}
    refused: list[str] = []
    for spec in registry.all():
        try:
            answers = PluginHost([(spec, spec.instantiate())]).call("accelopt_cli_commands")
        except Exception as exc:
            refused.append(f"plugin '{spec.name}' could not list its commands: {exc}")
            continue
        for command in (c for answer in answers for c in answer):
            if command.name in CORE_COMMANDS:
                refused.append(f"plugin '{spec.name}': command '{command.name}' is a core "
                               "command; ignored (rename it)")
            elif command.name in commands:
                refused.append(f"plugin '{spec.name}': command '{command.name}' is already "
                               f"taken by plugin '{commands[command.name][0]}'; ignored")
            else:
                commands[command.name] = (spec.name, command)
    return commands, refused


def _one_line_command(plugin: str, name: str,
                      run: Callable[[list[str]], int | None]) -> Callable[[list[str]], int]:
    """A contributed command whose own code raises is one line naming the plugin (exit 1;
    a ``UserError`` keeps its line and exit 2), like an exception in a hook."""

    def command(args: list[str]) -> int:
        try:
            code = run(args)
        except AccelOptError:
            raise
        except Exception as exc:
            raise AccelOptError(f"plugin '{plugin}': command '{name}' raised "
                                f"{error_text(exc)}") from exc
        if code is None or (isinstance(code, int) and not isinstance(code, bool)):
            return code or 0
        raise AccelOptError(f"plugin '{plugin}': command '{name}' returned {code!r}; a "
                            "command returns its exit code (an int) or None")

    return command


def _usage(registry: Registry) -> str:
    lines = [f"  {name:<12} {text}" for name, text in CORE_COMMANDS.items()]
    with warnings.catch_warnings():  # a broken plugin is `accelopt plugins`' to report
        warnings.simplefilter("ignore")
        contributed, refused = contributed_commands(registry)
    if contributed:
        lines += ["", "commands contributed by installed plugins:"]
        lines += [f"  {name:<12} {command.help} [{plugin}]"
                  for name, (plugin, command) in contributed.items()]
    if refused:
        lines += ["", "not taken:"] + [f"  {note}" for note in refused]
    return USAGE + "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    console()
