"""``accelopt run``: compose the config with Hydra, validate it up front, execute it.

Hydra prints its own multi-line errors (and exit code 1) when composition fails. We want
one line and exit code 2 for every user mistake, so before handing the command line to
Hydra we compose each requested configuration ourselves with Hydra's compose API and turn
any failure into a :class:`ConfigError`. Unknown plugin names are caught even earlier, from
the parsed overrides, so the message can list the installed plugins and the closest match.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import itertools
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from accelopt.atomic import (
    RUNS_DIR,
    UNWRITABLE_FIX,
    WRITE_FAILURES,
    OutputUnwritable,
    refuse_unwritable,
)
from accelopt.cli.config_errors import (
    config_dir,
    describe_config_error,
    describe_override_parse_error,
    first_line_of,
    refuse_added_setting_of_a_selected_plugin,
    unknown_key_message,
)
from accelopt.cli.run_dirs import (
    PointDirs,
    claim_named_run_dir,
    named_dir,
    point_dirs,
    refuse_one_directory_for_two_points,
    refuse_taken_run_dir,
    refuse_taken_sweep_dir,
    remove_if_never_started,
    secondary_rank_dir,
    shared_directory_line,
)
from accelopt.cli.sweep_settings import (
    PLUGIN_SETTING,
    drop_unselected,
    selection_from_task_overrides,
)
from accelopt.cli.sweep_summary import (
    SweepPoint,
    point_status,
    run_dir_shown,
    write_and_say,
)
from accelopt.config import (
    register_plugin_configs,
    register_schema,
    strict_booleans,
    unknown_keys,
)
from accelopt.errors import (
    AccelOptError,
    ConfigError,
    JobsUnfinished,
    RankFailed,
    UserError,
    listed,
)
from accelopt.job.checkpoint import WEIGHTS_DIR, has_checkpoints
from accelopt.plugin import Registry, resolve
from accelopt.report.console import default_console, trimmed
from accelopt.report.summary import diverged_text
from accelopt.report.writer import METRICS_CSV, METRICS_JSON, TIMELINE_PNG, TRACE_JSON
from accelopt.runtime.compare import inert_plugins
from accelopt.runtime.resume_target import (
    HONOURED,
    finished,
    references_unfinished,
    refuse_finished,
    resume_target,
    run_mode,
)

RUN_OUTPUTS = (METRICS_JSON, METRICS_CSV, TRACE_JSON, TIMELINE_PNG)
"""What every run writes into its directory once its jobs ended (``write_run_outputs``)."""

EXIT_REASONS = {1: "a plugin raised, an output could not be written, or an internal error",
                2: "a user mistake",
                3: "jobs failed, were rejected or diverged"}
"""A run's non-zero exit codes, most severe first: a sweep exits with the most severe of its
runs' codes, whatever their order (it exited with its last failing run's)."""


def expose_hydra_plugins() -> None:
    """Let Hydra's plugin scan see this project's ``hydra_plugins`` (the ``salus``
    launcher) under an editable install too: setuptools' editable finder serves the
    namespace package through a path hook that ``pkgutil`` cannot list, so the scan would
    miss it and ``hydra/launcher=salus`` would be unknown. The folder is located without
    importing it; a regular install needs nothing (a no-op)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("hydra_plugins.accelopt_salus_launcher")
    except (ImportError, ValueError):
        return
    if spec is None or spec.origin is None:
        return
    import hydra_plugins

    folder = str(Path(spec.origin).parent.parent)
    if folder not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(folder)
    _register_if_already_scanned()


def _register_if_already_scanned() -> None:
    """Hydra scans ``hydra_plugins`` once per process, when its plugin registry is first
    made; if something in this process (a library call, another ``main``) made it before the
    folder was visible, the scan missed the launcher: register it (and its config node, which
    its module stores on import) by hand. Nothing to do before the first scan."""
    from hydra.core.plugins import Plugins
    from hydra.core.singleton import Singleton

    if Plugins not in Singleton._instances:
        return  # the first scan will see the folder
    module = importlib.import_module("hydra_plugins.accelopt_salus_launcher.salus_launcher")
    registry = Plugins.instance()
    name = f"{module.SalusLauncher.__module__}.{module.SalusLauncher.__name__}"
    if name not in registry.class_name_to_class:
        registry.register(module.SalusLauncher)




