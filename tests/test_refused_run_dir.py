"""A run refused as it builds its jobs leaves its directory free: the same command, fixed,
runs there (the refused run's config.yaml and claim once refused it, "would write over")."""

from __future__ import annotations

import pytest
from torch import nn

import accelopt
from accelopt.errors import ConfigError
from accelopt.runtime.run_dir import CLAIM_FILE

TINY = ["workload=single", "workload.jobs.0.iterations=2", "workload.jobs.0.batch_size=8",
        "run.profile=false", "run.compare=none"]


def no_parameters(*, input_shape, num_classes) -> nn.Module:
    """A model with nothing to train: refused when its job is built."""
    return nn.Flatten()


@pytest.mark.timeout(120)
def test_a_run_refused_at_build_can_be_run_again_in_its_directory(tmp_path) -> None:
    out = tmp_path / "run"
    refused = [*TINY, "workload.jobs.0.model=test_refused_run_dir:no_parameters",
               "workload.jobs.0.dataset=byo_models:blobs"]
    for _ in range(2):  # the second refusal is the model's again, not "taken"/"write over"
        with pytest.raises(ConfigError, match="the model has nothing to train"):
            accelopt.run(refused, run_dir=out)
        assert not (out / "config.yaml").exists() and not (out / CLAIM_FILE).exists()
    record = accelopt.run(TINY, run_dir=out)  # fixed: it runs where the refused one did
    assert record.jobs[0].status == "done" and (out / "metrics.json").exists()
