"""Extension points (accelopt/extensions.py): a name means one object, and a clash between
installed packages, or between a package and code, is one line naming who to fix, raised
where the name is used, so every other name keeps working."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from accelopt import extensions
from accelopt.errors import UserError

GROUP = "accelopt_tests.things"


class Thing:
    pass


class Other:
    pass


class Lifo:
    """A policy an installed package contributes (salus's protocol: select)."""

    def select(self, lane, ready, now_s):
        return ready[-1].job.job_id


@pytest.fixture
def installed(monkeypatch):
    """Pretend these entry points are installed in GROUP."""

    def install(*pairs: tuple[str, str]) -> extensions.ExtensionPoint:
        eps = [EntryPoint(name, value, GROUP) for name, value in pairs]
        monkeypatch.setattr(extensions, "entry_points",
                            lambda group: [ep for ep in eps if ep.group == group])
        return extensions.ExtensionPoint(GROUP)

    return install


def test_an_installed_name_loads_its_object(installed):
    point = installed(("thing", "test_extensions:Thing"))
    assert "thing" in point and point.get("thing") is Thing
    assert point.get("missing") is None


def test_two_packages_declaring_one_name_are_refused_where_it_is_used(installed):
    point = installed(("lifo", "test_extensions:Thing"), ("lifo", "test_extensions:Other"),
                      ("fine", "test_extensions:Thing"))
    with pytest.raises(UserError, match=r"'lifo' is installed by 2 packages \(a package: "
                       r"test_extensions:Thing; a package: test_extensions:Other\)"):
        point.get("lifo")  # not silently the last one found
    assert point.get("fine") is Thing


def test_the_same_entry_point_seen_twice_is_no_clash(installed):
    point = installed(("thing", "test_extensions:Thing"), ("thing", "test_extensions:Thing"))
    assert point.get("thing") is Thing


def test_code_registering_a_name_a_package_declares_is_refused_naming_both(installed):
    """The message named the code registration as the newcomer to rename ('register
    accelopt_plugins.salus.policies:Srtf under another name') when a third-party package had
    taken a built-in policy's name: it names both now, the package first, where the name is
    used (registering raised, and a plugin registering its own names at import broke)."""
    point = installed(("srtf", "test_extensions:Other"))
    point.register("srtf", Thing)
    with pytest.raises(UserError, match=r"'srtf' is installed by a package: "
                       r"test_extensions:Other and registered in code by test_extensions:Thing; "
                       "a name means one object: rename one of them"):
        point.get("srtf")
    point.register("fine", Other)
    assert point.get("fine") is Other


def test_a_package_taking_a_built_in_policy_name_leaves_every_other_policy_working(
        installed, monkeypatch):
    """An installed package declaring `srtf` in salus's group made salus's own
    @register_policy("srtf") raise at import: every policy (fifo too) and every salus command
    was gone. Only `srtf` is refused now, in one line naming both."""
    import importlib.util
    from pathlib import Path

    from accelopt.errors import ConfigError

    group = "accelopt_salus.policies"
    eps = [EntryPoint("srtf", "test_extensions:Other", group),
           EntryPoint("lifo", "test_extensions:Lifo", group)]
    monkeypatch.setattr(extensions, "entry_points",
                        lambda group: [ep for ep in eps if ep.group == group])
    monkeypatch.setattr(extensions, "_POINTS", {})  # a fresh process's registry
    path = Path(__file__).parent.parent / "plugins" / "salus" / "policies.py"
    spec = importlib.util.spec_from_file_location("fresh_salus_policies", path)
    policies = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policies)  # raised here: salus's own srtf came second
    assert type(policies.make_policy("fifo")).__name__ == "Fifo"
    assert isinstance(policies.make_policy("lifo").inner, Lifo)  # installed, no clash
    with pytest.raises(ConfigError, match=r"plugins.salus.policy: accelopt_salus.policies: "
                       r"'srtf' is installed by a package: test_extensions:Other and registered "
                       r"in code by fresh_salus_policies:Srtf; a name means one object"):
        policies.make_policy("srtf")


def test_a_clash_with_a_package_is_the_same_once_its_object_was_loaded(installed):
    """Registering under a package's name raised at once after the package's object had been
    loaded in the process (get), and only where it was used before: the outcome depended on
    what ran first."""
    point = installed(("srtf", "test_extensions:Other"))
    assert point.get("srtf") is Other  # loaded first (a run selected it)
    point.register("srtf", Thing)  # no error here: refused where it is used
    with pytest.raises(UserError, match="'srtf' is installed by a package"):
        point.get("srtf")
    point.unregister("srtf")
    assert point.get("srtf") is Other  # the package's again


def test_another_object_under_a_name_taken_in_code_is_refused_at_once(installed):
    point = installed()
    point.register("thing", Thing)
    point.register("thing", Thing)  # the same object again: no conflict
    with pytest.raises(UserError, match="'thing' is already registered"):
        point.register("thing", Other)
