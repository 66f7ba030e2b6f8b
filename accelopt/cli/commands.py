"""``accelopt plugins`` and ``accelopt matrix``."""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from accelopt.errors import PluginResolutionError, UserError, listed
from accelopt.plugin import (
    EXPLICIT_PLUGINS_ENV,
    PluginSpec,
    Registry,
    is_builtin,
    valid_combinations,
)
from accelopt.report.console import default_console


def list_plugins(args: list[str]) -> int:
    """The installed plugins: what each does and how it combines with others."""
    parser = argparse.ArgumentParser(prog="accelopt plugins", description=list_plugins.__doc__)
    parser.add_argument("--format", choices=("table", "plain", "json"), default=None,
                        help="table (a terminal's default), plain (one block per plugin, full "
                        "names; the default in a pipe), json (machine-readable)")
    parser.add_argument("--json", action="store_true", help="the same as --format json")
    opts = parser.parse_args(args)
    registry = Registry.discover()
    specs = registry.all()
    fmt = "json" if opts.json else opts.format or ("table" if sys.stdout.isatty() else "plain")
    described = [_describe(s, registry) for s in specs]
    if fmt == "json":  # the broken ones too: a CI step reading this must see them
        broken = [{"name": name, "broken": reason}
                  for name, reason in sorted(registry.broken.items())]
        print(json.dumps([{**d, "broken": None} for d in described] + broken, indent=2))
        return 0
    console = default_console()
    if fmt == "plain":
        for d in described:
            print(f"{d['name']}: {d['description']}")
            for key in ("slots", "requires", "conflicts"):
                if d[key]:
                    print(f"  {key}: {', '.join(d[key])}")
            if d["order"]:
                print(f"  order: {d['order']}")
            print(f"  source: {d['source']} ({d['origin']})")
    else:
        table = Table(title="installed accelopt plugins (installed is not enabled: "
                      "+plugins=[...])")
        # names never wrap (a narrow terminal folds the description instead)
        table.add_column("name", no_wrap=True, min_width=max([4, *(len(d["name"]) for d in described)]))
        for column in ("description", "slots", "requires", "conflicts", "order", "source"):
            table.add_column(column, overflow="fold")
        for d in described:
            table.add_row(d["name"], d["description"], ", ".join(d["slots"]),
                          ", ".join(d["requires"]), ", ".join(d["conflicts"]), d["order"],
                          f"{d['source']} ({d['origin']})")
        console.print(table)
    for name, reason in sorted(registry.broken.items()):
        print(f"broken {name}: {reason}", file=sys.stderr)
    if not specs:
        print("no plugins installed (or ACCELOPT_DISABLE_PLUGIN_AUTOLOAD is set)")
    return 0


def _describe(spec, registry: Registry) -> dict:
    ep = registry.entry_points.get(spec.name)
    order = " ".join([*(f"before:{n}" for n in spec.before), *(f"after:{n}" for n in spec.after)])
    return {
        "name": spec.name,
        "description": spec.description,
        "slots": list(spec.slots),
        "requires": list(spec.requires),
        "conflicts": list(spec.conflicts),
        "order": order,
        # where it is loaded from; "origin" says how (built-in, a package, the variable)
        "source": (ep.value if ep is not None else registry.named.get(spec.name, "added in code")),
        "origin": _origin(spec.name, registry),
    }


def _origin(name: str, registry: Registry) -> str:
    """built-in, ``package NAME``, ACCELOPT_PLUGINS or ``added in code``: which plugin of a
    name is the one listed, beside the ones refused for taking it (listed as broken)."""
    ep = registry.entry_points.get(name)
    if name in registry.named:
        return EXPLICIT_PLUGINS_ENV
    if ep is None:
        return "added in code"
    return "built-in" if is_builtin(ep) else f"package {ep.dist.name if ep.dist else '?'}"


