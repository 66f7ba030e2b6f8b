"""Two configuration mistakes refused in one line naming the key and the fix: an empty
``run.resume`` (it started a brand-new run, its config recording ``resume: ''``), and
adding, removing or replacing an element of ``workload.jobs`` by its index (Hydra's
"list index out of range", Python's "list indices must be integers or slices, not str",
and a non-job element called "not a job of this workload (it has fewer)")."""

from __future__ import annotations

import re

import pytest

import accelopt
from accelopt.cli.hydra_run import compose_checked
from accelopt.config import register_schema
from accelopt.errors import ConfigError, UserError

WHOLE = r"give the whole list.*workload\.jobs=\[\{name: a, model: mlp\},"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("empty", ["run.resume=", "run.resume=''"])
def test_an_empty_resume_is_refused_and_writes_nothing(empty, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"^run\.resume is empty: give the run directory to "
                                        r"resume, or leave run\.resume out$"):
        accelopt.run(["workload=tiny", "run.profile=false", empty], run_dir=out)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(("override", "said"), [
    ("+workload.jobs.2={name: extra, model: mlp, iterations: 2}",
     r"^workload\.jobs\.2: a job cannot be added by its index"),
    ("workload.jobs.2={name: extra, model: mlp, iterations: 2}",
     r"^workload\.jobs\.2: a job cannot be added by its index"),
    ("workload.jobs.5.iterations=3", r"^workload\.jobs\.5 is not a job of this workload"),
    ("~workload.jobs.1", r"^'~workload\.jobs\.1': an element of a list cannot be removed by "
                         r"its index; give the whole list without it"),
    ("workload.jobs=[5]", r"^workload\.jobs\.0 is 5, not a job: every element must be a job "
                          r"mapping"),
    ("workload.jobs=[null]", r"^workload\.jobs\.0 is null, not a job"),
    ("workload.jobs.0=null", r"^workload\.jobs\.0 is null, not a job"),
    ("workload.jobs=[{name: a},7]", r"^workload\.jobs\.1 is 7, not a job"),
])
def test_a_mistake_about_an_element_of_the_jobs_names_it_and_the_whole_list(override, said):
    register_schema()
    with pytest.raises(ConfigError) as caught:
        compose_checked(["workload=tiny", override])
    line = str(caught.value)
    assert "\n" not in line
    assert re.search(said, line), line
    assert re.search(WHOLE, line), line
