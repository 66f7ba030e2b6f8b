"""salus's own policy names against third parties that take one, and the report row of a run
whose jobs were not memory-profiled.

A built-in name is never the one to rename: whoever registered first, a module or package
that takes one is refused where that name is selected, told to rename, and every other
policy keeps working."""

from __future__ import annotations

import importlib.util
from importlib.metadata import EntryPoint
from pathlib import Path
from types import ModuleType

import pytest

from accelopt import extensions
from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
GROUP = "accelopt_salus.policies"
POLICIES_PY = Path(__file__).resolve().parents[1] / "plugins" / "salus" / "policies.py"


class Pol:
    """A third party's policy that takes a built-in name (salus's protocol: select)."""

    max_lanes = 1

    def select(self, lane, ready, now_s):
        return ready[0].job.job_id


class Lifo(Pol):
    """An installed package's policy."""


@pytest.fixture
def fresh(monkeypatch):
    """A fresh process's extension points with ``installed`` entry points, and salus's
    policies module imported into it when ``load()`` is called."""

    def setup(*installed: tuple[str, str]):
        eps = [EntryPoint(name, value, GROUP) for name, value in installed]
        monkeypatch.setattr(extensions, "entry_points",
                            lambda group: [ep for ep in eps if ep.group == group])
        monkeypatch.setattr(extensions, "_POINTS", {})

        def load() -> ModuleType:
            spec = importlib.util.spec_from_file_location("fresh_policies", POLICIES_PY)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module

        return extensions.extension_point(GROUP), load

    return setup


REFUSED = (r"plugins.salus.policy: accelopt_salus.policies: 'srtf' is registered in code by "
           r"test_policy_fixes:Pol and by fresh_policies:Srtf; a name means one object and the "
           r"built-in \(fresh_policies:Srtf\) keeps it: register test_policy_fixes:Pol under "
           r"another name$")


def test_a_module_registering_a_built_in_name_first_disables_only_that_policy(fresh):
    """The third party's module imported before salus (ACCELOPT_PLUGINS) made salus's own
    registration raise at import, so every policy, fifo too, was refused, and the line said
    to rename the built-in."""
    point, load = fresh()
    point.register("srtf", Pol)
    policies = load()
    assert type(policies.make_policy("fifo")).__name__ == "Fifo"
    with pytest.raises(ConfigError, match=REFUSED):
        policies.make_policy("srtf")


def test_a_module_registering_a_built_in_name_after_salus_is_refused_only_when_selected(fresh):
    """The other import order: the third party's registration raised at once, taking down
    every run that imported it, whichever policy was selected."""
    point, load = fresh()
    policies = load()
    policies.register_policy("srtf")(Pol)  # no error here
    assert type(policies.make_policy("fair")).__name__ == "Fair"
    with pytest.raises(ConfigError, match=REFUSED):
        policies.make_policy("srtf")
    point.unregister("srtf")  # the third party's gone: the built-in is selectable again
    assert type(policies.make_policy("srtf")).__name__ == "Srtf"
    policies.register_policy("srtf")(policies.Srtf)  # the built-in itself again: no clash
    assert type(policies.make_policy("srtf")).__name__ == "Srtf"


def test_a_package_declaring_a_built_in_name_is_told_to_rename_its_entry_point(fresh):
    """'rename one of them' left the built-in as a candidate to rename."""
    _, load = fresh(("srtf", "test_policy_fixes:Pol"))
    policies = load()
    with pytest.raises(ConfigError, match=r"'srtf' is installed by a package: "
                       r"test_policy_fixes:Pol and registered in code by fresh_policies:Srtf; "
                       r"a name means one object and the built-in \(fresh_policies:Srtf\) "
                       r"keeps it: rename that package's entry point \(or uninstall it\)$"):
        policies.make_policy("srtf")
    assert type(policies.make_policy("pack")).__name__ == "Pack"


def test_an_unknown_policy_lists_a_clashing_name_as_clashing_not_as_a_choice(fresh):
    point, load = fresh(("lifo", "test_policy_fixes:Lifo"))
    policies = load()
    point.register("lifo", Pol)  # code takes an installed package's name
    point.register("srtf", Pol)  # and a built-in's
    with pytest.raises(ConfigError) as info:
        policies.make_policy("nope")
    message = str(info.value)
    choices = message.split("choose one of ", 1)[1].split(" or give", 1)[0].split(", ")
    assert choices == ["auto", "dlas", "fair", "fifo", "gittins", "las", "pack", "rr"]
    assert message.endswith("(lifo, srtf: claimed by two policies, refused until one is "
                            "renamed; select it to see which)")
    assert "\n" not in message


def test_the_built_ins_are_not_sent_to_ranks_as_code_registrations(fresh):
    """A rank imports salus and registers them itself; sent along, a rank that imported a
    third party's module taking one of their names first refused the built-in's restoring."""
    point, load = fresh()
    load()
    point.register("srtf", Pol)
    assert extensions.code_extensions() == {GROUP: {"srtf": Pol}}


# -- the report row without memory profiles ----------------------------------------------------


def salus_row(record):
    return next(r for r in record.plugin_rows if r.plugin == "salus")


def test_a_run_without_memory_profiles_says_so_rather_than_0_bytes_accounted(run_tiny):
    from accelopt_plugins.salus import PLUGIN

    record = run_tiny(PLUGIN, overrides=["run.profile=false", "run.threads=1",
                                         "plugins.salus.threads=1",
                                         "plugins.salus.capacity=1GiB",
                                         "workload.jobs.0.iterations=2",
                                         "workload.jobs.1.iterations=2"])
    row = salus_row(record)
    assert "peak accounted memory" not in row.summary
    assert ("no memory accounted against the 1.0 GiB capacity: the jobs were not memory-profiled "
            "(run.profile=false), so lanes and packing had no estimates") in row.summary
    assert row.metrics["unprofiled_jobs"] == len(record.jobs) == 2