def matrix(args: list[str]) -> int:
    """Valid plugin combinations as a GitHub Actions matrix (JSON) or a Hydra sweep."""
    parser = argparse.ArgumentParser(
        prog="accelopt matrix", description=matrix.__doc__,
        epilog="Give the overrides the runs will get (workload=tiny cluster.mode=ps ...): "
        "each set is checked against that configuration as `accelopt run` checks it before "
        "training, and the sets it would refuse are left out (named on stderr).")
    parser.add_argument("--plugins", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--max-size", type=int, default=None, help="largest combination size")
    parser.add_argument("--format", choices=("json", "hydra"), default="json",
                        help="json: {'include': [...]} for strategy.matrix; hydra: a -m override")
    parser.add_argument("--no-check", action="store_true",
                        help="list every set the plugins' requires/conflicts/slots allow, "
                        "without configuring it against the configuration")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides the runs will get, "
                        "before, between or after the options")
    # intermixed: `workload=tiny --max-size 1 run.seed=1` is one command line (parse_args
    # would take the overrides after an option for unrecognized arguments)
    opts = parser.parse_intermixed_args(args)
    if opts.max_size is not None and opts.max_size < 0:
        raise UserError("--max-size must be >= 0")
    chosen = [o for o in opts.overrides if o.lstrip("+~").startswith("plugins=")]
    if chosen:
        raise UserError(f"accelopt matrix chooses the plugin sets itself: drop '{chosen[0]}' "
                        "(--plugins a,b restricts the plugins it combines)")
    names = plugin_list(opts.plugins, "matrix") if opts.plugins is not None else []
    registry = Registry.discover()
    specs = [registry.get(n) for n in names] if names else registry.all()
    kept = _combinable(specs, registry, check=not names)
    combos = valid_combinations(kept, opts.max_size)
    _say_in_no_set(kept, combos, opts.max_size)
    if opts.no_check:
        _check_overrides(combos, opts.overrides, registry)
    else:
        combos = _runnable(combos, opts.overrides, registry)
    if opts.format == "hydra":
        print("+plugins=" + ",".join(f"[{','.join(c)}]" for c in combos))
    else:
        include = [{"name": "+".join(c) or "baseline", "plugins": f"[{','.join(c)}]"}
                   for c in combos]
        print(json.dumps({"include": include}))
    return 0


def plugin_list(text: str, command: str) -> list[str]:
    """The names of a ``--plugins a,b`` list, or one line saying its format: an empty list
    (``--plugins ''``) read as "no subset", i.e. every plugin, and an empty item (``a,,b``,
    ``,a``) was dropped in silence, where a mistyped list should be said, as ``--sets`` says
    its format. ``command`` is the ``accelopt`` command named in the example."""
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or not all(names):
        what = "is empty" if not text.strip() else "has an empty item"
        raise UserError(f"--plugins {what} ({text!r}): give comma-separated plugin names, "
                        f"e.g. accelopt {command} --plugins clip,noop (`accelopt plugins` "
                        "lists them)")
    return names


def _say_in_no_set(kept: list[PluginSpec], combos: list[list[str]],
                   max_size: int | None) -> None:
    """Name on stderr each plugin the matrix combines that is in none of ``combos``: its
    smallest set (itself with everything it requires, transitively) is larger than
    ``--max-size``, or cannot resolve (a conflict, a shared slot). It disappeared without a
    line, where a plugin whose ``requires`` is not among them is named. ``--max-size 0``
    asks for the baseline alone: no plugin is missed there, nothing is said."""
    from accelopt.plugin import resolve

    if max_size == 0:
        return
    listed_names = {n for c in combos for n in c}
    pool = {s.name: s for s in kept}
    for spec in kept:
        if spec.name in listed_names:
            continue
        smallest, absent, todo = [spec.name], [], list(spec.requires)
        while todo:  # the plugins any set holding it must hold
            need = todo.pop(0)
            if need not in pool:
                absent.append(need)
            elif need not in smallest:
                smallest.append(need)
                todo.extend(pool[need].requires)
        label = f"[{','.join(smallest)}]"
        if absent:  # a plugin it requires was left out itself (named above)
            reason = f"it requires {', '.join(dict.fromkeys(absent))}, which is left out"
        else:
            try:
                resolve(smallest, Registry(loaded=dict(pool)))
            except PluginResolutionError as exc:
                reason = f"its smallest set {label} cannot be selected: {exc}"
            else:
                reason = (f"its smallest set {label} has {len(smallest)} plugins; give "
                          f"--max-size {len(smallest)} (or more) to list it"
                          if max_size is not None and len(smallest) > max_size
                          else f"it is in no set ({label})")
        print(f"left out plugin '{spec.name}': {reason}", file=sys.stderr)


def _check_overrides(combos: list[list[str]], overrides: list[str],
                     registry: Registry) -> None:
    """``--no-check``: the overrides are still parsed and composed once, with every plugin
    of ``combos`` selected (a typo, an unknown group option or a plugin setting of the wrong
    type is one line, exit 2, as without it); only configuring each set is skipped."""
    from accelopt.cli.hydra_run import composed_with_every_plugin

    composed_with_every_plugin(combos, overrides, registry)


