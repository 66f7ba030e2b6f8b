"""`accelopt bench`: gains, interaction effects, and a real (tiny) interleaved sweep."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import accelopt_cmd, accelopt_in_process, cli_env, the_error_line

from accelopt.bench.analysis import SetResult, classify, higher_is_better, summarize
from accelopt.bench.render import render_markdown
from accelopt.bench.runner import bench_command, run_plan, set_overrides, split_overrides
from accelopt.cli.sweep_settings import drop_unselected, selection_from_task_overrides
from accelopt.errors import UserError
from accelopt.job.quality import hits_at_1


def test_gain_orientation_and_interaction():
    results = [
        SetResult((), (10.0, 10.0, 10.0)),
        SetResult(("a",), (5.0, 5.0, 5.0)),        # 2x better (lower is better)
        SetResult(("b",), (8.0, 8.0, 8.0)),        # 1.25x
        SetResult(("a", "b"), (4.0, 4.0, 4.0)),    # 2.5x = 2 * 1.25: independent
    ]
    by = {s.label: s for s in summarize(results, "avg_jct_s")}
    assert by["baseline"].gain == 1.0
    assert by["a"].gain == 2.0 and by["b"].gain == 1.25
    assert by["a+b"].expected_gain == 2.5
    assert math.isclose(by["a+b"].interaction, 1.0)
    assert by["a+b"].verdict.startswith("independent")
    higher = {s.label: s for s in summarize(results, "iterations_per_s")}
    assert higher["a"].gain == 0.5  # for a throughput, a lower value is worse


@pytest.mark.parametrize(("metric", "higher"), [
    ("avg_jct_s", False), ("makespan_s", False), ("avg_perplexity", False),
    ("bytes_per_iteration", False), ("iteration_s", False), ("avg_quality", True),
    ("throughput", True), ("samples_per_s", True), ("efficiency_e", True),
    ("achieved_bandwidth_bps", True), ("n_done", True), ("n_failed", False),
    ("n_diverged", False), ("n_rejected", False)])
def test_the_direction_of_each_summary_metric(metric, higher):
    """A held-out accuracy that fell must read as a loss (gain < 1), not as a speed-up."""
    assert higher_is_better(metric) is higher
    worse = summarize([SetResult((), (0.8,)), SetResult(("p",), (0.4 if higher else 1.6,))],
                      metric)
    assert worse[1].gain == pytest.approx(0.5)


def test_classify():
    assert classify(1.2) == "synergistic"
    assert classify(0.8) == "interfering"
    assert classify(1.01).startswith("independent")
    assert classify(1.2, 1.1, 1.3) == "synergistic"
    assert classify(1.2, 0.95, 1.5).startswith("inconclusive")  # the spread includes 1
    # a median within 5% of 1 is no finding when the range reaches far past it either way
    assert classify(1.01, 0.6, 1.5) == "inconclusive (range 0.60-1.50 includes 1)"
    assert classify(1.01, 0.98, 1.03).startswith("independent")  # the whole range is within
    assert classify(2.2, 1.7, 2.6, n=2) == "inconclusive (n=2 repeats; 3 needed)"
    assert classify(2.2, 1.7, 2.6, n=3) == "synergistic"


def test_two_repeats_give_no_verdict():
    """noop+clip read 'synergistic, 2.3x' from 2 repeats whose paired interactions happened
    to be 1.71 and 2.60: the min-max of two runs is no range. Neither the combination nor a
    plugin alone (noop '1.22x' from one run) gets a verdict below 3 repeats; with 3 repeats,
    a set alone whose gain within each repeat ranges over 1 is within noise."""
    two = [
        SetResult((), (0.1, 0.09), repeats=(0, 1)),
        SetResult(("clip",), (0.09, 0.1), repeats=(0, 1)),
        SetResult(("noop",), (0.1, 0.08), repeats=(0, 1)),
        SetResult(("clip", "noop"), (0.05, 0.04), repeats=(0, 1)),  # paired 1.80 and 2.22
    ]
    by = {s.label: s for s in summarize(two, "avg_jct_s")}
    assert by["clip+noop"].interaction_low > 1.05  # the old verdict: "synergistic"
    assert by["clip+noop"].verdict == "inconclusive (n=2 repeats; 3 needed)"
    assert by["noop"].verdict == "alone; inconclusive (n=2 repeats; 3 needed)"
    one = summarize([SetResult((), (0.09,), repeats=(0,)),
                     SetResult(("noop",), (0.0375,), repeats=(0,))], "avg_jct_s")
    assert one[1].gain == pytest.approx(2.4) and one[1].verdict.endswith("(n=1 repeat; 3 needed)")
    three = {s.label: s for s in summarize([
        SetResult((), (10.0, 12.0, 9.0), repeats=(0, 1, 2)),
        SetResult(("noop",), (9.5, 12.5, 8.0), repeats=(0, 1, 2)),   # 1.05x, 0.96x, 1.12x
        SetResult(("fast",), (5.0, 6.5, 4.4), repeats=(0, 1, 2)),
    ], "duration_s")}
    assert three["noop"].verdict == "alone; within noise (paired gain 0.96-1.12 includes 1)"
    assert three["fast"].verdict == "alone"
    unpaired = {s.label: s for s in summarize([  # every value against every baseline value
        SetResult((), (10.0, 12.0, 9.0)), SetResult(("noop",), (9.5, 12.5, 8.0))],
        "duration_s")}
    assert unpaired["noop"].verdict == "alone; within noise (unpaired gain 0.72-1.50 includes 1)"
    table = render_markdown(list(by.values()), {"metric": "avg_jct_s", "command": "c",
                                                "machine": "m", "python": "3", "repeats": 2,
                                                "higher_is_better": False})
    assert "fewer than 3 repeats give none" in table


def test_a_plugin_that_does_nothing_never_looks_synergistic():
    # 'noop' changes nothing; its runs only carry the machine's noise (as on a shared CPU)
    results = [
        SetResult((), (10.0, 9.0, 11.0)),
        SetResult(("a",), (5.0, 5.2, 4.8)),
        SetResult(("noop",), (11.0, 8.0, 12.0)),
        SetResult(("a", "noop"), (4.3, 4.5, 4.1)),  # fast by chance
    ]
    combo = {s.label: s for s in summarize(results, "duration_s")}["a+noop"]
    assert combo.interaction > 1.05  # the point estimate alone would say "synergistic"
    assert combo.interaction_low < 1 < combo.interaction_high
    assert combo.verdict.startswith("inconclusive")


def test_run_plan_warms_up_every_set_then_rotates_the_order():
    sets = [[], ["a"], ["b"]]
    plan = run_plan(sets, 3)
    assert plan[:3] == [(-1, [], True), (-1, ["a"], True), (-1, ["b"], True)]
    assert len(plan) == 3 + 3 * 3 and not any(w for _, _, w in plan[3:])
    measured = [[p for r, p, w in plan if r == rep] for rep in range(3)]
    # every set once in every position over three repeats (a cyclic Latin square)
    assert measured == [[[], ["a"], ["b"]], [["a"], ["b"], []], [["b"], [], ["a"]]]


def test_baseline_required():
    with pytest.raises(ValueError, match="baseline"):
        summarize([SetResult(("a",), (1.0,))], "duration_s")


def test_plugin_settings_go_only_to_the_sets_that_select_the_plugin():
    common, per_plugin = split_overrides(
        ["workload=tiny", "plugins.gpu_kernels.prune_amount=0.5", "+plugins.noop.x=1"])
    assert common == ["workload=tiny"]
    assert per_plugin == {"gpu_kernels": ["plugins.gpu_kernels.prune_amount=0.5"],
                          "noop": ["plugins.noop.x=1"]}
    assert set_overrides([], common, per_plugin) == ["+plugins=[]", "workload=tiny"]
    assert set_overrides(["gpu_kernels"], common, per_plugin) == [
        "+plugins=[gpu_kernels]", "workload=tiny", "plugins.gpu_kernels.prune_amount=0.5"]
    for bad in ("+plugins=[noop]", "plugins=[noop]"):
        with pytest.raises(UserError, match="--plugins/--sets"):
            split_overrides([bad])


def test_sets_are_parsed_strictly():
    from accelopt.bench.runner import parse_sets

    assert parse_sets("[],[salus],[salus, tictac]") == [[], ["salus"], ["salus", "tictac"]]
    for bad in ("[noop", "noop", "[a],b", "[a]]", ""):  # '[noop' used to mean [noop]
        with pytest.raises(UserError, match="--sets takes bracketed sets"):
            parse_sets(bad)


def test_child_drops_settings_of_plugins_the_run_does_not_select():
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig

    cfg = OmegaConf.merge(OmegaConf.structured(AccelConfig),
                          {"plugins": {"noop": {}, "gpu_kernels": {"prune_amount": 0.5}}})
    selected = selection_from_task_overrides(["run.repeat=0", "+plugins=[noop]"])
    assert selected == ["noop"]
    assert drop_unselected(cfg, selected) == ["gpu_kernels"]
    assert list(cfg.plugins.keys()) == ["noop"]
    assert selection_from_task_overrides(["+plugins=[]"]) == []


def test_hits_at_1_single_and_multi_label():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.0, 0.2, 0.7]])
    assert hits_at_1(logits, torch.tensor([1, 2, 2])).tolist() == [1.0, 0.0, 1.0]
    multi = torch.tensor([[0, 1], [2, -1], [-1, -1]])  # -1 pads; no label: a miss
    assert hits_at_1(logits, multi).tolist() == [1.0, 0.0, 0.0]


@pytest.mark.timeout(60)
def test_a_set_that_cannot_run_is_named_in_one_line_before_the_sweep(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(UserError) as info:
        bench_command(["--sets", "[],[offload]", "--repeats", "1", "--out", str(out),
                       "workload=tiny", "plugins.offload.policy=fast"])
    message = str(info.value)
    assert message.startswith("set [offload] cannot run:") and "plugins.offload.policy" in message
    assert "\n" not in message and not out.exists()
    with pytest.raises(UserError, match="no set selects them"):
        bench_command(["--sets", "[],[noop]", "workload=tiny",
                       "plugins.gpu_kernels.prune_amount=0.5"])


@pytest.mark.timeout(240)
def test_bench_runs_an_interleaved_sweep(tmp_path, capfd):
    # every valid set of noop and gpu_kernels; gpu_kernels' setting must reach only its sets
    # (a plain Hydra sweep would fail to compose it for the baseline and noop). The bench in
    # this process (its sweep is a process of its own either way)
    out = tmp_path / "bench"
    result = accelopt_in_process("bench", "--plugins", "noop,gpu_kernels", "--repeats", "1",
                                 "--metric", "avg_jct_s", "--out", str(out), "workload=tiny",
                                 "plugins.gpu_kernels.prune_amount=0.5", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    by = {s["label"]: s for s in report["sets"]}
    combo = next(label for label in by if "+" in label)
    assert sorted(by) == sorted(["baseline", "gpu_kernels", "noop", combo])
    assert set(combo.split("+")) == {"noop", "gpu_kernels"}
    assert all(s["n"] == 1 for s in by.values())  # warm-up runs are not counted
    assert by[combo]["expected_gain"] is not None
    assert all(0.0 <= s["quality"] <= 1.0 for s in by.values())  # every set is scored
    runs = sorted((out / "runs").glob("*/config.yaml"), key=lambda p: int(p.parent.name))
    assert len(runs) == 4 + 4  # one warm-up run per set, then the measured repeat
    for path in runs:
        cfg = path.read_text()
        selected = json.loads((path.parent / "metrics.json").read_text())["run"]["plugins"]
        assert ("prune_amount: 0.5" in cfg) == ("gpu_kernels" in selected)
        assert ("gpu_kernels:" in cfg) == ("gpu_kernels" in selected)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| baseline |" in md and "top1" in md and "overrides: workload=tiny" in md
    # --reanalyze rebuilds the same report from the runs, running nothing
    (out / "bench.md").unlink()
    assert bench_command(["--reanalyze", "--out", str(out)]) == 0
    again = json.loads((out / "bench.json").read_text())
    assert [s["median"] for s in again["sets"]] == [s["median"] for s in report["sets"]]
    assert (out / "bench.md").read_text() == md


def test_bench_unknown_metric_is_one_line(tmp_path, capfd):
    result = accelopt_in_process("bench", "--plugins", "noop", "--repeats", "1", "--metric",
                                 "avg_jct", "--out", str(tmp_path / "b"), "workload=tiny",
                                 cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2
    assert "metric 'avg_jct' is not in" in result.stderr and "avg_jct_s" in result.stderr
    assert "did you mean 'avg_jct_s'?" in result.stderr
    # the mistyped command's first run is not left in --out, so the same command, fixed,
    # can use it (an --out that is not empty is refused)
    assert not (tmp_path / "b").exists()


def test_a_metric_the_workload_does_not_measure_is_refused_after_the_first_run(tmp_path,
                                                                               capfd):
    """A summary key whose value is null (avg_perplexity of classification jobs) passed the
    first run's check; every run ran, then the report refused, the runs left unreportable."""
    result = accelopt_in_process("bench", "--plugins", "noop", "--repeats", "1", "--metric",
                                 "avg_perplexity", "--out", str(tmp_path / "b"),
                                 "workload=tiny", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: metric 'avg_perplexity' has no value in the baseline run's metrics.json "
        "summary (None: this workload does not measure it); choose one of: "), result.stderr
    assert not (tmp_path / "b").exists()


