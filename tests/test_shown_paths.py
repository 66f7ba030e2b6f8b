"""What a user reads and copies: the run directory and a reference run's directory are shown
relative to the working directory when they lie under it (as the README shows them), any
other as it is; and a model reference whose own package is not on the import path says how
to put it there (the ``accelopt`` command does not add the working directory)."""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path

import pytest
from clirun import accelopt_in_process, the_error_line
from rich.console import Console

from accelopt.workloads.refs import resolve_ref

FAST = ["workload=tiny", "run.progress=false", "run.telemetry_interval_s=5", "run.profile=false",
        "workload.jobs.0.iterations=2", "workload.jobs.1.iterations=2"]
"""The tiny workload, two iterations a job: each run well under a second on a CPU."""

HINT = ("on the import path (PYTHONPATH=<that directory> accelopt run ...): accelopt run does "
        "not import from the directory it was started in")


def _printed_run(run_dir: Path, overrides: list[str]) -> str:
    """``execute`` into ``run_dir`` (noop selected): what it printed, one line per line."""
    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_plugin_configs, register_schema
    from accelopt.plugin import Registry
    from accelopt.runtime.run import execute

    registry = Registry.discover()
    register_schema()
    register_plugin_configs([registry.get("noop")])
    cfg = compose_checked(["+plugins=[noop]", *FAST, *overrides])
    out = io.StringIO()
    execute(cfg, run_dir=run_dir, registry=registry, console=Console(file=out, width=400))
    return out.getvalue()


@pytest.mark.timeout(60)
def test_a_run_under_the_working_directory_is_shown_relative(tmp_path, monkeypatch):
    """The default ``runs/<date>/<time>`` was printed with the whole working directory in
    front, in the run directory line and run.compare's "... first (<where>)" line."""
    monkeypatch.chdir(tmp_path)
    printed = _printed_run(tmp_path / "runs" / "d" / "t", ["run.compare=baseline"])
    assert "run directory: runs/d/t\n" in printed
    assert "running the same workload with no plugins first (runs/d/t/compare/baseline)" \
        in printed
    assert str(tmp_path) not in printed


def test_shown_path_forms(tmp_path, monkeypatch):
    """Relative (given either way) under the working directory, absolute elsewhere (a
    '../' path would have to be read against where the user stands), including a path that
    leaves it through '..'."""
    from accelopt.runtime.run_dir import shown_path

    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / "runs" / "a") == "runs/a"
    assert shown_path("runs/a") == "runs/a"
    assert shown_path(tmp_path) == "."
    assert shown_path(tmp_path / ".." / "x") == str(tmp_path.parent / "x")
    assert shown_path("/") == "/"


@pytest.fixture
def no_cwd_on_path(monkeypatch):
    """The import path of the ``accelopt`` command: no entry that means the working
    directory (``python -m pytest`` may have put one there)."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    importlib.invalidate_caches()


def _package(root: Path, name: str, nets: str = "def make_net(**kw):\n    return None\n") -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "nets.py").write_text(nets)


@pytest.mark.usefixtures("no_cwd_on_path")
def test_a_package_not_on_the_import_path_says_how_to_put_it_there(tmp_path, monkeypatch):
    """"cannot import 'mypkg.nets' (No module named 'mypkg')" with a package beside the
    user: nothing said the command does not look in the working directory."""
    _package(tmp_path, "shown_paths_pkg_a")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        resolve_ref("shown_paths_pkg_a.nets:make_net", "model")
    line = str(info.value)
    assert line == ("model reference 'shown_paths_pkg_a.nets:make_net': cannot import "
                    "'shown_paths_pkg_a.nets' (No module named 'shown_paths_pkg_a')"
                    f"; install it, or put the directory holding shown_paths_pkg_a/ {HINT}")
    with pytest.raises(ValueError, match=r"holding shown_paths_mod_a\.py or shown_paths_mod_a/"):
        resolve_ref("shown_paths_mod_a:make_net", "model")  # a module, not a package


@pytest.mark.usefixtures("no_cwd_on_path")
def test_a_missing_dependency_is_named_without_the_hint(tmp_path, monkeypatch):
    """The user's module found, one it imports missing (or a submodule of the package):
    that module is named, and the import path is not the fix."""
    _package(tmp_path, "shown_paths_pkg_b", nets="import shown_paths_no_such_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        resolve_ref("shown_paths_pkg_b.nets:make_net", "model")
    line = str(info.value)
    assert "(No module named 'shown_paths_no_such_dep')" in line
    assert "PYTHONPATH" not in line
    with pytest.raises(ValueError) as info:
        resolve_ref("shown_paths_pkg_b.nope:make_net", "model")
    assert "No module named 'shown_paths_pkg_b.nope'" in str(info.value)
    assert "PYTHONPATH" not in str(info.value)


@pytest.mark.usefixtures("no_cwd_on_path")
@pytest.mark.timeout(60)
def test_the_command_line_gives_the_hint(tmp_path, capfd):
    """The user's command: one line, exit non-zero, the fix in it."""
    _package(tmp_path, "shown_paths_pkg_c")
    result = accelopt_in_process("run", "workload=single", "run.progress=false",
                                 "workload.jobs.0.model=shown_paths_pkg_c.nets:make_net",
                                 "workload.jobs.0.dataset=synthetic_vectors",
                                 cwd=tmp_path, capfd=capfd)
    assert result.returncode != 0
    line = the_error_line(result)
    assert "cannot import 'shown_paths_pkg_c.nets' (No module named 'shown_paths_pkg_c')" in line
    assert line.endswith(f"holding shown_paths_pkg_c/ {HINT}")
    assert "Traceback" not in result.stderr