def _combinable(specs: list[PluginSpec], registry: Registry, *, check: bool) -> list[PluginSpec]:
    """The plugins a matrix can combine; each left out is named on stderr: one whose
    ``requires`` is not among them (it would never appear in a set), and, of every
    installed plugin (``check``: no ``--plugins``), one whose config is no schema (it would
    fail every set; a plugin asked for by name fails the command instead)."""
    from accelopt.config import register_plugin_configs  # hydra: only where it is needed

    names = {s.name for s in specs}
    kept = []
    for spec in specs:
        missing = [r for r in spec.requires if r not in names]
        if missing:
            installed = all(r in registry.names() for r in missing)
            fix = "add it to --plugins" if installed else "which is not installed"
            print(f"left out plugin '{spec.name}': it requires {', '.join(missing)}, {fix}",
                  file=sys.stderr)
            continue
        if check:
            try:
                register_plugin_configs([spec])
            except PluginResolutionError as exc:
                print(f"left out {exc}", file=sys.stderr)
                continue
        kept.append(spec)
    return kept


def _runnable(combos: list[list[str]], overrides: list[str],
              registry: Registry) -> list[list[str]]:
    """The combinations ``accelopt run`` would accept with ``overrides``: one composition with
    every plugin selected, then each set configured as the run's up-front validation does it.
    The rest are named on stderr, one line per reason. A set refused only for a plugin
    setting the user gave (``plugins.clip.max_norm=-1``) is the user's mistake, as
    ``accelopt run`` says with exit 2: refused in one line, not left out (the matrix dropped
    the plugin and exited 0)."""
    from accelopt.cli.hydra_run import composed_with_every_plugin
    from accelopt.runtime.run import refused_sets

    cfg = composed_with_every_plugin(combos, overrides, registry)
    setting = " ".join(overrides) or "the default configuration"
    if len(combos) > 100:  # tens of milliseconds a set: say why the command takes a while
        print(f"checking {len(combos)} sets against {setting} (--max-size N checks fewer, "
              "--no-check none) ...", file=sys.stderr)
    refused = refused_sets(cfg, registry, [tuple(c) for c in combos])
    refuse_plugin_settings(refused, overrides, registry)
    say_left_out(refused, setting)
    return [c for c in combos if tuple(c) not in refused]


def say_left_out(refused: dict[tuple[str, ...], str], setting: str) -> None:
    """One stderr line per reason naming the sets ``setting`` (the overrides, as written)
    refuses: what ``accelopt matrix`` and ``accelopt bench --plugins`` leave out of "every
    valid combination", said rather than dropped."""
    by_reason: dict[str, list[str]] = {}
    for combo, reason in refused.items():
        by_reason.setdefault(reason, []).append(f"[{','.join(combo)}]")
    for reason, labels in by_reason.items():
        print(f"left out {len(labels)} set(s) that {setting} refuses ({listed(labels)}): {reason}",
              file=sys.stderr)


def _plugin_settings(overrides: list[str]) -> list[str]:
    """The overrides that set a plugin's settings (``plugins.NAME.key=value``)."""
    return [o for o in overrides if o.lstrip("+~").startswith("plugins.")]


def refuse_plugin_settings(refused: dict[tuple[str, ...], str], overrides: list[str],
                            registry: Registry) -> None:
    """Raise a :class:`UserError` naming the first reason where a set in ``refused`` is
    accepted once the plugin settings the user gave are taken away: those settings are what
    it refuses, a mistake to fix, not a set to leave out."""
    given = _plugin_settings(overrides)
    if not refused or not given:
        return
    from accelopt.cli.hydra_run import composed_with_every_plugin
    from accelopt.runtime.run import refused_sets

    rest = [o for o in overrides if o not in given]
    sets = [list(c) for c in refused]
    still = refused_sets(composed_with_every_plugin(sets, rest, registry), registry,
                         list(refused))
    mistaken = [c for c in refused if c not in still]
    if mistaken:
        labels = [f"[{','.join(c)}]" for c in mistaken if refused[c] == refused[mistaken[0]]]
        raise UserError(f"{refused[mistaken[0]]} (given {' '.join(given)}; refused by "
                        f"{listed(labels)}): fix the setting, or drop it")