def plugin_selections(overrides: list[str]) -> list[list[str]]:
    """Every plugin list the command line asks for (several with ``-m`` sweeps)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as exc:
        raise ConfigError(describe_override_parse_error(exc.override, exc.message)) from None
    except HydraException as exc:
        raise ConfigError(f"cannot parse the overrides: {first_line_of(exc)}") from None
    selecting = [o for o in parsed  # ~plugins: no value
                 if o.key_or_group == "plugins" and not o.is_delete()]
    refuse_repeated_selection(selecting)
    selections: list[list[str]] = []
    for override in selecting:
        if override.is_sweep_override():
            values = list(override.sweep_iterator())
        else:
            values = [override.value()]
        for value in values:
            names = value if isinstance(value, list) else [value]
            read = [n for n in names if not isinstance(n, str)]
            if read:  # `[true]` is [True]: "unknown plugin 'True'", or a TypeError later
                raise ConfigError(
                    f"'{override.input_line}': Hydra's override grammar reads "
                    f"{_as_written(read[0])} as a value ({read[0]!r}), not as a plugin name; "
                    "no plugin is named true, false, null, inf, nan or a number "
                    "(`accelopt plugins` lists them)")
            selections.append(list(names))
    return selections or [[]]


def refuse_repeated_selection(selecting: Sequence[Override]) -> None:
    """Plugins selected by two overrides (``'+plugins=[noop]' '+plugins=[salus]'``): Hydra
    adds both lists to the run, so a plugin named in both would run once without a word,
    where one list naming it twice is refused (:func:`accelopt.plugin.resolve`), and the
    checks made before composing would see each list alone. One override selects them
    all."""
    if len(selecting) < 2:
        return
    given = " and ".join(f"'{o.input_line}'" for o in selecting)
    if any(o.is_sweep_override() for o in selecting):
        fix = "one +plugins=[a,b] (a sweep: one -m '+plugins=[a],[a,b]')"
    else:
        values = [o.value() for o in selecting]
        names = [n for v in values for n in (v if isinstance(v, list) else [v])]
        fix = f"+plugins=[{','.join(str(n) for n in dict.fromkeys(names))}]"
    times = "twice" if len(selecting) == 2 else f"{len(selecting)} times"
    raise ConfigError(f"plugins are selected {times} ({given}); list every plugin in one "
                      f"override: {fix}")


def _as_written(value: object) -> str:
    """How a value Hydra read was written on the command line (``True``: ``true``)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value).lower() if isinstance(value, float) else str(value)


EMPTY_SELECTIONS = ("+plugins=[]", "plugins=[]", "++plugins=[]")


def drop_empty_plugin_selection(args: list[str]) -> list[str]:
    """``+plugins=[]`` in a single run means no plugins, which is the default: drop it
    (Hydra cannot select an empty list of config-group options outside a sweep, which
    ``accelopt matrix`` and ``-m '+plugins=[],[noop]'`` write). Not on a resume's line: a
    resume runs the old run's plugins, so it is refused there as ``+plugins=[salus]`` is
    (:func:`refuse_bad_resume`); dropped, the resume went on with the old plugins in
    silence, and the new run's ``.hydra/overrides.yaml`` did not show it was given. Unless
    the resumed run was started with it too (a sweep's ``+plugins=[]`` point): it changes
    nothing, and is dropped as on a new run's line."""
    resumed = _resumed(args)
    own = _overrides_of_the_run(Path(resumed).expanduser()) if resumed is not None else []
    return [a for a in args if a.replace(" ", "") not in EMPTY_SELECTIONS
            or (resumed is not None and not any(_same_override(a, k) for k in own))]


NO_RESUME = ("null", "none", "''", '""')


def _resumed(overrides: Sequence[str]) -> str | None:
    """The directory ``run.resume`` names on the line (its last value), or None where it
    names none (absent, or null)."""
    values = [o.split("=", 1)[1].strip() for o in overrides
              if "=" in o and o.lstrip("+").split("=", 1)[0].strip() == "run.resume"]
    if not values or not values[-1] or values[-1].lower() in NO_RESUME:
        return None
    return values[-1]


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of ``-m`` sweep overrides, as plain override lists."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices: list[list[str]] = []
    for override in parsed:
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def _empty_sweep(override: str) -> bool:
    parsed = OverridesParser.create().parse_overrides([override])[0]
    return parsed.is_sweep_override() and not list(parsed.sweep_string_iterator())


def prepare(overrides: list[str], registry: Registry,
            multirun: bool) -> tuple[set[str], str | None]:
    """Load the selected plugins, register configs, and compose every requested config
    once so that any mistake surfaces as one line before Hydra starts. Returns the cluster
    modes among them other than ``none`` (empty: every run is local; else the ranks'
    forkserver can start before Hydra runs them), and the directory a single run's
    ``hydra.run.dir`` with a ``${...}`` in it resolved to (None for any other: for
    :func:`pin_run_dir`)."""
    configs, dirs = prepared_points(overrides, registry, multirun)
    modes = {run_mode(cfg) for cfg in configs} - {"none"}
    pinned = None
    if not multirun and "$" in (named_dir(overrides, "hydra.run.dir") or "") and dirs[0]:
        pinned = dirs[0].run
    return modes, pinned


def prepared_configs(overrides: list[str], registry: Registry, multirun: bool = False,
                     run_dir: Path | None = None) -> list[DictConfig]:
    """:func:`prepare`'s work, returning the composed configs (one per sweep point), so a
    caller that runs one (``accelopt.run``) need not compose it again; ``run_dir``: the run
    directory such a caller chose (else the overrides' or the default one is checked)."""
    return prepared_points(overrides, registry, multirun, run_dir)[0]


