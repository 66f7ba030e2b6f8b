"""One line for each configuration mistake, with its fix: Hydra's and OmegaConf's errors
(an unknown key, a wrong type, several values outside a sweep, a group added twice or
force-added, an override its grammar cannot read), a setting given a ``+`` its plugin's
config already has, and Hydra's config flags naming what is not there. Kept apart from
composing (``hydra_run``) so the wording has one home."""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from accelopt.errors import ConfigError, did_you_mean, first_line, one_line
from accelopt.plugin import Registry

HYDRA_PASSTHROUGH_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c",
                           "--resolve", "--package", "-p", "--shell-completion", "-sc")


def config_dir() -> str:
    """The directory of ``configs/``: in a checkout, an editable or a wheel install alike."""
    import accelopt.configs

    return str(Path(accelopt.configs.__file__).parent)


def first_line_of(exc: BaseException) -> str:
    """The error's first line, or its type's name where it has no text."""
    return first_line(exc) or type(exc).__name__


def describe_config_error(exc: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line naming the key and what was expected, from Hydra/OmegaConf's errors
    (``overrides``: the command line's, for the fix of a mistake Hydra names only in part)."""
    ambiguous = re.search(r"Ambiguous value for argument '(.*)'", str(exc))
    if ambiguous:
        return _several_values_message(ambiguous.group(1))
    twice = re.search(r"Multiple values for ([\w/.]+)\. To override a value use 'override "
                      r"[\w/.]+: (.*)'", str(exc))
    if twice and f"+{twice.group(1)}={twice.group(2)}" in overrides:
        group, value = twice.groups()
        return (f"'+{group}={value}': {group} is in accelopt's defaults list already (null "
                f"unless chosen), so the + adds it a second time; drop the +: {group}={value}")
    forced = re.search(r"force-add of config groups is not supported: '(.*)'", str(exc))
    forced_line = force_added_group_message(forced.group(1)) if forced else None
    if forced_line:
        return forced_line
    cause: Any = exc
    while getattr(cause, "__cause__", None) is not None:
        cause = cause.__cause__
    key = getattr(cause, "full_key", None)
    message = first_line_of(cause if cause is not exc else exc)
    if "raised while composing config:" in message:  # the reason is on the next lines
        return _joined(str(exc))
    if getattr(cause, "problem_mark", None) is not None:  # YAML: the file, line and problem
        return f"a YAML file does not parse: {_joined(str(cause))}"
    element = re.fullmatch(r"workload\.jobs\[(\d+)\]", str(key or ""))
    if element:
        line = _job_element_message(element.group(1), message)
        if line:
            return line
    removed = _removed_element_message(exc, overrides)
    if removed:
        return removed
    missing = re.search(r"Could not find '(\w+)/([^']+)'", str(exc))
    if missing:
        return _unknown_option_message(missing.group(1), missing.group(2))
    if "Could not override" in str(exc) or "Could not append" in str(exc):
        unknown = re.search(r"Could not override '([\w.]+)'", str(exc))
        if unknown:
            return (_unknown_element_key_message(unknown.group(1), key)
                    or unknown_key_message(_deepest_key(unknown.group(1), key)))
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return "; ".join(lines[:2])
    return f"{key}: {message}" if key else message


OVERRIDE_FORM = ("an override is key=value (a list: key=[a,b]; plugins: +plugins=[a,b]), "
                 "quoted for the shell where it holds a space or brackets: 'key=[a, b]'")
"""What every override that does not parse is told, after what is wrong with it."""

PAIRS = {"[": "]", "{": "}", "(": ")"}


def describe_override_parse_error(override: str, reason: str) -> str:
    """One line for an override Hydra's grammar cannot read (``reason``: Hydra's message):
    it named neither the override nor the fix ("no viable alternative at input '[1'"), or
    the override only ("Error parsing override 'run.seed==1'"), the reason on later lines.
    Said here: the override, what in it is wrong (no '=', two, a bracket or a quote left
    open, a character the grammar takes only quoted) and :data:`OVERRIDE_FORM`."""
    where = f"cannot read the override '{override}'"
    key, eq, value = override.partition("=")
    if not eq:
        return f"{where}: it has no '=' ({key}=VALUE sets a key); {OVERRIDE_FORM}"
    if value.startswith("="):
        return f"{where}: '=' twice; write one: {key}={value.lstrip('=')}"
    unpaired = _unpaired(value)
    if unpaired:
        return f"{where}: {unpaired}; {OVERRIDE_FORM}"
    character = _unreadable_character(override, reason)
    if character is not None and len(character) == 1 and override.find(character) < len(key):
        return (f"{where}: its key {key!r} is not names joined by single dots (run.seed; a "
                f"leading + adds a key, ~ removes one); {OVERRIDE_FORM}")
    if character is not None:
        quote = '"' if "'" in value else "'"
        shell = "'" if quote == '"' else '"'
        return (f"{where}: Hydra reads {character!r} in a value only inside quotes; quote the "
                f"value for Hydra, and that for the shell: {shell}{key}={quote}{value}{quote}"
                f"{shell}")
    return f"{where}: {first_line(reason) or reason}; {OVERRIDE_FORM}"


def _unpaired(value: str) -> str | None:
    """The first bracket or quote of an override's value that is not paired (outside
    quotes), said as what is wrong with it; None where every one is."""
    opened: list[str] = []
    quote = None
    for character in value:
        if quote is not None:
            quote = None if character == quote else quote
        elif character in "'\"":
            quote = character
        elif character in PAIRS:
            opened.append(character)
        elif character in PAIRS.values():
            if not opened or PAIRS[opened[-1]] != character:
                return f"a '{character}' closes nothing"
            opened.pop()
    if quote is not None:
        return f"a {quote} quote is never closed"
    if opened:
        return f"a '{opened[-1]}' is never closed"
    return None


def _unreadable_character(override: str, reason: str) -> str | None:
    """What Hydra's grammar stopped at: the character its lexer's caret points to, or the
    token of an "extraneous/mismatched input 'X'" or "no viable alternative at input 'X'"
    (its last character: the one that made it unreadable); None where it names neither."""
    lines = reason.splitlines()
    prefix = "LexerNoViableAltException: "
    if len(lines) >= 2 and lines[0].startswith(prefix) and lines[1].strip() == "^":
        at = len(lines[1]) - 1 - len(prefix)
        return override[at] if 0 <= at < len(override) else None
    token = re.search(r"(?:extraneous|mismatched) input '(.+?)' expecting", reason)
    if token:
        return token.group(1)
    token = re.search(r"no viable alternative at input '(.+?)'", reason)
    return token.group(1)[-1] if token else None


def force_added_group_message(line: str) -> str | None:
    """``++plugins=salus``: Hydra refuses ``++`` for a config group ("force-add of config
    groups is not supported"), naming no fix. A group's option is selected without it:
    plugins as a list added with one +, the groups of accelopt's defaults list (workload,
    experiment, Hydra's own) with none. None for a line that is not a ``++group=value``."""
    found = re.fullmatch(r"\+\+([\w/.]+)=(.*)", line)
    if not found:
        return None
    group, value = found.groups()
    if group == "plugins":
        names = value.strip().removeprefix("[").removesuffix("]")
        fix = f"+plugins=[{names}]"
    else:
        fix = f"{group}={value}"
    return (f"'{line}': ++ (force-add) sets keys, not config groups; select {group} with "
            f"{fix}")


WHOLE_JOBS = ("give the whole list, one mapping per job: "
              "workload.jobs=[{name: a, model: mlp},{name: b, model: cnn}]")
"""The fix of every mistake about the elements of ``workload.jobs`` (a list of jobs is
given whole: OmegaConf neither grows nor shrinks it by index)."""


def _job_element_message(index: str, message: str) -> str | None:
    """``workload.jobs.N`` refused by OmegaConf: a key set in a job past the end (it made
    an empty mapping there), a job added by index, or an element that is not a job mapping
    (``workload.jobs=[5]``, ``[null]``). Each says which, and that the fix is the whole
    list; None for any other error at that key."""
    if "Invalid type assigned: dict is not a subclass of JobConfig" in message:
        return (f"workload.jobs.{index} is not a job of this workload (it has fewer); set a key "
                f"of an existing job, or {WHOLE_JOBS}")
    if "list index out of range" in message:
        return (f"workload.jobs.{index}: a job cannot be added by its index (the workload has "
                f"fewer jobs); {WHOLE_JOBS}")
    given = re.search(r"is not a subclass of JobConfig\. value: (.*)", message)
    if given or "cannot be assigned None" in message:
        value = "null" if given is None or given.group(1) == "None" else given.group(1).strip()
        return (f"workload.jobs.{index} is {value}, not a job: every element must be a job "
                f"mapping; {WHOLE_JOBS}")
    return None


def _removed_element_message(exc: BaseException, overrides: Sequence[str]) -> str | None:
    """``~workload.jobs.1``: Hydra deletes by key, and a list's index is not one (its
    error was Python's "list indices must be integers or slices, not str")."""
    if "list indices must be integers" not in str(exc):
        return None
    for override in overrides:
        found = re.fullmatch(r"~([\w.]+)\.(\d+)(=.*)?", override)
        if found:
            fix = (WHOLE_JOBS.replace("the whole list", "the whole list without it", 1)
                   if found.group(1) == "workload.jobs"
                   else f"give the whole list without it: {found.group(1)}=[...]")
            return f"'{override}': an element of a list cannot be removed by its index; {fix}"
    return None


def _several_values_message(override: str) -> str:
    """``+plugins=salus,tictac`` outside a sweep: Hydra's first line named the override only
    (its fixes were on the lines after it). Plugins: the list that selects them all."""
    key, _, value = override.partition("=")
    if key.lstrip("+~") == "plugins" and "[" not in value:
        return (f"'{override}' lists several plugins without brackets; select them all with "
                f"{key}=[{value}] (or run one each as a sweep: add -m)")
    line = f"'{override}' gives several values outside a sweep: add -m to run one each"
    if "[" in value or "{" in value:  # lists or mappings: only a sweep takes several
        return line
    return f"{line}, give a list ({key}=[{value}]), or quote them for one string ({key}='{value}')"


def _deepest_key(overridden: str, missing: Any) -> str:
    """The key to name for an override Hydra could not apply: the unknown key inside it
    where OmegaConf says which (``plugins.salus={policy: fifo, bogus: 2}`` is refused for
    ``plugins.salus.bogus``, and naming ``plugins.salus`` sent a user looking for a typo in
    the plugin's name), else the override's own key."""
    missing = str(missing or "")
    return missing if missing.startswith(f"{overridden}.") else overridden


def _unknown_element_key_message(overridden: str, missing: Any) -> str | None:
    """A whole value given for a list of jobs or one job (``workload.jobs=[{name: a, lrr: 1}]``,
    ``workload.jobs.0={...}``) with a key the job has not: OmegaConf names the bare key
    (``lrr``), so name it in its job, with the closest field; None for any other case."""
    if not re.fullmatch(r"workload\.jobs(\.\d+)?", overridden):
        return None
    missing = re.sub(r"\[(\d+)\]", r".\1", str(missing or ""))
    missing = missing.removeprefix(f"{overridden}.")
    if not missing or "." in missing:
        return None
    fields = _schema_fields(overridden) or _schema_fields(f"{overridden}.0")
    if not fields or missing in fields:
        return None
    where = overridden if overridden.split(".")[-1].isdigit() else f"a job of {overridden}"
    where = f"job {overridden}" if where == overridden else where
    return (f"unknown config key '{missing}' in {where}{did_you_mean(missing, fields)} "
            f"(its keys: {', '.join(fields)})")


def _unknown_option_message(group: str, name: str) -> str:
    """``workload=nosuch``: the options of the group (the YAML files of ``configs/<group>``),
    and the closest one."""
    options = sorted(p.stem for p in (Path(config_dir()) / group).glob("*.yaml"))
    listed = f" ({group}s: {', '.join(options)})" if options else ""
    return f"no {group} '{name}'{did_you_mean(name, options)}{listed}"


def unknown_key_message(key: str) -> str:
    """'run.sed' -> "unknown config key 'run.sed'; did you mean 'run.seed'?" (from the schema
    or, for ``plugins.NAME.*``, from the plugin's config dataclass)."""
    parent, _, leaf = key.rpartition(".")
    parts = key.split(".")
    if key == "plugins":
        return ("plugins are selected with a leading +: +plugins=[salus] (several: "
                "+plugins=[salus,tictac]); plugins.NAME.key=value then sets their options")
    if parts[0] == "plugins" and len(parts) >= 2:
        # a valid option of a plugin (or any option of one whose config is not even known)
        # that Hydra cannot set: the plugin is not selected
        known = _schema_fields(f"plugins.{parts[1]}")
        if not known or (len(parts) == 3 and parts[2] in known):
            return _unselected_plugin_message(key, parts[1])
    fields = _schema_fields(parent)
    if leaf in fields and parts[0] != "plugins":  # it exists, but cannot be replaced whole
        return f"'{key}' cannot be set this way; set its keys instead ({key}.<key>=value)"
    shown = parent or "the config"
    hint = did_you_mean(leaf, fields, f"{parent}." if parent else "")
    known = f" (keys of {shown}: {', '.join(fields)})" if fields else ""
    return f"unknown config key '{key}'{hint}{known}"


def _unselected_plugin_message(key: str, name: str) -> str:
    """``plugins.salus.policy=srtf`` without ``+plugins=[salus]``: say to select it."""
    installed = Registry.discover().names()
    if name in installed:
        return (f"'{key}' sets an option of plugin '{name}', which this run does not select; "
                f"add +plugins=[{name}] (or list it among the others)")
    hint = did_you_mean(name, installed)
    return (f"unknown config key '{key}': no plugin '{name}' is installed{hint} (installed: "
            f"{', '.join(installed)})")


def _schema_fields(path: str) -> list[str]:
    from hydra.core.config_store import ConfigStore

    from accelopt.config import AccelConfig

    parts = path.split(".") if path else []
    node: Any = AccelConfig
    if parts[:1] == ["plugins"] and len(parts) >= 2:
        stored = ConfigStore.instance().repo.get("plugins", {}).get(f"{parts[1]}.yaml")
        node = getattr(stored, "node", None)
        parts = parts[2:]
        if node is None:
            return []
        node = OmegaConf.to_object(node) if not isinstance(node, type) else node
        node = type(node) if not isinstance(node, type) else node
    for part in parts:
        if part.isdigit() and typing.get_origin(node) is list:
            node = typing.get_args(node)[0]
            continue
        try:
            hints = typing.get_type_hints(node)
        except Exception:
            return []
        if part not in hints:
            return []
        node = hints[part]
        if typing.get_origin(node) is typing.Union:  # Optional[X]
            node = next(a for a in typing.get_args(node) if a is not type(None))
    return sorted(getattr(node, "__dataclass_fields__", {}))


def _joined(text: str) -> str:
    """A several-line Hydra/OmegaConf/YAML message as one line: its lines joined, without
    OmegaConf's ``reference_type=``/``object_type=`` lines."""
    return one_line("\n".join(ln for ln in text.splitlines() if not ln.strip().startswith(
        ("reference_type=", "object_type="))))


def refuse_added_setting_of_a_selected_plugin(overrides: Sequence[str],
                                              selections: Sequence[Sequence[str]]) -> None:
    """``+plugins.salus.policy=srtf`` where the command selects salus (in a sweep, some of
    its points): the ``+`` adds a key, which the selected plugin's node already has (Hydra
    refuses it), and a sweep's points without salus were told to select it. Without the
    ``+`` the setting reaches every point that selects the plugin
    (:mod:`accelopt.cli.sweep_settings`)."""
    selected = {name for names in selections for name in names}
    for override in overrides:
        if not override.startswith("+") or override.startswith("++"):
            continue
        name = override[1:].partition("=")[0].split(".")
        if len(name) < 2 or name[0] != "plugins" or name[1] not in selected:
            continue
        if len(name) == 2 or name[2] in _schema_fields(f"plugins.{name[1]}"):  # else a typo
            reach = " (it reaches the points of the sweep that select it)" \
                if len(selections) > 1 else ""
            raise ConfigError(f"'{override}' sets an option of plugin '{name[1]}', which is "
                              f"selected, and a + adds a key its config has already: drop "
                              f"the +: {override[1:]}{reach}")


CONFIG_FLAGS = {"--config-path": "config-path", "-cp": "config-path",
                "--config-dir": "config-dir", "-cd": "config-dir",
                "--config-name": "config-name", "-cn": "config-name"}
"""Hydra's flags that choose where configs are read (``--flag VALUE`` or ``--flag=VALUE``)."""


def config_flags(args: Sequence[str]) -> dict[str, list[str]]:
    """The values of :data:`CONFIG_FLAGS` on a command line, by flag (its long name)."""
    found: dict[str, list[str]] = {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        found.setdefault(CONFIG_FLAGS[flag], []).append(value)
    return found


def refuse_bad_config_flags(args: Sequence[str]) -> None:
    """``--config-dir``, ``--config-path`` or ``--config-name`` naming what is not there:
    one line naming the flag and the fix, exit 2, before anything is composed (Hydra printed
    a warning with its own file's path, then a several-line error, exit 1). Where Hydra
    looks: ``--config-dir`` from the working directory, ``--config-path`` as given (``accelopt
    run`` has made a relative one absolute from the working directory:
    ``main.primary_config_flags``), and ``--config-name`` in the primary directory and every
    ``--config-dir``."""
    flags = config_flags(args)
    dirs = flags.get("config-dir", [])
    for directory in dirs:
        if not Path(directory).expanduser().is_dir():
            raise ConfigError(f"--config-dir {directory}: no such directory; give the "
                              "directory of your own configs (its workload/NAME.yaml, "
                              "experiment/NAME.yaml are then found beside accelopt's)")
    primary = config_dir()
    for path in flags.get("config-path", [])[-1:]:
        if path.startswith("pkg://"):
            return  # a package's configs: Hydra's to find
        primary = os.path.normpath(os.path.abspath(path))
        if not Path(primary).is_dir():
            raise ConfigError(f"--config-path {path}: no such directory; to add configs of "
                              "your own, give --config-dir DIR (accelopt's stay found)")
    for name in flags.get("config-name", [])[-1:]:
        stem = name.removesuffix(".yaml")
        if not any((Path(d).expanduser() / f"{stem}.yaml").is_file() for d in [primary, *dirs]):
            looked = ", ".join("accelopt's configs" if d == config_dir() else d
                               for d in [primary, *dirs])
            raise ConfigError(f"--config-name {name}: no {stem}.yaml in {looked}; drop "
                              "--config-name (accelopt run reads its config.yaml) or name a "
                              "config of --config-dir DIR")
