"""The byte counter's CSVs agree with the core's own count of the bytes on the wire."""

from __future__ import annotations

import csv
from collections import defaultdict

import pytest

accelopt_bytecount = pytest.importorskip(
    "accelopt_bytecount",
    reason="the example is not installed: pip install -e examples/plugins/bytecount")

from accelopt.testing import PluginConformance, run_workload  # noqa: E402
from accelopt.types import INERT  # noqa: E402

PLUGIN = accelopt_bytecount.PLUGIN
ONE_JOB = ["workload.jobs=[{name: m, model: mlp, width: 16, batch_size: 8, iterations: 4}]",
           "cluster.timeout_s=30"]
pytestmark = pytest.mark.timeout(180)


def per_iteration(run_dir) -> dict[int, int]:
    totals: dict[int, int] = defaultdict(int)
    files = sorted(run_dir.glob("bytecount-rank*.csv"))
    assert files, "no rank wrote its CSV"
    for path in files:
        with open(path) as fh:
            for row in csv.DictReader(fh):
                totals[int(row["iteration"])] += int(row["wire_bytes"])
    return dict(totals)


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_its_totals_equal_the_cores_bytes_per_iteration(tmp_path, mode):
    record = run_workload([PLUGIN], [*ONE_JOB, f"cluster.mode={mode}"], tmp_path=tmp_path)
    totals = per_iteration(__import__("pathlib").Path(record.info.run_dir))
    assert sorted(totals) == [0, 1, 2, 3]
    assert set(totals.values()) == {record.metrics["bytes_per_iteration"]}


def test_in_one_process_it_says_there_is_nothing_to_count(tmp_path):
    record = run_workload([PLUGIN], tmp_path=tmp_path)
    (row,) = [r for r in record.plugin_rows if r.plugin == "bytecount"]
    assert "no transfers" in row.summary
    assert row.metrics.get(INERT) == 1  # else bench and run.compare credit it with noise


class TestByteCountConformance(PluginConformance):
    spec = PLUGIN
    modes = ("none", "ps", "allreduce")
    overrides = ONE_JOB