def prepared_points(overrides: list[str], registry: Registry, multirun: bool = False,
                    run_dir: Path | None = None
                    ) -> tuple[list[DictConfig], list[PointDirs | None]]:
    """:func:`prepared_configs`, with each point's directories where Hydra picks them
    (``run_dir`` None) and they are checked: a named one resolved (``${workload.name}``)."""
    expose_hydra_plugins()
    specs = {}
    selections = plugin_selections(overrides)
    for names in selections:
        for spec in resolve(names, registry):
            specs[spec.name] = spec
    register_schema(overrides)
    register_plugin_configs(list(specs.values()))
    refuse_added_setting_of_a_selected_plugin(overrides, selections)
    out, where = [], []
    combos = expand_sweeps(overrides) if multirun else [overrides]
    if not combos:  # an empty sweep would exit 0 having run nothing (a CI step testing nothing)
        empty = [o for o in overrides if _empty_sweep(o)]
        raise ConfigError(f"the sweep has no points ({listed(empty)} sweeps over no values); "
                          "give each swept key at least one value")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    clock = OmegaConf.create()  # ${now:...}: one instant for every point, as in Hydra's sweep
    composed: dict[tuple[str, ...], DictConfig] = {}
    for index, combo in enumerate(combos):
        # a resume's refusals first: an override it would ignore is "drop it", not a
        # composing error's fix ("add +plugins=[salus]", which the resume then refuses)
        refuse_bad_resume(combo)
        named = named_dir(combo, key)
        resolve_dirs = run_dir is None and (multirun or "$" in (named or ""))
        repeat = tuple(combo) in composed
        with point_named(index, combos, overrides, registry):
            cfg, dirs = compose_point(combo, index if resolve_dirs else None, clock, composed)
        out.append(cfg)
        where.append(dirs)
        if dirs is not None and named is not None:  # the directory Hydra will write into
            named = (dirs.sweep if multirun else dirs.run) or named
        if named and not multirun:  # a sweep's runs go under hydra.sweep.dir, each its own
            refuse_taken_run_dir(Path(named))
        if named and multirun:
            refuse_taken_sweep_dir(Path(named))
        if multirun:
            refuse_one_directory_for_two_points(where)
        if multirun and not repeat:  # every point's values now, not when its turn comes
            from accelopt.runtime.run import validate

            with point_named(index, combos, overrides, registry):
                validate(as_the_point_runs(out[-1], combo), registry)
        # the fixed part of the directory (before a ${now:...}): an unwritable one is one line
        # now, not an OSError traceback from Hydra's first write or after the run trained
        written = str(run_dir) if run_dir is not None else (named or RUNS_DIR)
        refuse_unwritable(Path(written.split("$", 1)[0] or "."),
                          "pass another run_dir" if run_dir is not None
                          else f"choose another with {key}=DIR")
    return out, where


def as_the_point_runs(cfg: DictConfig, combo: list[str]) -> DictConfig:
    """A copy of a sweep point's composed ``cfg`` as the point will run: without the settings
    of plugins it does not select (``sweep_settings.py``)."""
    point = copy.deepcopy(cfg)
    drop_unselected(point, selection_from_task_overrides(combo) or [])
    return point


@contextlib.contextmanager
def point_named(index: int, combos: list[list[str]], overrides: list[str],
                registry: Registry) -> Iterator[None]:
    """A sweep point's refusal, checked before the sweep runs, names the point (its number,
    the run directory's name, and its swept values): of a 12-point sweep over plugin sets,
    ``plugins.slide: cluster.mode=ps would train SLIDE's layers wrongly`` left the user to
    work out which points select slide. The points are checked in order, so a later one is
    refused for what it sweeps; the first one only where another point is not refused alike
    (a setting every point has is no point's). One point (or a single run): the line as it
    was."""
    try:
        yield
    except UserError as exc:
        if len(combos) > 1 and exc.args and (index > 0 or not _refused_alike(
                exc, next((c for c in combos if c != combos[0]), None), registry)):
            swept = [o.removeprefix("++") if o.startswith(f"++{PLUGIN_SETTING}") else o
                     for o in combos[index] if o not in overrides]
            exc.args = (f"sweep point #{index} ({' '.join(swept) or 'its overrides'}): "
                        f"{exc.args[0]}", *exc.args[1:])
        raise


def _refused_alike(exc: UserError, combo: list[str] | None, registry: Registry) -> bool:
    """Whether the sweep point ``combo`` (None: there is none other) is refused with ``exc``'s
    line too: composed and checked alone, on the path of an error only."""
    if combo is None:
        return True
    from accelopt.runtime.run import validate

    try:
        validate(as_the_point_runs(compose_point(combo)[0], combo), registry)
    except UserError as other:
        return str(other) == str(exc)
    except Exception:  # noqa: BLE001 - not the same refusal, whatever it is
        return False
    return False


def composed_with_every_plugin(sets: list[list[str]], overrides: list[str],
                               registry: Registry) -> DictConfig:
    """One configuration with every plugin of ``sets`` selected and ``overrides`` (which
    select no plugins), so each plugin's own settings apply: ``runtime.run.refused_sets``
    then checks each set on its part, as a run checks its selection before training (the
    sets of ``accelopt matrix`` and ``accelopt bench``)."""
    every = list(dict.fromkeys(name for s in sets for name in s))
    expose_hydra_plugins()
    register_schema(overrides)
    register_plugin_configs([registry.get(n) for n in every])
    selection = [f"+plugins=[{','.join(every)}]"] if every else []
    return compose_checked([*selection, *overrides])


def refuse_bad_resume(overrides: list[str]) -> None:
    """A ``run.resume`` target that is not a run directory, or ``run.resume=D
    hydra.run.dir=D`` (Hydra would rewrite D's ``.hydra/`` files before the run could
    refuse): one line before Hydra, torch or any rank process starts."""
    values = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o)
    resume, out = values.get("run.resume"), values.get("hydra.run.dir")
    if resume and resume.lower() not in ("null", "none", "''", '""'):
        target = resume_target(resume)  # not a run directory: one line before anything
        asked = values.get("run.resume_finished", "false").lower() in ("true", "1", "yes")
        refuse_finished(target, asked)
    if resume and out and Path(resume).expanduser().resolve() == Path(out).expanduser().resolve():
        raise ConfigError(f"run.resume: {resume} is also this run's output directory; a resumed "
                          "run writes into a new directory (drop hydra.run.dir)")
    if resume and resume.lower() not in NO_RESUME:
        own = _overrides_of_the_run(Path(resume).expanduser())
        ignored = [o for o in overrides
                   if not _kept_by_resume(o) and not any(_same_override(o, k) for k in own)]
        if ignored:
            raise ConfigError(
                f"run.resume continues {resume} with the configuration it ran with, so "
                f"{', '.join(ignored)} would be ignored; drop "
                f"{'it' if len(ignored) == 1 else 'them'} (a new run takes them)")