def test_an_out_directory_with_results_is_refused_before_anything_runs(tmp_path, capfd):
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench.md").write_text("an earlier bench")
    result = accelopt_in_process("bench", "--plugins", "noop", "--repeats", "1", "--out",
                                 str(out), "workload=tiny", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--out {out} is not empty" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["bench.md"]
    assert (out / "bench.md").read_text() == "an earlier bench"


@pytest.mark.timeout(60)
def test_a_bench_that_cannot_compare_or_write_is_one_line_before_anything_runs(tmp_path):
    """``--sets '[]'`` failed after launch with an OmegaConf merge error and left an --out
    that the same command then refused; ``--out FILE`` and an --out inside a file were
    tracebacks."""
    blocker = tmp_path / "file"
    blocker.write_text("kept")
    cases = [
        (["--sets", "[]"], "--sets '[]' is the baseline alone"),
        (["--sets", "[],[noop],[noop]"], "--sets names [noop] more than once"),
        (["--plugins", "noop", "--out", str(blocker)], f"--out {blocker} is a file"),
        (["--plugins", "noop", "--out", str(blocker / "b")],
         "is a file, not a directory; give --out a directory you can write"),
    ]
    for args, needle in cases:
        with pytest.raises(UserError, match=re.escape(needle)) as info:
            bench_command([*args, "--repeats", "1", "workload=tiny"])
        assert "\n" not in str(info.value)
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "kept"


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


@pytest.mark.timeout(120)
def test_sigterm_stops_the_sweep_too(tmp_path):
    """The sweep is a child process: a SIGTERMed bench stops it before exiting, rather than
    leaving it training under init."""
    out = tmp_path / "b"
    proc = subprocess.Popen(
        accelopt_cmd("bench", "--plugins", "noop", "--repeats", "50", "--no-eval", "--out",
                     str(out), "workload=tiny"),
        cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not (sweep := _children(proc.pid)) or not (out / "runs").is_dir():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the sweep never started"
            time.sleep(0.05)  # polling /proc, not synchronising threads
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr.decode()[-2000:]
    for child in sweep:
        assert not Path(f"/proc/{child}").exists(), "the sweep outlived the bench"


def test_paired_interaction_cancels_drift_between_repeats():
    # the machine slows down from repeat to repeat, by the same factor for every set; within
    # each repeat, a+b is 1.2x faster than the product of a's and b's gains (synergy)
    slow = (1.0, 1.3, 1.6)
    base = SetResult((), tuple(10.0 * k for k in slow), repeats=(0, 1, 2))
    a = SetResult(("a",), tuple(5.0 * k for k in slow), repeats=(0, 1, 2))
    b = SetResult(("b",), tuple(8.0 * k for k in slow), repeats=(0, 1, 2))
    ab = SetResult(("a", "b"), tuple(4.0 / 1.2 * k for k in slow), repeats=(0, 1, 2))
    combo = {s.label: s for s in summarize([base, a, b, ab], "duration_s")}["a+b"]
    assert math.isclose(combo.interaction_low, 1.2) and math.isclose(combo.interaction_high, 1.2)
    assert combo.verdict == "synergistic"
    unpaired = [SetResult(r.plugins, r.values) for r in (base, a, b, ab)]
    loose = {s.label: s for s in summarize(unpaired, "duration_s")}["a+b"]
    assert loose.verdict.startswith("inconclusive")  # the drift swamps the unpaired bound


def _finished_bench(out: Path, repeats: int = 3) -> dict[str, bytes]:
    """A finished bench's directory as the sweep leaves it (runs/<n>/metrics.json, noop and
    clip with their combination, fixed values) and its report; returns the report's bytes."""
    from accelopt.bench.runner import collect, report
    from accelopt.report.console import default_console

    plan = run_plan([[], ["clip"], ["noop"], ["clip", "noop"]], repeats)
    value = {(): 1.0, ("clip",): 0.8, ("noop",): 1.0, ("clip", "noop"): 0.8}
    for i, (repeat, plugins, _) in enumerate(plan):
        (out / "runs" / str(i)).mkdir(parents=True)
        metric = value[tuple(plugins)] * (1 + 0.01 * repeat)
        (out / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": {"avg_jct_s": metric, "throughput": 1 / metric},
             "run": {"plugins": plugins}}))
    context = {"command": "accelopt bench", "metric": "avg_jct_s", "higher_is_better": False,
               "repeats": repeats, "machine": "m", "python": "3", "settings": "s",
               "sweep_s": 1.0, "quality": None}
    results, left_out = collect(out / "runs", "avg_jct_s", plan)
    assert left_out == []
    report(results, context, plan, out, default_console())
    return {name: (out / name).read_bytes() for name in ("bench.json", "bench.md", "bench.png")}


