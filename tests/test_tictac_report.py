"""tictac's report rows, order file and CLI values: what a user reads must be what ran."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
from accelopt_plugins.tictac.config import TictacConfig
from accelopt_plugins.tictac.plugin import TictacPlugin
from test_tictac_cluster import make_cfg, server_plugin

from accelopt.errors import ConfigError, UserError
from accelopt.types import ReportRow

pytestmark = pytest.mark.timeout(120)


def test_rows_alike_in_words_but_not_in_numbers_are_not_merged():
    """Two jobs' priority rows read alike; the merged row showed the first job's figures
    as "all jobs"."""
    from accelopt.drivers.rows import merge_rows

    rows = [[ReportRow("t", "enforced", {"job": "a", "ms": 0.5}),
             ReportRow("t", "enforced", {"job": "b", "ms": 1.4}),
             ReportRow("t", "same", {"job": "a", "ms": 1.0}),
             ReportRow("t", "same", {"job": "b", "ms": 1.0})]]
    merged = merge_rows(rows, ["a", "b"])
    assert [(r.summary, r.metrics) for r in merged] == [
        ("job a: enforced", {"ms": 0.5, "job": "a"}), ("job b: enforced", {"ms": 1.4, "job": "b"}),
        ("all jobs: same", {"ms": 1.0, "job": "a, b"})]


def _samples(plugin: TictacPlugin, records, first: int = 0) -> None:
    """The warm-up's transfers as the transport reports them: 1 MB/s plus 1 ms a message
    (``first``: the run's first iteration, past 0 where it was resumed)."""
    for iteration in (first, first + 1):
        t = 10.0 * iteration
        for r in records:
            end = t + 1e-3 + r.nbytes / 1e6
            record = dataclasses.replace(r, iteration=iteration)
            plugin.accelopt_transfer_done(record=record, start_s=t, end_s=end)
            t = end


def _at(records, iteration: int):
    return [dataclasses.replace(r, iteration=iteration) for r in records]


def test_a_resumed_run_measures_the_link_and_replans_as_an_uninterrupted_one(tmp_path,
                                                                             monkeypatch):
    """A run resumed at iteration 50 kept only samples of iterations < replan_iteration
    (counted from 0): it never measured its link and planned with the default 1 Gbit/s,
    10x off the link the uninterrupted run measured, so its enforce decision could differ."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="tac", force=True)
    plugin.accelopt_transfer_order(transfers=_at(records, 50), destination=1)
    _samples(plugin, records, first=50)
    plugin.accelopt_transfer_order(transfers=_at(records, 51), destination=1)
    assert not plugin.replanned  # still the resumed run's warm-up
    plugin.accelopt_transfer_order(transfers=_at(records, 52), destination=1)
    assert plugin.replanned and plugin.link_source == "measured from the transport"
    assert plugin.plan.bytes_per_s == pytest.approx(1e6, rel=0.05)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "MB/s (measured from the transport)" in row.summary


def _tuned(first: int) -> tuple[list, str]:
    """A worker's priority plugin tuning its window (credit_bytes=-1) in a run whose first
    iteration is ``first``: each iteration's window, and the row's account of the choice."""
    from accelopt_plugins.tictac.plugin import TictacPriority

    from accelopt.types import IterationResult, TransferRecord

    config = TictacConfig(heuristic="priority", credit_bytes=-1)
    plugin = TictacPriority(config)
    plugin.accelopt_configure(config, make_cfg())
    seconds = {None: 0.3, 0: 0.1, 65536: 0.2}
    windows = []
    for iteration in range(first, first + 17):
        grads = [TransferRecord("tiny", iteration, 1, 0, f"w{k}", 64, k, "grad")
                 for k in range(3)]
        answer = plugin.accelopt_transfer_order(transfers=grads, destination=0)
        credit = None if answer is None else answer.credit_bytes
        windows.append(credit)
        result = IterationResult("tiny", iteration, 0.0, seconds[credit], None, 16)
        plugin.accelopt_iteration_end(context=None, result=result)
    return windows, plugin.tuner.describe()


def test_a_resumed_run_tunes_its_window_as_an_uninterrupted_one():
    """Counted from iteration 0, a run resumed at 50 was past the tuning window (2-13): it
    never measured a candidate and ran the last one (64 KiB) for good, undecided."""
    fresh, words = _tuned(0)
    resumed, resumed_words = _tuned(50)
    assert fresh[:2] == [None, None] and fresh[-1] == 0  # warm-up off; chose credit 0
    assert resumed == fresh
    assert "measured over iterations 2-13" in words
    assert "measured over iterations 52-63" in resumed_words and "chose credit 0 B" in \
        resumed_words


def test_priority_predicts_with_the_measured_link_and_its_row_says_so(tmp_path, monkeypatch):
    """priority never re-planned: its prediction assumed the default 1 Gbit/s link while TAC's
    used the transport's measurement; its row named neither rank nor link."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="priority",
                                    credit_bytes=0)
    assert plugin.link_source == "default 1 Gbit/s"
    _samples(plugin, records)
    later = [dataclasses.replace(r, iteration=2) for r in records]
    plugin.accelopt_transfer_order(transfers=later, destination=1)
    assert plugin.link_source == "measured from the transport"
    assert plugin.plan.bytes_per_s == pytest.approx(1e6, rel=0.05)
    saved = json.loads((tmp_path / "tictac" / "plan-rank0.json").read_text())
    assert saved["link_source"] == "measured from the transport"
    (row,) = plugin.accelopt_report_rows(run=None)
    assert row.summary.startswith("server rank 0: enforced priority")
    assert "MB/s (measured from the transport)" in row.summary
    assert row.metrics["rank"] == 0 and row.metrics["link_source"] == plugin.link_source
    assert f"predicted steady iteration {row.metrics['predicted_ms']:.3f} ms" in row.summary