def _overrides_of_the_run(run_dir: Path) -> list[str]:
    """The overrides the run in ``run_dir`` was started with (its ``.hydra/overrides.yaml``;
    none where it has no such file, e.g. a run of ``accelopt.run``). A resume's line may
    repeat them: each changes nothing of the configuration the resume runs, so it is not
    refused as one that would be ignored (that line told a user who pasted the run's own
    command line, plus ``run.resume``, that the run's own plugins would not run)."""
    try:
        own = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    except Exception:  # noqa: BLE001 - none, or not Hydra's: nothing the run is known to have
        return []
    return [str(o) for o in own] if OmegaConf.is_list(own) else []


def _same_override(given: str, own: str) -> bool:
    """Whether override ``given`` sets what ``own`` set (as Hydra parses both: ``+plugins=
    [a, b]`` is ``+plugins=[a,b]``; ``run.progress=false`` is Hydra's saved
    ``run.progress=False``)."""
    if given.replace(" ", "") == own.replace(" ", ""):
        return True
    try:
        a, b = OverridesParser.create().parse_overrides([given, own])
    except Exception:  # noqa: BLE001 - not one Hydra reads: it is not the run's own
        return False
    if a.is_sweep_override() or b.is_sweep_override() or a.is_delete() or b.is_delete():
        return False
    return ((a.key_or_group, a.package, a.type) == (b.key_or_group, b.package, b.type)
            and a.value() == b.value())


RESUME_KEEPS = ("run.resume", "run.resume_finished", *HONOURED, "hydra.")
"""The overrides a resumed run honours (the rest of its configuration is the old run's)."""


def _kept_by_resume(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_KEEPS)


def compose_checked(overrides: list[str]) -> DictConfig:
    """Compose one configuration with Hydra's compose API; errors become one line, and so
    does a key the schema does not have (:func:`accelopt.config.unknown_keys`)."""
    return compose_point(overrides)[0]




