"""salus's ``gittins`` policy (Tiresias's Gittins index): it knows the distribution of job
lengths, from a history file and the run's finished jobs, never a job's own length. Each
assertion fails for a plausible wrong policy (LAS, SRTF, an index that ignores the
iteration time or the history)."""

from __future__ import annotations

import pytest
from accelopt_plugins.salus import PLUGIN, SalusConfig
from accelopt_plugins.salus.plugin import SalusPlugin
from accelopt_plugins.salus.policies import Gittins, gittins_index, make_policy, read_history

from accelopt import ConfigError, JobInfo, JobState

pytestmark = pytest.mark.timeout(120)


def _state(job_id, *, iterations=1000, done=0, service=None, arrival=0.0, last=None):
    info = JobInfo(job_id=job_id, name=job_id, model="mlp", kind="train", arrival_s=arrival,
                   iterations=iterations, batch_size=8)
    return JobState(job=info, lane="L0", iterations_done=done,
                    service_seconds=float(done) if service is None else service,
                    last_iteration_seconds=last, admitted_at_s=0.0)


def _gittins(lengths=(), seconds=None):
    policy = make_policy("gittins")
    assert isinstance(policy, Gittins)
    policy.learn(lengths)
    policy.iteration_time = (lambda s: 1.0) if seconds is None else (
        lambda s: seconds[s.job.job_id])
    return policy


def test_index_by_hand():
    """Lengths 10 and 100, nothing run: giving 10 more iterations finishes half the jobs at
    an expected cost of 10 (0.05), giving 100 finishes all at 55 (0.018): the index is 0.05.
    After 9: one more iteration finishes half at a cost of 1: 0.5. Past 10: only the
    100-iteration job is left, 1/90. Past 100: no index."""
    assert gittins_index([10, 100], 0) == pytest.approx(0.05)
    assert gittins_index([10, 100], 9) == pytest.approx(0.5)
    assert gittins_index([10, 100], 10) == pytest.approx(1 / 90)
    assert gittins_index([10, 100], 100) is None
    # ties are counted together: three jobs of 10, then one of 40
    assert gittins_index([10, 10, 10, 40], 0) == pytest.approx(0.75 / (10 * 0.75 + 10 * 0.25))


def test_a_job_about_to_finish_runs_before_a_new_one_which_las_would_run():
    """History: half the jobs run 10 iterations, half 100. A job 9 iterations in is likely
    one from its end; LAS runs the new job (least service), gittins the one about to end."""
    near = _state("00-near", done=9, arrival=0.0)
    new = _state("01-new", done=0, arrival=1.0)
    assert make_policy("las").select("L0", [near, new], 0.0) == "01-new"
    assert _gittins([10, 100] * 5).select("L0", [near, new], 0.0) == "00-near"
    # past the short jobs' length it is likely a long one: the new job goes first
    past = _state("00-past", done=10, arrival=0.0)
    assert _gittins([10, 100] * 5).select("L0", [past, new], 0.0) == "01-new"


def test_the_index_is_per_second_of_the_jobs_own_iteration_time():
    """Both new: the same index per iteration, but one iterates 10x faster, so its chance of
    finishing per second is 10x higher (an index per iteration would tie, then arrival)."""
    slow = _state("00-slow", arrival=0.0)
    fast = _state("01-fast", arrival=1.0)
    policy = _gittins([10, 100], seconds={"00-slow": 1.0, "01-fast": 0.1})
    assert policy.select("L0", [slow, fast], 0.0) == "01-fast"


def test_without_history_or_beyond_it_it_is_las():
    """No history: least attained service, as LAS. A job that outlived every past length has
    no index: it runs after any job that has one, whatever their services."""
    a, b = _state("00-a", done=5), _state("01-b", done=2)
    assert _gittins().select("L0", [a, b], 0.0) == "01-b"
    veteran = _state("00-vet", done=200, service=0.5)  # cheap so far, but beyond history
    young = _state("01-young", done=3, service=3.0)
    assert _gittins([10, 100]).select("L0", [veteran, young], 0.0) == "01-young"