def test_reanalyze_names_a_corrupt_run_in_one_line(tmp_path):
    """A corrupt run's metrics.json was a JSONDecodeError traceback, exit 1."""
    before = _finished_bench(tmp_path)
    (tmp_path / "runs" / "5" / "metrics.json").write_text("{bad")
    with pytest.raises(UserError) as info:
        bench_command(["--reanalyze", "--out", str(tmp_path)])
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert f"{tmp_path / 'runs' / '5' / 'metrics.json'} (Expecting property name" in message
    assert "([clip], repeat 0)" in message
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_reanalyze_refuses_to_replace_a_report_with_fewer_runs(tmp_path, capsys):
    """A missing run was dropped in silence and the report rewritten from the rest (a set's
    median of 1 run instead of 2, the same verdict); now the runs are named and the report
    is kept, or written with --force naming them."""
    before = _finished_bench(tmp_path)
    shutil.rmtree(tmp_path / "runs" / "6")  # [noop], repeat 0
    with pytest.raises(UserError) as info:
        bench_command(["--reanalyze", "--out", str(tmp_path)])
    message = str(info.value)
    assert "1 measured run(s) of the plan" in message and "\n" not in message
    assert f"{tmp_path / 'runs' / '6' / 'metrics.json'} (missing) ([noop], repeat 0)" in message
    assert "--force" in message
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    capsys.readouterr()
    assert bench_command(["--reanalyze", "--force", "--out", str(tmp_path)]) == 0
    assert "reported without 1 run(s) of the plan (--force)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["context"]["missing_runs"] == [f"{tmp_path / 'runs' / '6' / 'metrics.json'} "
                                                "(missing) ([noop], repeat 0)"]
    assert {s["label"]: s["n"] for s in saved["sets"]}["noop"] == 2
    assert "**Runs missing from this report**" in (tmp_path / "bench.md").read_text()
    with pytest.raises(UserError, match="--force goes with --reanalyze"):
        bench_command(["--force", "--plugins", "noop", "--out", str(tmp_path / "new")])
    assert len(saved["runs"]) == len(json.loads(before["bench.json"])["runs"])