def compose_point(overrides: list[str], job_num: int | None = None,
                  clock: DictConfig | None = None,
                  composed: dict[tuple[str, ...], DictConfig] | None = None
                  ) -> tuple[DictConfig, PointDirs | None]:
    """:func:`compose_checked`, and with ``job_num`` the point's directories as well
    (:func:`point_dirs`; ``clock``: the resolver cache the points share, so ``${now:...}`` is
    one instant for all of them, as Hydra's sweep copies its own to each run). Boolean values
    are read strictly (:func:`accelopt.config.strict_booleans`). ``composed``: the points
    composed and checked so far, by their overrides: a sweep that repeats a point (a bench's
    repeats of each plugin set) composes it once, and each repeat gets a copy with its own
    directories (composing is ~0.3 s a point: a 100-run bench spent 30 s before its first
    run)."""
    key = tuple(overrides) if job_num is not None else None
    known = composed.get(key) if composed is not None and key is not None else None
    if known is not None:
        cfg = copy.deepcopy(known)
        dirs = point_dirs(cfg, job_num, clock)  # type: ignore[arg-type] - job_num set with key
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg, dirs
    GlobalHydra.instance().clear()
    dirs = None
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"), \
                strict_booleans():
            cfg = compose("config", overrides=overrides, return_hydra_config=job_num is not None)
            if composed is not None and key is not None:
                known = copy.deepcopy(cfg)  # kept once every check below has passed
            if job_num is not None:
                dirs = point_dirs(cfg, job_num, clock)
                with open_dict(cfg):
                    del cfg["hydra"]
            OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except HydraException as exc:
        raise ConfigError(describe_config_error(exc, overrides)) from None
    except Exception as exc:  # omegaconf's ValidationError and friends
        raise ConfigError(describe_config_error(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    forced = [o[len("++plugins."):].split(".", 1)[0] for o in overrides
              if o.startswith("++plugins.")]
    unknown = unknown_keys(cfg, stray_plugins=forced)
    if unknown:
        raise ConfigError(unknown_key_message(unknown[0]))
    if known is not None:
        composed[key] = known  # type: ignore[index] - both set together
    return cfg, dirs


def unwritable_line(path: object, reason: object, run_dir: Path) -> str:
    """The line of a run stopped by an output the machine refused (a full disk, a directory
    made read-only), whichever writer met it."""
    return (f"error: cannot write {path}: {reason} (what was written is kept in {run_dir}); "
            f"{UNWRITABLE_FIX}")


def resume_hint(run_dir: Path) -> str:
    """The end of a stopped run's line where it wrote checkpoints: how to go on from them."""
    return f"; continue it from its checkpoints with: {resume_command(run_dir)}"


def resume_command(run_dir: Path) -> str:
    """The command that goes on with the run in ``run_dir``: under torchrun, the same
    torchrun command given ``run.resume`` (``accelopt run`` would start one process)."""
    from accelopt.drivers.processes import under_torchrun
    from accelopt.runtime.run_dir import resume_form

    if under_torchrun():
        return resume_form(run_dir, shared=True)
    return f"accelopt run run.resume={run_dir}"


def resumable_after(exc: AccelOptError, run_dir: Path) -> bool:
    """Whether the line of a run stopped by ``exc`` says how to resume it: a rank that died
    or raised, or an output the machine refused (a full disk), where the run wrote
    checkpoints to go on from. Not after a refusal of bad input (the resume would meet it
    again) nor a plugin's error, nor where every job is done (by its metrics.json: nothing
    is left to resume)."""
    if isinstance(exc, UserError) or not isinstance(exc, (RankFailed, OutputUnwritable)):
        return False
    return has_checkpoints(run_dir) and not finished(run_dir)


def write_log(run_dir: Path, console: Any, error: str) -> None:
    """``accelopt.log``: what the run printed (tables, progress lines, notes) and its error
    line, appended after whatever Hydra's own logging wrote there (into the directory Hydra
    made for the run; a run refused before that leaves none)."""
    if not run_dir.is_dir():
        return
    text = trimmed(console.export_text(clear=True))
    if error:
        text += error + "\n"
    if text:
        try:
            with open(run_dir / "accelopt.log", "a", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:  # the disk that stopped the run: the console has said it all
            print(f"note: {run_dir / 'accelopt.log'} not written ({exc.strerror})",
                  file=sys.stderr)


def run_hydra(args: list[str], registry: Registry, debug: bool) -> int:
    """Hand the command line to Hydra (single run or ``-m`` multirun)."""
    import hydra

    from accelopt.runtime.run import error_line, execute

    exit_code = 0
    runs: list[str] = []
    """Each run's error line ("" when it succeeded), for a sweep's closing line."""
    codes: list[int] = []
    """Each run's exit code (0 when it succeeded), for a sweep's exit code and closing line."""
    inert: list[list[str]] = []
    """Each run's plugins that changed nothing in it, for a sweep's closing note."""
    written: dict[str, int] = {}
    """A sweep's directories so far, each with the number of the run that wrote it."""
    points: list[SweepPoint] = []
    """A sweep's points so far, for its ``sweep.json``."""
    sweep_dir: list[Path] = []
    """The sweep's directory, once a point of a sweep began (none for a single run)."""
    scratch = secondary_rank_dir(args)
    if scratch is not None:
        args = [*args, f"hydra.run.dir={scratch}"]
    claimed = claim_named_run_dir(args) if scratch is None else None

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
    def task(cfg: DictConfig) -> None:
        nonlocal exit_code
        from hydra.core.hydra_config import HydraConfig

        runs.append("")
        codes.append(0)
        inert.append([])

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        sweeping = HydraConfig.get().mode.name == "MULTIRUN"
        if sweeping:  # sweep_settings.py
            sweep_dir[:] = [Path(HydraConfig.get().sweep.dir)]
            earlier = written.setdefault(str(run_dir), len(runs) - 1)
            if earlier != len(runs) - 1:  # its directory resolved only now: refused now
                runs[-1] = shared_directory_line(earlier, len(runs) - 1, str(run_dir), str(
                    OmegaConf.to_container(HydraConfig.get().sweep)["subdir"]))
                print(f"error: {runs[-1]}", file=sys.stderr)
                codes[-1] = ConfigError.exit_code
                exit_code = most_severe(codes)
                note_point(None, interrupted=False)
                return  # the earlier run's outputs, log and claim stay as they are
            drop_unselected(cfg, selection_from_task_overrides(
                list(HydraConfig.get().overrides.task)) or [])
        console = default_console(record=True)
        error, stopped = "", False
        try:
            record = execute(cfg, run_dir=run_dir, registry=registry, console=console)
            inert[-1] = inert_plugins(record.info.plugins, record.plugin_rows)
            unfinished = unfinished_jobs(record, run_dir)
            if unfinished:
                raise JobsUnfinished(unfinished)
        except AccelOptError as exc:
            error = f"error: {exc}"
            if isinstance(exc, OutputUnwritable):  # a full disk may have refused metrics.json
                error = unwritable_line(exc.path, exc.reason, run_dir)
            elif (run_dir / "metrics.json").is_file() and not isinstance(exc, JobsUnfinished):
                error += f" (outputs kept in {run_dir})"  # a run stopped midway: its evidence
            if resumable_after(exc, run_dir):
                error += resume_hint(run_dir)
            if debug:  # the traceback too, and still the error's own exit code
                import traceback

                traceback.print_exc(file=sys.stderr)
            print(error, file=sys.stderr)
            codes[-1] = exc.exit_code
            exit_code = most_severe(codes)
            runs[-1] = str(exc)
            if remove_if_never_started(run_dir):
                error = ""  # nothing started: no directory, no log
            if not HydraConfig.get().mode.name == "MULTIRUN":
                raise SystemExit(exc.exit_code) from None
        except OSError as exc:
            if exc.errno not in WRITE_FAILURES:
                error = f"error: {error_line(exc)}"
                codes[-1], runs[-1] = 1, error_line(exc)
                raise
            # a disk that filled up (or went read-only) under a run: one line, not a traceback
            error = unwritable_line(exc.filename or "the run outputs", exc.strerror, run_dir)
            print(error, file=sys.stderr)
            codes[-1] = 1
            exit_code = most_severe(codes)
            runs[-1] = error.removeprefix("error: ")
            if not HydraConfig.get().mode.name == "MULTIRUN":
                raise SystemExit(1) from None
        except BaseException as exc:
            stopped = isinstance(exc, KeyboardInterrupt)
            codes[-1] = getattr(exc, "exit_code", 130) if stopped else 1
            runs[-1] = error_line(exc)
            error = f"error: {error_line(exc)}"  # "interrupted (Ctrl-C)", not "KeyboardInterrupt: "
            line = stopped_line(error_line(exc), run_dir) \
                if isinstance(exc, KeyboardInterrupt) else ""
            if isinstance(exc, KeyboardInterrupt) and HydraConfig.get().mode.name == "MULTIRUN":
                line = (line or error.removeprefix("error: ")) + interrupted_sweep_note(
                    len(runs) - 1, Path(HydraConfig.get().sweep.dir))
            if line:
                # Ctrl-C, SIGTERM: the outputs so far are kept; the line says where (a bare
                # "interrupted" left a user to look for them, and to guess about resuming)
                print(line, file=sys.stderr)
                error = line  # the log ends with the same line (it had the bare error only)
                raise SystemExit(getattr(exc, "exit_code", 130)) from None
            raise
        finally:
            write_log(run_dir, console, error)
            if sweeping:
                note_point(run_dir, interrupted=stopped)

    def note_point(run_dir: Path | None, *, interrupted: bool) -> None:
        """Add the point that just ended to the sweep's ``sweep.json`` (rewritten whole)."""
        from hydra.core.hydra_config import HydraConfig

        where = run_dir_shown(sweep_dir[0], run_dir) if run_dir is not None else None
        points.append(SweepPoint(
            point=int(HydraConfig.get().job.num), overrides=list(HydraConfig.get().overrides.task),
            run_dir=where, status=point_status(codes[-1], runs[-1], interrupted),
            exit_code=codes[-1], error=runs[-1] or None, inert_plugins=list(inert[-1])))
        summarised(complete=False, say_where=interrupted)  # stopped: the sweep ends here

    def summarised(complete: bool, code: int | None = None, say_where: bool = True) -> None:
        if points and sweep_dir and sweep_dir[0].is_dir():
            write_and_say(sweep_dir[0], points, complete=complete, launcher="basic",
                          exit_code=most_severe(codes) if code is None else code,
                          say_where=say_where)

    saved = sys.argv
    sys.argv = ["accelopt run", *args]
    try:
        try:
            with mode_from_the_command_line(args), hydra_writes_in_one_line():
                task()
        except HydraOutputUnwritable as unwritable:  # before a point's task could begin
            print(unwritable, file=sys.stderr)
            summarised(complete=False, code=1)
            raise SystemExit(1) from None
        summarised(complete=True)
        note = sweep_inert_note(inert, runs)
        if note:
            print(f"note: {note}", file=sys.stderr)
        closing = sweep_failures(runs, codes)
        if closing:
            print(f"error: {closing}", file=sys.stderr)
    finally:
        sys.argv = saved
        forget_hydra_run()
        if claimed is not None and not runs:  # Hydra stopped before the run began
            remove_if_never_started(claimed)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return exit_code


class HydraOutputUnwritable(BaseException):
    """A file Hydra writes for a run before accelopt's task begins (``.hydra/config.yaml``)
    that the machine refused, carrying its one line. Not an ``Exception``: Hydra's reporter
    (``run_and_report``) would print it with a traceback and its ``HYDRA_FULL_ERROR`` hint;
    :func:`run_hydra` says it instead."""


@contextlib.contextmanager
def hydra_writes_in_one_line() -> Iterator[None]:
    """A disk that fills up between two points of a sweep failed Hydra's own first write of
    the next point (``_save_config``) with a traceback, before this command could say a
    word: it is said in the one line of any output the machine refused."""
    from hydra.core import utils

    original = utils._save_config

    def save_config(cfg: Any, filename: str, output_dir: Path) -> None:
        try:
            original(cfg, filename, output_dir)
        except OSError as exc:
            if exc.errno not in WRITE_FAILURES:
                raise
            raise HydraOutputUnwritable(unwritable_line(
                Path(output_dir) / filename, exc.strerror, Path(output_dir).parent)) from None

    utils._save_config = save_config
    try:
        yield
    finally:
        utils._save_config = original


def interrupted_sweep_note(point: int, sweep_dir: Path) -> str:
    """What a Ctrl-C or SIGTERM in sweep point ``point`` leaves of the sweep, said after
    the point's own line: which points had ended (kept), and that the later ones never ran
    and how to run them (the line spoke of the current point only, "run it again for the
    rest", and a rerun into the same directory is refused as taken)."""
    before = ("no point before it had run" if point == 0 else
              f"point{'s' if point > 1 else ''} #0{f'-#{point - 1}' if point > 1 else ''} "
              f"ended before it (kept in {sweep_dir})")
    return (f"; the sweep stopped at point #{point}: {before}, and the points after it did "
            "not run: run them with a new hydra.sweep.dir (a directory holding a sweep's "
            "runs is not written into again)")


def stopped_line(error: str, run_dir: Path) -> str:
    """The line a run stopped by Ctrl-C or SIGTERM ends with: what stopped it, where what
    it wrote is kept (naming only the files it wrote), and the command that goes on from
    there: the run again where it stopped in its ``run.compare`` reference runs, a resume
    from its checkpoints, or none where every job had ended. '' where it kept nothing (it
    stopped before it wrote anything): the bare error line says it all."""
    mode = references_unfinished(run_dir)
    if mode:  # its own jobs never began: its config, and the references' directories
        refs = run_dir / "compare"
        kept = f": what they ran is kept in {refs}" if refs.is_dir() else ""
        return (f"{error} during the run.compare={mode} reference runs, before this run's "
                f"own jobs began{kept}; run it again (the reference runs start over) with: "
                f"{resume_command(run_dir)}")
    ended = finished(run_dir)
    if ended:
        return _stopped_after_the_jobs(error, run_dir, ended)
    kept = [name for name in (METRICS_JSON, TRACE_JSON) if (run_dir / name).is_file()]
    resumable = has_checkpoints(run_dir)
    if not kept and not resumable:
        return _weights_only(error, run_dir)
    no_timeline = _timeline_missing(run_dir) if TRACE_JSON in kept else None
    if no_timeline is not None:
        kept.remove(TRACE_JSON)
    line = (f"{error}: what ran is kept in {run_dir} ({', '.join(kept)})" if kept else
            f"{error}: its checkpoints are kept in {run_dir}")
    if no_timeline is not None:
        line += f"; {TRACE_JSON} holds no timeline: {no_timeline}"
    if resumable:
        line += resume_hint(run_dir)
    return line


def _weights_only(error: str, run_dir: Path) -> str:
    """The line of a run stopped where its directory holds the final weights of jobs that
    had ended and none of its results (no metrics.json, no checkpoints), or '' where it
    holds no weights either. The window: a one-process run saves a job's weights as the job
    ends (``Checkpointer.after_finish``), and writes its results after every job ended;
    once that writing has begun (``runtime/run.py``: ``writing``), a stop is left to it,
    and a stop before its first file (``metrics.json``, written atomically, after the
    summary and the JSON document are computed) leaves the weights alone: the line said
    nothing, as if the run had kept nothing."""
    weights = sorted((run_dir / WEIGHTS_DIR).glob("*.pt"))
    if not weights:
        return ""
    files = ", ".join(f"{WEIGHTS_DIR}/{path.name}" for path in weights)
    return (f"{error}: {run_dir} holds the final weights of the job(s) that had ended "
            f"({files}) and none of the run's results (no {METRICS_JSON}, no checkpoints to "
            "resume from); run it again for them")


def _timeline_missing(run_dir: Path) -> str | None:
    """Why the run's ``trace.json`` holds no event (``metrics.json``'s telemetry note, where
    it has one), or None where it holds some: a stopped cluster run whose ranks died with
    it wrote an empty trace, and the stop line listed it as kept."""
    try:
        with open(run_dir / TRACE_JSON, encoding="utf-8") as handle:
            if json.load(handle).get("traceEvents"):
                return None
    except (OSError, ValueError, AttributeError):
        return None  # not the run's trace as it writes it: not ours to describe
    try:
        note = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))["telemetry"]["note"]
    except (OSError, ValueError, KeyError, TypeError):
        note = None
    return str(note) if note else "no rank left its timeline"


def _stopped_after_the_jobs(error: str, run_dir: Path, ended: str) -> str:
    """A run stopped after every job had ended, while it wrote its outputs: nothing is left
    to resume (a resume is refused, and ``run.resume_finished=true`` reports the restored
    jobs again, without their timeline), so the line says which outputs it wrote and which
    it did not, and that their figures are in metrics.json."""
    written = [name for name in RUN_OUTPUTS if (run_dir / name).is_file()]
    missing = [name for name in RUN_OUTPUTS if name not in written]
    unsaved = _weights_not_saved(run_dir)
    if unsaved:  # a cluster run stopped before its ranks handed over the final weights
        files = ", ".join(f"{WEIGHTS_DIR}/{job_id}.pt" for job_id in unsaved)
        return (f"{error} after its jobs ended ({ended}), before their weights were saved: "
                f"{run_dir} holds {', '.join(written) or 'no outputs'}, not {files}, and its "
                "jobs were not scored; "
                + (f"save the weights and score the jobs from its checkpoints with: accelopt "
                   f"run run.resume={run_dir} run.resume_finished=true"
                   if has_checkpoints(run_dir) else
                   "it wrote no checkpoints to save them from; run it again for them"))
    if not missing:
        return (f"{error} after its jobs ended ({ended}) and its outputs were written: "
                f"they are in {run_dir} ({', '.join(written)}); nothing to resume")
    return (f"{error} after its jobs ended ({ended}), while it wrote its outputs: {run_dir} "
            f"holds {', '.join(written)}, not {', '.join(missing)}; nothing to resume (the "
            f"jobs' results and the run's figures are in {METRICS_JSON}; run it again for "
            f"the rest)")


def _weights_not_saved(run_dir: Path) -> list[str]:
    """The ids of the jobs whose final weights a run stopped after its jobs ended should
    have saved (``run.save_weights``, by its ``config.yaml``) and did not: a cluster run
    saves them after the ranks hand them over, at its very end, so a Ctrl-C then left
    every job done, no ``weights/`` and no scores, and the line said "nothing to resume"
    where ``run.resume_finished=true`` restores them from the final checkpoints."""
    try:
        saved = OmegaConf.select(OmegaConf.load(run_dir / "config.yaml"), "run.save_weights",
                                 default=True)
        jobs = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))["jobs"]
        ids = [str(j["job_id"]) for j in jobs if j.get("status") == "done"]
    except Exception:  # noqa: BLE001 - no config or metrics of ours: nothing to say
        return []
    if not saved:
        return []
    return [i for i in ids if not (run_dir / WEIGHTS_DIR / f"{i}.pt").is_file()]


