"""The numbers of the ``cluster`` section refused in one line when they are nan, inf or out of
range: ``nan <= 0`` is false, so a plain ``> 0`` check let ``cluster.bucket_mb=nan`` through
to ``int(nan * 2**20)`` (a raw ValueError; inf an OverflowError), and
``cluster.timeout_s=nan`` into a rank's ``timedelta``."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig
from accelopt.drivers.cluster.settings import (
    bucket_bytes,
    local_info,
    parse_duration,
    parse_rate,
    settings_from,
)
from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

TINY = ["workload=tiny", "run.progress=false"]


def _cluster(**kw):
    cfg = OmegaConf.structured(ClusterConfig)
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _one_line(info: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(info.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize("key", ["bucket_mb", "timeout_s"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_cluster_runs_numbers_are_finite(key, value, mode):
    with pytest.raises(ConfigError) as info:
        settings_from(_cluster(mode=mode, **{key: float(value)}))
    _one_line(info, f"cluster.{key} must be a finite number > 0 (", f"got {value}")


@pytest.mark.parametrize("key", ["bucket_mb", "timeout_s"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_one_process_runs_numbers_are_finite(key, value):
    """``local_info`` is what a one-process run and ``accelopt.attach`` record."""
    with pytest.raises(ConfigError) as info:
        local_info(_cluster(**{key: float(value)}))
    _one_line(info, f"cluster.{key} must be a finite number > 0", f"got {value}")


def test_too_large_and_non_positive_numbers_are_one_line():
    with pytest.raises(ConfigError) as info:
        bucket_bytes(_cluster(bucket_mb=1e300))  # int(1e300 * 2**20): an OverflowError
    _one_line(info, "cluster.bucket_mb must be at most 1e+12 (MiB per gradient bucket)")
    with pytest.raises(ConfigError) as info:
        settings_from(_cluster(mode="ps", timeout_s=1e300))  # timedelta overflows
    _one_line(info, "cluster.timeout_s must be at most 1e+09")
    with pytest.raises(ConfigError) as info:
        settings_from(_cluster(mode="ps", timeout_s=0))
    _one_line(info, "cluster.timeout_s must be > 0 (seconds a rank waits for the others)")
    assert bucket_bytes(_cluster(bucket_mb=0.01)) == 10485


def test_rates_and_durations_too_long_for_a_float_are_one_line():
    """Hundreds of digits match the pattern; ``float()`` makes them inf and ``int(inf)``
    raised an OverflowError (a rate) or the latency was inf (a duration)."""
    with pytest.raises(ConfigError) as info:
        parse_rate("9" * 400 + "gbit")
    _one_line(info, "cluster.network.bandwidth:", "is not a finite rate; write e.g. 1gbit")
    with pytest.raises(ConfigError) as info:
        parse_duration("9" * 400 + "ms")
    _one_line(info, "cluster.network.latency:", "is not a finite duration; write e.g. 1ms")


@pytest.mark.parametrize("override, needle", [
    ("cluster.bucket_mb=nan", "cluster.bucket_mb must be a finite number > 0 (MiB per "
                              "gradient bucket), got nan"),
    ("cluster.timeout_s=inf", "cluster.timeout_s must be a finite number > 0"),
])
def test_a_run_refuses_them_before_it_starts(override, needle, tmp_path):
    import accelopt
    from accelopt.errors import UserError

    with pytest.raises(UserError) as info:
        accelopt.run([*TINY, override], run_dir=tmp_path / "never")
    _one_line(info, needle)
    assert not (tmp_path / "never").exists()


def test_attach_refuses_a_nan_bucket_size(tmp_path):
    from torch import nn

    import accelopt

    with pytest.raises(ConfigError) as info:
        accelopt.attach(nn.Linear(2, 2), ["cluster.bucket_mb=nan"], run_dir=tmp_path / "a")
    _one_line(info, "cluster.bucket_mb must be a finite number > 0", "got nan")


def test_the_command_says_it_in_one_line_with_exit_2(tmp_path):
    from clirun import accelopt

    out = tmp_path / "run"
    result = accelopt("run", *TINY, "cluster.bucket_mb=inf", f"hydra.run.dir={out}",
                      cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "OverflowError" not in result.stderr
    assert ("error: cluster.bucket_mb must be a finite number > 0 (MiB per gradient bucket), "
            "got inf") in result.stderr