def test_reanalyze_reports_another_metric_the_runs_measured_and_refuses_new_sets(tmp_path):
    """--reanalyze --metric X printed the bench's own metric again, and --plugins or
    overrides beside --reanalyze were ignored in silence."""
    own = _finished_bench(tmp_path)
    assert bench_command(["--reanalyze", "--out", str(tmp_path), "--metric", "throughput"]) == 0
    # beside the bench's own report, which stays as it was (it was replaced, and a later
    # plain --reanalyze reported the other metric as the bench's own)
    assert {name: (tmp_path / name).read_bytes() for name in own} == own
    saved = json.loads((tmp_path / "bench-throughput.json").read_text())
    assert saved["context"]["metric"] == "throughput"
    assert saved["context"]["higher_is_better"] is True  # guessed from the new metric's name
    assert saved["context"]["command"].endswith(
        "(reanalyzed: --metric throughput --higher-is-better yes)")
    clip = {s["label"]: s for s in saved["sets"]}["clip"]
    assert clip["median"] == pytest.approx(1 / 0.808)  # 1/0.8 x 1/1.01, the middle repeat
    assert "# Ablation: throughput" in (tmp_path / "bench-throughput.md").read_text()
    assert (tmp_path / "bench-throughput.png").is_file()
    assert bench_command(["--reanalyze", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["context"]["metric"] == "avg_jct_s"
    # --repeats and --no-eval were ignored in silence too
    for extra in (["--plugins", "noop"], ["workload=tiny"], ["--repeats", "7"], ["--no-eval"],
                  ["--repeats=7"]):
        with pytest.raises(UserError, match=f"--reanalyze runs nothing: .*; drop "
                           f"{extra[0].split('=')[0]}"):
            bench_command(["--reanalyze", "--out", str(tmp_path), *extra])


def test_runs_that_did_not_measure_are_left_out_and_named(tmp_path):
    """A run whose job diverged or failed, or whose metric is null, counted as a
    measurement (or its set vanished from the report without a word)."""
    from accelopt.bench.runner import collect

    plan = run_plan([[], ["a"], ["b"]], 2)
    summaries = {("a", 0): {"n_jobs": 2, "n_diverged": 1}, ("a", 1): {"n_jobs": 2, "n_failed": 1},
                 ("b", 0): {"avg_jct_s": None}, ("b", 1): {"error": "plugin 'b' raised"}}
    for i, (repeat, plugins, _) in enumerate(plan):
        summary = {"avg_jct_s": 1.0 + repeat, **summaries.get((*plugins, repeat), {})}
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": summary, "run": {"plugins": plugins}}))
    results, left_out = collect(tmp_path / "runs", "avg_jct_s", plan)
    assert [(r.plugins, r.values) for r in results] == [((), (1.0, 2.0))]
    assert [line.split(" (run")[0] + line.split(")", 1)[1] for line in left_out] == [
        "[a] repeat 0: 1 of its 2 job(s) diverged", "[b] repeat 0: its avg_jct_s is None",
        "[a] repeat 1: 1 of its 2 job(s) failed", "[b] repeat 1: the run failed: plugin 'b' raised"]


def test_bench_options_it_would_ignore_are_refused():
    from accelopt.bench.runner import parse_args

    with pytest.raises(UserError, match="give --plugins .* or --sets .*, not both"):
        parse_args(["--plugins", "clip", "--sets", "[],[noop]"])
    with pytest.raises(UserError, match="--metric needs a name"):
        parse_args(["--plugins", "noop", "--metric", ""])
    # the name left out: the next override was taken as the metric, and lost to the runs
    with pytest.raises(UserError, match=r"^--metric takes a key .*, got the override "
                                        r"'workload=tiny'; give the metric's name"):
        parse_args(["--plugins", "noop", "--metric", "workload=tiny"])


def test_a_bench_stopped_midway_can_be_reported_from_the_runs_it_finished(tmp_path, capsys):
    """A stopped bench wrote bench.json only at the end, so --reanalyze --force (the way
    to report a bench with runs missing) could not read it: the plan is written first."""
    from accelopt.bench.runner import _say_how_to_report_what_ran, _write_bench_json

    _finished_bench(tmp_path)
    saved = json.loads((tmp_path / "bench.json").read_text())
    plan = [(r["repeat"], r["plugins"], r["warmup"]) for r in saved["runs"]]
    _write_bench_json(tmp_path, {**saved["context"], "sweep_s": None}, [], plan)  # the plan
    for i in range(10, len(plan)):  # it stopped after run 9
        shutil.rmtree(tmp_path / "runs" / str(i))
    _say_how_to_report_what_ran(tmp_path, plan, "avg_jct_s")
    assert capsys.readouterr().err == (
        f"the bench stopped after 6 of its 12 measured runs; report them with: accelopt bench "
        f"--reanalyze --force --out {tmp_path}\n")
    with pytest.raises(UserError, match="cannot be read: .*; the bench did not finish "
                       r"\(rerun it, or add --force"):
        bench_command(["--reanalyze", "--out", str(tmp_path)])
    assert bench_command(["--reanalyze", "--force", "--out", str(tmp_path)]) == 0
    assert "the sweep did not finish" in capsys.readouterr().out
    assert "Sweep: did not finish." in (tmp_path / "bench.md").read_text()
    n = {s["label"]: s["n"] for s in json.loads((tmp_path / "bench.json").read_text())["sets"]}
    assert (n["baseline"], n["clip"]) == (1, 2)  # runs 4-9: repeat 0, then clip, noop of 1


def test_the_bench_owns_its_run_layout(tmp_path):
    """hydra.sweep.dir moved the runs out of --out; the bench then blamed the metric."""
    for override in ("hydra.sweep.dir=elsewhere", "hydra.sweep.subdir=x", "++hydra.sweep.dir=e"):
        with pytest.raises(UserError, match="choose the directory with --out") as info:
            bench_command(["--plugins", "noop", "--repeats", "1", "--out", str(tmp_path / "b"),
                           "workload=tiny", override])
        assert override in str(info.value)
    assert not (tmp_path / "b").exists()
    from accelopt.bench.runner import collect

    (tmp_path / "runs").mkdir()
    with pytest.raises(UserError, match=re.escape(f"no runs found under {tmp_path / 'runs'}")):
        collect(tmp_path / "runs", "duration_s", run_plan([[], ["noop"]], 1))


def test_overrides_may_come_between_the_options(capsys):
    """`accelopt bench --plugins noop workload=tiny --repeats 1 ...` and `accelopt matrix
    workload=tiny --max-size 1 run.seed=1` were 'unrecognized arguments'."""
    from accelopt.bench.runner import parse_args
    from accelopt.cli.commands import matrix

    opts = parse_args(["--plugins", "noop", "workload=tiny", "--repeats", "1", "--out", "bo1",
                       "run.seed=1"])
    assert (opts.plugins, opts.repeats, opts.out) == ("noop", 1, "bo1")
    assert opts.overrides == ["workload=tiny", "run.seed=1"]
    opts = parse_args(["--sets", "[],[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5",
                       "--repeats", "1", "workload=tiny"])
    assert opts.overrides == ["plugins.gpu_kernels.prune_amount=0.5", "workload=tiny"]
    assert matrix(["workload=tiny", "--max-size", "1", "run.seed=1", "--plugins", "noop",
                   "--format", "hydra"]) == 0
    assert capsys.readouterr().out.strip() == "+plugins=[],[noop]"


def test_a_sweep_whose_runs_fail_reports_the_others_and_names_them(tmp_path, capfd,
                                                                   monkeypatch):
    """A failed run's figures (its duration: the time to the crash) were reported as a
    measurement by --reanalyze, a set that crashed reading as a 36x gain; the bench itself
    stopped, saying it had (the sweep goes on past a failed run). The report is written
    from the runs that measured, names the others, and the bench exits 3. Both commands in
    this process (the sweep is a process of its own, finding the plugin by the environment
    it inherits)."""
    monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])  # tests/: plugins_for_tests
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:BOOM")
    out = tmp_path / "b"
    result = accelopt_in_process("bench", "--plugins", "boom", "--repeats", "1", "--no-eval",
                                 "--out", str(out), "workload=tiny", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 3, result.stderr
    line = the_error_line(result)
    assert re.match(r"error: 1 measured run\(s\) left out of the report: \[boom\] repeat 0 "
                    r"\(run \d\): the run failed: plugin 'boom' raised in hook "
                    r"accelopt_iteration_end: ValueError: boom", line), line
    assert "stopped" not in result.stderr
    saved = json.loads((out / "bench.json").read_text())
    assert [s["label"] for s in saved["sets"]] == ["baseline"]  # boom measured nothing
    assert "**Runs left out of this report**" in (out / "bench.md").read_text()
    monkeypatch.delenv("ACCELOPT_PLUGINS")  # --reanalyze runs nothing: it needs no plugin
    again = accelopt_in_process("bench", "--reanalyze", "--out", str(out), cwd=tmp_path,
                                capfd=capfd)
    assert again.returncode == 3 and "left out of the report" in again.stderr


def test_a_bench_none_of_whose_runs_measured_exits_3_naming_them(tmp_path, capsys):
    """Every run refused (its jobs did not fit the memory): the bench exited 2 with the
    'no run measured' line, though runs that did not measure are exit 3 everywhere else.
    A failed baseline run whose summary lacks the metric is no unknown metric either."""
    from accelopt.bench.runner import _missing_metric
    from accelopt.errors import JobsUnfinished

    plan = run_plan([[], ["noop"]], 1)
    for i, (_, plugins, _) in enumerate(plan):
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": {"duration_s": 0.5, "n_jobs": 2, "n_rejected": 2},
             "run": {"plugins": plugins}}))
    context = {"command": "accelopt bench", "metric": "avg_jct_s", "higher_is_better": False,
               "repeats": 1, "machine": "m", "python": "3", "settings": "s",
               "sweep_s": 1.0, "quality": None}
    (tmp_path / "bench.json").write_text(json.dumps(
        {"context": context, "sets": [],
         "runs": [{"run": i, "repeat": r, "plugins": p, "warmup": w}
                  for i, (r, p, w) in enumerate(plan)]}))
    with pytest.raises(JobsUnfinished, match=r"no run under .* measured avg_jct_s: \[\] "
                       r"repeat 0 \(run 2\): 2 of its 2 job\(s\) were refused; \[noop\]") as info:
        bench_command(["--reanalyze", "--out", str(tmp_path)])
    assert info.value.exit_code == 3 and "\n" not in str(info.value)
    assert _missing_metric(tmp_path / "runs" / "2" / "metrics.json", "avg_jct_s") == ""