def unfinished_jobs(record: Any, run_dir: Path) -> str:
    """The error of a run some of whose jobs failed, were rejected or diverged (``""`` when
    every job finished on a finite loss): how many, the first one's reason, and where the
    outputs are."""
    unfinished = [j for j in record.jobs if j.status in ("failed", "rejected")]
    if unfinished:
        first = unfinished[0]
        return (f"{len(unfinished)} of {len(record.jobs)} jobs did not complete; "
                f"'{first.job.name}' {first.status}: {first.error} (outputs kept in {run_dir})")
    # trained to the end on a loss of nan: "done", and exit 0 let a CI step pass a plugin
    # that broke the numerics (the summary said so, in a line a pipeline does not read)
    diverged = [j for j in record.jobs if j.status == "done" and j.diverged_at is not None]
    if diverged:
        return (f"{len(diverged)} of {len(record.jobs)} jobs diverged; "
                f"{diverged_text(diverged[0])} (outputs kept in {run_dir})")
    return ""


def _severity(code: int) -> int:
    """``code``'s rank in :data:`EXIT_REASONS` (0: the most severe); a code not there ranks
    before all of them."""
    return list(EXIT_REASONS).index(code) if code in EXIT_REASONS else -1


def most_severe(codes: Sequence[int]) -> int:
    """The exit code of a sweep whose runs exited with ``codes``: the most severe non-zero
    one (:data:`EXIT_REASONS`), 0 when every run succeeded."""
    failed = [c for c in codes if c]
    return min(failed, key=_severity) if failed else 0


