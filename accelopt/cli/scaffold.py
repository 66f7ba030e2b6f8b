"""``accelopt new-plugin NAME [--dir DIR]``: scaffold an installable third-party plugin.

The generated package is deliberately a *working* plugin (a config field, two hooks, a
report row, tests that pass) rather than a page of TODOs: a researcher starts from green
tests and changes one thing at a time. It is laid out exactly as a plugin published on
PyPI would be, so nothing changes between "my experiment" and "my release".

The file templates live in ``accelopt/cli/templates/plugin/`` (``string.Template``
syntax, ``$name``) and ship as package data.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import uuid
from importlib import resources
from pathlib import Path
from string import Template

import accelopt
from accelopt.errors import UserError
from accelopt.plugin import Registry, value_like_name

NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

# template file -> path inside the generated package (``{name}`` is the plugin name)
FILES: dict[str, str] = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "gitignore.tmpl": ".gitignore",
    "__init__.py.tmpl": "src/accelopt_{name}/__init__.py",
    "test_plugin.py.tmpl": "tests/test_{name}.py",
}


def new_plugin_command(args: list[str]) -> int:
    """Create ``DIR/accelopt-NAME/`` and print the next steps."""
    parser = argparse.ArgumentParser(
        prog="accelopt new-plugin",
        description="Scaffold an installable accelopt plugin package (accelopt-NAME).",
    )
    parser.add_argument("name", metavar="NAME", help="plugin name, a Python identifier")
    parser.add_argument("--dir", default=".", help="where to create accelopt-NAME/ (default: .)")
    opts = parser.parse_args(args)
    target = create_plugin(opts.name, Path(opts.dir))
    print(next_steps(opts.name, target))
    return 0


def create_plugin(name: str, directory: Path) -> Path:
    """Write the package for plugin ``name`` under ``directory``; return its root.

    The files are written into a temporary sibling folder that is renamed into place at
    the end, so a failure never leaves a half-written package behind.
    """
    check_name(name)
    target = directory.expanduser().resolve() / f"accelopt-{name}"
    if target.exists():
        raise UserError(
            f"{target} already exists; choose another NAME or --dir, or remove that directory"
        )
    if target.parent.exists() and not target.parent.is_dir():
        raise UserError(f"--dir {target.parent} is not a directory; pass a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # not tempfile.mkdtemp: its 0700 mode would end up on the package directory
        staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
        staging.mkdir()
    except OSError as exc:
        raise UserError(f"cannot create {target}: {exc.strerror or exc}; check --dir") from None
    try:
        for template, relative in FILES.items():
            path = staging / relative.format(name=name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render(template, name), encoding="utf-8")
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def check_name(name: str) -> None:
    """The name becomes a module (``accelopt_NAME``), an entry point, a Hydra config group
    entry and a ``plugins.NAME.key=value`` path, so it must be a plain identifier that no
    selection reads as a value (``+plugins=[true]`` is ``[True]``); and it must not shadow an
    installed plugin, which would make one of the two unreachable."""
    if not NAME_PATTERN.fullmatch(name):
        suggestion = re.sub(r"\W+", "_", name).strip("_")
        hint = f", e.g. {suggestion}" if suggestion and NAME_PATTERN.fullmatch(suggestion) else ""
        raise UserError(
            f"plugin name {name!r} must be a Python identifier (letters, digits and "
            f"underscores, starting with a letter){hint}"
        )
    refusal = value_like_name(name)
    if refusal is not None:  # the package would install, and no selection could name it
        raise UserError(refusal)
    from accelopt.testing.recorder import RECORDER_NAME

    if name == RECORDER_NAME:  # the generated tests would fail to add the plugin beside it
        raise UserError(f"plugin name '{name}' is reserved for accelopt.testing's HookRecorder; "
                        "choose another NAME")
    registry = Registry.discover(autoload=True)
    installed = registry.entry_points.get(name)
    if installed is not None:
        raise UserError(
            f"a plugin named '{name}' is already installed ({installed.value}); "
            "choose another NAME"
        )
    if name in registry.named:  # loaded by reference: the two would clash once this installs
        raise UserError(
            f"a plugin named '{name}' is already loaded from ACCELOPT_PLUGINS "
            f"({registry.named[name]}); choose another NAME"
        )
    module = f"accelopt_{name}"
    existing = existing_module(module)
    if existing is not None:  # `new-plugin plugins`: installing it overwrote accelopt's own
        raise UserError(
            f"plugin name '{name}' makes the module {module}, which already exists "
            f"({existing}): installing the package would shadow or overwrite it; choose "
            "another NAME"
        )


def existing_module(module: str) -> str | None:
    """Where the importable top-level module ``module`` is (``None`` when there is none):
    the generated package installs a module of that name, so an existing one (accelopt's
    own ``accelopt_plugins``, another package's) would be shadowed or overwritten."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a broken module is still a module of that name
        return "a module that fails to import"
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or ())
    return spec.origin if spec.origin not in (None, "namespace") else (
        locations[0] if locations else "a namespace package")


def render(template: str, name: str) -> str:
    """Fill one template. ``accelopt_requirement`` pins the generated package to this
    accelopt's minor series, whose plugin API it was generated against."""
    text = (resources.files("accelopt.cli") / "templates" / "plugin" / template).read_text(
        encoding="utf-8"
    )
    return Template(text).substitute(
        name=name,
        class_prefix=class_prefix(name),
        accelopt_requirement=accelopt_requirement(accelopt.__version__),
    )


def accelopt_requirement(version: str) -> str:
    """``0.1.0`` -> ``accelopt>=0.1,<0.2``: the minor series of ``version`` (a later minor
    release may change the plugin API the package was generated against)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:  # no X.Y: nothing to pin to but the version itself
        return f"accelopt>={version}"
    major, minor = int(match.group(1)), int(match.group(2))
    return f"accelopt>={major}.{minor},<{major}.{minor + 1}"


def class_prefix(name: str) -> str:
    """``my_sched`` -> ``MySched`` (for ``MySchedPlugin`` and ``MySchedConfig``)."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def next_steps(name: str, target: Path) -> str:
    try:
        shown = target.relative_to(Path.cwd())
    except ValueError:
        shown = target
    return "\n".join(
        [
            f"created {shown}/ (plugin '{name}', module accelopt_{name})",
            "next steps:",
            f"  cd {shown}",
            "  pip install -e '.[test]'        # registers the entry point",
            "  pytest                          # conformance suite + the example tests",
            "  accelopt plugins                # lists the new plugin",
            f"  accelopt run '+plugins=[{name}]' workload=tiny",
            f"then edit src/accelopt_{name}/__init__.py and fill in README.md (the method card).",
        ]
    )