def test_an_out_path_with_hydra_grammar_characters_is_one_directory(tmp_path, monkeypatch):
    """`--out a,b` was a Hydra sweep over two sweep directories: the sweep failed after the
    plan was written, with Hydra's 'Set the environment variable HYDRA_FULL_ERROR=1' as the
    only line. The path is now quoted for Hydra; what cannot be quoted is one line first."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import accelopt.bench.runner as runner

    commands: list[list[str]] = []

    def sweep(command, *args, **kwargs):
        commands.append(command)
        raise KeyboardInterrupt  # stop there: the command line is what is tested

    monkeypatch.setattr(runner, "_run_sweep", sweep)
    out = tmp_path / "a,b [c]=d"
    with pytest.raises(KeyboardInterrupt):
        bench_command(["--plugins", "noop", "--repeats", "1", "--out", str(out),
                       "workload=tiny"])
    (override,) = [a for a in commands[0] if a.startswith("hydra.sweep.dir=")]
    parsed = OverridesParser.create().parse_override(override)
    assert not parsed.is_sweep_override() and parsed.value() == str(out / "runs")
    for odd in ("it's", "a$b", "back\\slash"):
        with pytest.raises(UserError, match="read by Hydra's override grammar") as info:
            bench_command(["--plugins", "noop", "--repeats", "1", "--out",
                           str(tmp_path / odd), "workload=tiny"])
        assert "\n" not in str(info.value)
        assert not (tmp_path / odd).exists()  # refused before anything was written


def test_a_failed_sweep_says_its_cause_not_hydras_hint(tmp_path):
    from rich.console import Console

    from accelopt.bench.runner import _run_sweep

    (tmp_path / "runs").mkdir()
    command = [sys.executable, "-c", "print('error: the cause'); print('Set the environment "
               "variable HYDRA_FULL_ERROR=1 for a complete stack trace.'); raise SystemExit(1)"]
    with pytest.raises(UserError, match=r"the sweep failed \(exit 1\): the cause \(full log"):
        _run_sweep(command, tmp_path, 1, Console(file=io.StringIO()))


def test_an_out_holding_an_unfinished_bench_is_not_sent_to_reanalyze(tmp_path):
    """A bench stopped before its report left its plan (bench.json) and sweep.log: the same
    command was refused with 'or --reanalyze to report a finished one again', which then
    refused too (nothing finished)."""
    from accelopt.bench.runner import _write_bench_json

    plan = run_plan([[], ["noop"]], 1)
    _write_bench_json(tmp_path, {"metric": "duration_s"}, [], plan)
    (tmp_path / "sweep.log").write_text("error: the sweep failed\n")
    with pytest.raises(UserError) as info:
        bench_command(["--plugins", "noop", "--repeats", "1", "--out", str(tmp_path),
                       "workload=tiny"])
    message = str(info.value)
    assert "holds a bench that did not finish (0 of its 2 measured runs" in message
    assert "give another --out, or delete that directory" in message
    assert "--reanalyze" not in message and "\n" not in message
    (tmp_path / "runs" / "2").mkdir(parents=True)  # one measured run finished
    (tmp_path / "runs" / "2" / "metrics.json").write_text(json.dumps(
        {"summary": {"duration_s": 1.0}, "run": {"plugins": []}}))
    with pytest.raises(UserError, match=r"\(1 of its 2 measured runs measured duration_s; .*; "
                       r"or report those with --reanalyze --force"):
        bench_command(["--plugins", "noop", "--repeats", "1", "--out", str(tmp_path)])


def test_an_undefined_gain_is_null_in_json_and_n_a_on_screen(tmp_path):
    """A metric whose baseline is 0 (n_failed) wrote "gain": NaN (not JSON) into
    bench.json and showed 'nanx', the baseline's own gain included."""
    from rich.console import Console

    from accelopt.bench.runner import report

    results = [SetResult((), (0.0, 0.0, 0.0), repeats=(0, 1, 2)),
               SetResult(("noop",), (0.0, 1.0, 0.0), repeats=(0, 1, 2))]
    context = {"command": "accelopt bench", "metric": "n_failed", "higher_is_better": False,
               "repeats": 3, "machine": "m", "python": "3", "settings": "s", "sweep_s": 1.0,
               "quality": None}
    console = Console(file=io.StringIO(), width=200)
    report(results, context, run_plan([[], ["noop"]], 3), tmp_path, console)
    text = (tmp_path / "bench.json").read_text()

    def no_nan(constant: str) -> None:
        raise AssertionError(f"{constant} in bench.json")

    sets = {s["label"]: s for s in json.loads(text, parse_constant=no_nan)["sets"]}
    assert sets["baseline"]["gain"] == 1.0 and sets["noop"]["gain"] is None
    shown = console.file.getvalue()
    assert "nan" not in shown.lower().replace("n/a", "")
    assert re.search(r"baseline\s*│\s*0 │\s*0-0 │ 1\.000x │", shown), shown
    assert re.search(r"noop\s*│\s*0 │\s*0-1 │\s*n/a │", shown), shown
    assert "| baseline | 0 | 0-0 | 1.000x | – |" in (tmp_path / "bench.md").read_text()