def sweep_inert_note(inert: Sequence[Sequence[str]], errors: Sequence[str] = ()) -> str:
    """A sweep's note naming the runs some of whose plugins changed nothing in them (their
    report rows say ``inert``), or ``""`` when none did (or it was one run, whose own report
    said so): a CI smoke sweep over plugin sets counted such a run as the plugin passing,
    where it exercised nothing of it. A run that failed (``errors``, each run's error, ``""``
    when it succeeded) is not named: its plugins' rows describe a run that did not complete,
    and the sweep's closing line names it as failed (the note called it inert as well)."""
    idle = [(k, names) for k, names in enumerate(inert)
            if names and not (k < len(errors) and errors[k])]
    if len(inert) < 2 or not idle:
        return ""
    shown = ", ".join(f"#{k} [{', '.join(names)}]" for k, names in idle[:10])
    more = ", ..." if len(idle) > 10 else ""
    return (f"{len(idle)} of {len(inert)} runs of the sweep had plugins that changed nothing "
            f"in them (their report rows say inert): {shown}{more}; those runs test nothing "
            "of those plugins on this workload")


def sweep_failures(errors: Sequence[str], codes: Sequence[int] = ()) -> str:
    """A sweep's closing line from each run's error (``""``: it succeeded), or ``""`` when
    no run failed (or it was one run, whose own line said it all): which runs failed and
    the first one's error, after every run, where a failed run's line would otherwise have
    scrolled away under the later runs' tables. Runs that failed for different reasons
    (``codes``, each run's exit code): the first error of each, the count per exit code,
    and which one the sweep exits with (a CI log said only the first reason, and the exit
    code was the last failing run's)."""
    failed = [k for k, line in enumerate(errors) if line]
    if len(errors) < 2 or not failed:
        return ""
    shown = ", ".join(f"#{k}" for k in failed[:10]) + (", ..." if len(failed) > 10 else "")
    by_code: dict[int, list[int]] = {}
    for k in failed:
        by_code.setdefault(codes[k] if k < len(codes) else 0, []).append(k)
    head = f"{len(failed)} of {len(errors)} runs of the sweep failed: {shown}"
    if len(failed) == 1:  # "#1 (#1: ...)": the one run's label said twice
        return f"{head} ({errors[failed[0]]})"
    if len(by_code) < 2:
        return f"{head} (#{failed[0]}: {errors[failed[0]]})"
    ranked = sorted(by_code, key=_severity)
    firsts = "; ".join(f"#{by_code[c][0]}: {errors[by_code[c][0]]}" for c in ranked)
    counts = ", ".join(f"{len(by_code[c])} exit {c} ({EXIT_REASONS.get(c, 'other')})"
                       for c in ranked)
    return f"{head} ({firsts}); {counts}; the sweep exits {ranked[0]}, the most severe"


@contextlib.contextmanager
def mode_from_the_command_line(args: list[str]) -> Iterator[None]:
    """Hydra composes the whole configuration once only to read ``hydra.mode`` before it
    composes it again to run (``Hydra.get_mode``; ~0.1 s of the command's start-up). This
    project's configs never set ``hydra.mode``, so unless the command line does, the mode is
    what ``-m`` says, which is what Hydra decides when ``get_mode`` answers ``None``: answer
    that without composing. Hydra's own ``get_mode`` is back when the command returns."""
    from hydra._internal.hydra import Hydra

    original = getattr(Hydra, "get_mode", None)
    if original is None or any(a.lstrip("+").startswith("hydra.mode=") for a in args):
        yield
        return
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = original  # type: ignore[method-assign]


def forget_hydra_run() -> None:
    """Hydra leaves the finished command's config in its process-wide ``HydraConfig``; a later
    ``accelopt.run`` in the same process (a notebook, a test session) would read that
    command's mode, and after a sweep skip its own ``run.compare`` references as if it were
    one of the sweep's runs."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None  # type: ignore[assignment]