def test_a_grid_with_no_setting_left_is_refused_naming_the_keys():
    """Every chunked setting had credit 0 and was dropped: 'WindowTuner needs at least one
    candidate' (exit 1) with force=true, and without it a row claiming the default order
    measured fastest though nothing was measured."""
    for force in (True, False):
        config = TictacConfig(heuristic="priority", credit_bytes=-1, partition_bytes=-1,
                              tune_credits=[0], tune_partitions=[262144], force=force)
        with pytest.raises(ConfigError, match=r"partition_bytes=-1 \(tune_partitions=\[262144\]"
                           r"\) leaves no setting to run: chunks need a credit window") as info:
            TictacPlugin(config).accelopt_configure(config, make_cfg())
        assert "\n" not in str(info.value)


def test_order_file_is_named_in_the_row_and_a_stale_one_is_said_in_it(tmp_path, monkeypatch):
    names = ["net.5.bias", "net.5.weight", "net.3.bias", "net.3.weight", "net.1.bias",
             "net.1.weight"]
    good = tmp_path / "rev.json"
    good.write_text(json.dumps(names))
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="tac", force=True,
                                    order_file=str(good))
    assert plugin.accelopt_transfer_order(transfers=records, destination=1) == names
    (row,) = plugin.accelopt_report_rows(run=None)
    assert f"enforced tac (order_file {good})" in row.summary
    assert row.metrics["order_source"] == f"order_file {good}"
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(names[:2]))
    with pytest.warns(RuntimeWarning, match="does not match the model"):
        plugin, _ = server_plugin(tmp_path, monkeypatch, heuristic="tac", order_file=str(stale))
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "; warnings: tictac: order_file" in row.summary and row.metrics["warnings"] == 1
    prio, _ = server_plugin(tmp_path, monkeypatch, heuristic="priority", order_file=str(good))
    assert prio.accelopt_transfer_order(transfers=records, destination=1).order == tuple(names)
    config = TictacConfig(heuristic="random", order_file=str(good))
    with pytest.raises(ConfigError, match="heuristic=random never uses it"):
        TictacPlugin(config).accelopt_configure(config, make_cfg())


@pytest.mark.parametrize("setting", [{"credit_bytes": 65536}, {"pace": 0.5},
                                     {"partition_bytes": 1024}])
def test_a_priority_only_setting_with_another_heuristic_is_refused(setting) -> None:
    # the run went ahead with it unread, its row silent about it
    config = TictacConfig(heuristic="tac", **setting)
    key = next(iter(setting))
    with pytest.raises(ConfigError, match=rf"plugins.tictac.{key}=.*read by heuristic=priority "
                       "only, and heuristic=tac would run without it"):
        TictacPlugin(config).accelopt_configure(config, make_cfg())
    config = TictacConfig(heuristic="priority", **setting)
    TictacPlugin(config).accelopt_configure(config, make_cfg())


def _order(*args: str) -> int:
    from accelopt.cli.main import dispatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dispatch(["tictac", "order", "workload=tiny", "plugins.tictac.oracle_runs=1",
                         *args], False)


def test_cli_prints_the_order_files_order_or_refuses_the_file(tmp_path, capsys):
    """The CLI never read order_file: it printed the computed order marked (tac)."""
    names = ["net.5.bias", "net.5.weight", "net.3.bias", "net.3.weight", "net.1.bias",
             "net.1.weight"]
    rev = tmp_path / "rev.json"
    rev.write_text(json.dumps(names))
    assert _order(f"plugins.tictac.order_file={rev}") == 0
    out = capsys.readouterr().out
    assert f"# order (tac, from order_file {rev})" in out
    printed = [line.split()[1] for line in out.splitlines() if line[:5].strip().isdigit()]
    assert printed == names
    bad = tmp_path / "bad.json"
    bad.write_text("[not json")
    with pytest.raises(UserError, match=r"order_file .*bad.json is not a readable JSON file"):
        _order(f"plugins.tictac.order_file={bad}")
    bad.write_text('{"order": 5}')
    with pytest.raises(UserError, match="is not a JSON list of tensor names"):
        _order(f"plugins.tictac.order_file={bad}")


def test_cli_reads_values_as_a_run_does(capsys):
    """tune_credits=[1,2] was int('['): a ValueError naming no key, exit 1."""
    assert _order("plugins.tictac.tune_credits=[1,2]", "plugins.tictac.heuristic=priority",
                  "plugins.tictac.force=yes") == 0
    with pytest.raises(UserError, match=r"seed='1.5' is not a whole number$"):
        _order("plugins.tictac.seed=1.5")
    with pytest.raises(UserError, match=r"tune_credits='\[1,' is not a list of whole numbers"):
        _order("plugins.tictac.tune_credits=[1,")