def test_a_set_that_changed_nothing_is_flagged_not_credited(tmp_path):
    """Every run's rows said tictac and gradcomm changed nothing (inert), yet the table
    showed their gains and an interaction verdict."""
    from accelopt.bench.analysis import INERT_VERDICT
    from accelopt.bench.runner import collect

    plan = run_plan([[], ["clip"], ["noop"], ["clip", "noop"]], 3)
    value = {(): 1.0, ("clip",): 0.8, ("noop",): 0.7, ("clip", "noop"): 0.5}
    for i, (repeat, plugins, _) in enumerate(plan):
        rows = [{"plugin": "noop", "summary": "did nothing", "metrics": {"inert": 1}},
                {"plugin": "clip", "summary": "clipped", "metrics": {}}]
        (tmp_path / "runs" / str(i)).mkdir(parents=True)
        (tmp_path / "runs" / str(i) / "metrics.json").write_text(json.dumps(
            {"summary": {"avg_jct_s": value[tuple(plugins)] * (1 + 0.01 * repeat)},
             "run": {"plugins": plugins},
             "plugins": [r for r in rows if r["plugin"] in plugins]}))
    results, _ = collect(tmp_path / "runs", "avg_jct_s", plan)
    assert {r.plugins: r.inert for r in results} == {
        (): (), ("clip",): (), ("noop",): ("noop",), ("clip", "noop"): ("noop",)}
    verdicts = {s.label: s.verdict for s in summarize(results, "avg_jct_s")}
    assert verdicts["noop"] == INERT_VERDICT == "inert: changed nothing in its runs (its gain " \
        "is noise)"
    assert verdicts["clip"] == "alone"
    assert verdicts["clip+noop"].endswith("; noop changed nothing in its runs")
    assert summarize([*results[:1], SetResult(("noop",), (0.7,) * 3, inert=("noop",)),
                      SetResult(("clip", "noop"), (0.5,) * 3, inert=("clip", "noop")),
                      SetResult(("clip",), (0.8,) * 3)], "avg_jct_s")[2].verdict == INERT_VERDICT