def test_its_row_says_when_it_decided_as_las():
    """Without a history every choice is LAS's, yet the row read "policy gittins" alone: a
    reader took LAS's figures for the index's."""
    a, b = _state("00-a", done=5), _state("01-b", done=2)
    blind = _gittins()
    blind.select("L0", [a, b], 0.0)
    blind.select("L0", [a], 0.0)  # one ready job: no choice, not counted
    assert blind.note() == ("0 of 1 choices by the Gittins index; the others least attained "
                            "service first (LAS), no past job having run longer: give past "
                            "lengths with plugins.salus.history")
    informed = _gittins([10, 100])
    informed.select("L0", [a, b], 0.0)
    assert informed.note() is None  # every choice by the index: nothing to add
    # both beyond every past length: no index, least attained service decides
    informed.select("L0", [_state("00-vet", done=200), _state("01-old", done=150)], 0.0)
    assert informed.note() is not None and informed.note().startswith("1 of 2 choices by")
    assert not informed.note().endswith("plugins.salus.history")


def test_finished_jobs_teach_it_lengths():
    policy = _gittins()
    assert policy.index(0) is None
    policy.finished("00-a", 10)
    policy.finished("01-b", 100)
    assert policy.lengths == [10, 100]
    assert policy.index(9) == pytest.approx(0.5)


def test_history_file_formats_and_errors(tmp_path):
    good = tmp_path / "lengths.txt"
    good.write_text("# past jobs\n10, 20 30\n\n40  # the last one\n")
    assert read_history(str(good)) == [10, 20, 30, 40]
    with pytest.raises(ConfigError, match=r"cannot read .*missing.txt"):
        read_history(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_text("10\n2.5\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: '2.5' is not a job length"):
        read_history(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no job length"):
        read_history(str(empty))


def _configured(policy, history):
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig

    plugin = SalusPlugin(SalusConfig(policy=policy, history=history))
    plugin.accelopt_configure(config=SalusConfig(policy=policy, history=history),
                              run_config=OmegaConf.structured(AccelConfig))
    return plugin


def test_the_plugin_reads_the_history_and_learns_from_the_runs_finished_jobs(tmp_path):
    history = tmp_path / "lengths.txt"
    history.write_text("10\n100\n")
    plugin = _configured("gittins", str(history))
    assert plugin.policy.lengths == [10, 100]
    job = _state("00-a", iterations=30).job
    plugin.accelopt_release(job=job, lane="L0", status="done")
    plugin.accelopt_release(job=_state("01-b", iterations=7).job, lane="L0", status="failed")
    assert plugin.policy.lengths == [10, 30, 100]  # a failed job's length is not a length
    with pytest.raises(ConfigError, match=r"history is read only by a policy that learns.*"
                                          r"'srtf' does not"):
        _configured("srtf", str(history))


def test_a_run_under_gittins(run_tiny, tmp_path):
    """End to end: every job done, the policy named in the row."""
    history = tmp_path / "lengths.txt"
    history.write_text("3 6 12\n")
    record = run_tiny(PLUGIN, overrides=["plugins.salus.policy=gittins",
                                         f"plugins.salus.history={history}",
                                         "plugins.salus.capacity=1GiB", "plugins.salus.threads=1",
                                         "run.threads=1"], workload="salus_mix")
    assert all(r.status == "done" for r in record.jobs)
    row = next(r for r in record.plugin_rows if r.plugin == "salus")
    assert row.metrics["policy"] == "gittins"


def test_history_refuses_non_ascii_digits_as_a_config_error(tmp_path):
    """'²' passes str.isdigit() but int() refuses it: it must be the same one-line config
    error naming the file and line as any other bad word, not a ValueError from int()."""
    bad = tmp_path / "h.txt"
    bad.write_text("12\n\u00b2\n")
    with pytest.raises(ConfigError, match=r"h.txt:2: '\u00b2' is not a job length"):
        read_history(str(bad))
    arabic = tmp_path / "arabic.txt"
    arabic.write_text("\u0661\u0662\n")  # Arabic-Indic digits: int() would take them silently
    with pytest.raises(ConfigError, match=r"arabic.txt:1: .* is not a job length"):
        read_history(str(arabic))
