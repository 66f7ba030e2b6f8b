"""``accelopt new-plugin``: the generated package is installable, discoverable and its own
tests pass. Nothing is installed into this venv: the generated ``src/`` goes on PYTHONPATH
and the plugin is registered through ``ACCELOPT_PLUGINS`` (or, for the real entry point,
a wheel is installed into a private ``--target`` folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelopt.cli.main import main

NAME = "tally"


def accelopt_cli(*args: str) -> None:
    """Run ``accelopt ARGS`` in-process, returning normally only on exit code 0."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 0


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("scaffold")
    accelopt_cli("new-plugin", NAME, "--dir", str(where))
    return where / f"accelopt-{NAME}"


def env_with(pythonpath: Path, plugins: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    env["ACCELOPT_PLUGINS"] = plugins
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def accelopt_command() -> list[str]:
    script = Path(sys.executable).with_name("accelopt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "accelopt.cli.main"]


def test_generates_the_package_layout(generated: Path) -> None:
    tomllib = pytest.importorskip("tomllib")
    files = sorted(str(p.relative_to(generated)) for p in generated.rglob("*") if p.is_file())
    assert files == [
        ".gitignore", "README.md", "pyproject.toml", f"src/accelopt_{NAME}/__init__.py",
        f"tests/test_{NAME}.py",
    ]
    project = tomllib.loads((generated / "pyproject.toml").read_text())["project"]
    assert project["name"] == f"accelopt-{NAME}"
    assert any(dep.startswith("accelopt") for dep in project["dependencies"])
    assert project["entry-points"]["accelopt.plugins"] == {NAME: f"accelopt_{NAME}:PLUGIN"}
    assert any(dep.startswith("pytest") for dep in project["optional-dependencies"]["test"])
    readme = (generated / "README.md").read_text()
    for heading in ("What it does", "Paper's claim", "Our measured figure", "How to reproduce"):
        assert f"## {heading}" in readme


def test_prints_next_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    accelopt_cli("new-plugin", "other", "--dir", str(tmp_path))
    out = capsys.readouterr().out
    assert "pip install -e '.[test]'" in out and "pytest" in out
    assert "accelopt run '+plugins=[other]' workload=tiny" in out


@pytest.mark.timeout(240)
def test_generated_tests_pass(generated: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(generated / "tests"), "-q", "-p", "no:cacheprovider"],
        cwd=generated, env=env_with(generated / "src", f"accelopt_{NAME}:PLUGIN"),
        capture_output=True, text=True, timeout=220,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "9 passed" in done.stdout


@pytest.mark.timeout(120)
def test_accelopt_plugins_lists_it_via_accelopt_plugins_env(generated: Path) -> None:
    listed = _list_plugins(env_with(generated / "src", f"accelopt_{NAME}:PLUGIN"))
    assert listed[NAME]["description"].startswith("Counts iterations")


@pytest.mark.timeout(180)
def test_a_built_wheel_registers_the_entry_point(generated: Path, tmp_path: Path) -> None:
    """The real mechanism: entry point metadata from an installed wheel, no env var."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(generated)], check=True, capture_output=True, timeout=150,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(tmp_path / "site"),
         str(wheel)], check=True, capture_output=True, timeout=60,
    )
    listed = _list_plugins(env_with(tmp_path / "site"))
    assert listed[NAME]["source"] == f"accelopt_{NAME}:PLUGIN"


def _list_plugins(env: dict[str, str]) -> dict[str, dict]:
    done = subprocess.run(
        [*accelopt_command(), "plugins", "--json"], env=env, capture_output=True, text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    return {entry["name"]: entry for entry in json.loads(done.stdout)}


@pytest.mark.parametrize("bad", ["my-plugin", "1st", "has space", ""])
def test_a_bad_name_exits_2_with_one_line(
    bad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["new-plugin", bad, "--dir", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: plugin name")
    assert "must be a Python identifier" in err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "accelopt-mine"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as info:
        main(["new-plugin", "mine", "--dir", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{target} already exists" in err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("name, words", [
    ("noop", "already installed"),
    # the generated tests crashed: the kit's HookRecorder is added under that name
    ("hook_recorder", "reserved for accelopt.testing's HookRecorder"),
])
def test_an_installed_or_reserved_plugin_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, words: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["new-plugin", name, "--dir", str(tmp_path)])
    assert info.value.code == 2
    assert words in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_name_a_plugin_loaded_from_accelopt_plugins_has_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin the guide's way loads without installing (``ACCELOPT_PLUGINS``) holds its
    name as an installed one does: the scaffold of the same name was created, and the two
    clashed once it was installed."""
    elsewhere = tmp_path / "path"
    elsewhere.mkdir()
    (elsewhere / "mine_by_reference.py").write_text(
        "from accelopt import PluginSpec\n\n"
        "class Plugin:\n    pass\n\n"
        "PLUGIN = PluginSpec(name='byref', factory=lambda config: Plugin())\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.setenv("ACCELOPT_PLUGINS", "mine_by_reference:PLUGIN")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["new-plugin", "byref", "--dir", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already loaded from ACCELOPT_PLUGINS " \
        "(mine_by_reference:PLUGIN)" in err
    assert not out.exists()


def test_a_name_whose_module_exists_already_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``new-plugin plugins`` made the module accelopt_plugins, accelopt's own built-in
    package: installing it overwrote accelopt_plugins/__init__.py. A name whose module is
    importable already (here one on the path, not a plugin) is refused too."""
    elsewhere = tmp_path / "path"
    (elsewhere / "accelopt_taken").mkdir(parents=True)
    (elsewhere / "accelopt_taken" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(elsewhere))
    out = tmp_path / "out"
    for name in ("plugins", "taken"):
        with pytest.raises(SystemExit) as info:
            main(["new-plugin", name, "--dir", str(out)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"plugin name '{name}' makes the module " \
            f"accelopt_{name}, which already exists" in err and "choose another NAME" in err
    assert not out.exists()


def test_the_generated_package_pins_this_accelopts_minor_series() -> None:
    """render's docstring promised a pin to the minor series; pyproject got
    ``accelopt>=0.1.0``, which a 0.2 with another plugin API satisfies."""
    import accelopt
    from accelopt.cli.scaffold import accelopt_requirement, render

    assert accelopt_requirement("0.1.0") == "accelopt>=0.1,<0.2"
    assert accelopt_requirement("1.12.3.dev4") == "accelopt>=1.12,<1.13"
    assert accelopt_requirement(accelopt.__version__) in render("pyproject.toml.tmpl", "my_sched")