def test_the_min_max_column_is_never_cut(tmp_path):
    """'0.01183-0.011…': on a narrow terminal the figures were cut; they wrap now, and
    show fewer digits (the run-to-run noise is in the third)."""
    from rich.console import Console

    from accelopt.bench.render import render_table

    results = [SetResult((), (0.011834, 0.011951, 0.0119), repeats=(0, 1, 2)),
               SetResult(("noop",), (0.01201, 0.01183, 0.0125), repeats=(0, 1, 2))]
    context = {"metric": "avg_jct_s", "higher_is_better": False, "repeats": 3}
    for width, whole in ((120, True), (80, False)):
        console = Console(file=io.StringIO(), width=width)
        console.print(render_table(summarize(results, "avg_jct_s"), context))
        shown = console.file.getvalue()
        assert "…" not in shown, shown
        if whole:  # on one line where the terminal is wide enough
            assert "0.0118-0.012 " in shown and "0.0118-0.0125" in shown, shown
        else:
            assert "0.0118-" in shown and "0.0125" in shown, shown


def test_the_quality_column_of_a_language_model_bench_is_its_perplexity(tmp_path):
    """A bench of a language model said "no run scored a training job on a held-out set"
    and left the quality column empty, though every run had scored its perplexity: a plugin
    that cost perplexity (131 -> 168) showed only its speed."""
    from rich.console import Console

    from accelopt.bench.runner import with_quality

    plan = [(-1, [], True), (-1, ["gradcomm"], True), (0, [], False), (0, ["gradcomm"], False)]
    for n, (_repeat, plugins, _warmup) in enumerate(plan):
        run = tmp_path / str(n)
        run.mkdir()
        ppl = 131.4 if not plugins else 168.0
        (run / "metrics.json").write_text(json.dumps({
            "run": {"plugins": plugins}, "summary": {},
            "jobs": [{"quality": ppl, "quality_metric": "perplexity"}]}))
    context = {"quality": "top1"}
    said = io.StringIO()
    results = with_quality([SetResult((), (1.0,)), SetResult(("gradcomm",), (0.5,))], tmp_path,
                           plan, Console(file=said), context=context)
    assert [r.quality for r in results] == [(131.4,), (168.0,)]
    assert context["quality"] == "perplexity" and "no run scored" not in said.getvalue()
    report = render_markdown(summarize(results, "duration_s"), {
        "command": "accelopt bench", "metric": "duration_s", "higher_is_better": False,
        "repeats": 1, "machine": "m", "python": "3", "settings": "", "sweep_s": 1.0,
        **context})
    assert "perplexity (median)" in report and "168.0000" in report
    assert "held-out perplexity of each run's language models (lower is better)" in report
