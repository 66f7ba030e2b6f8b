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


def test_a_refused_directory_another_process_removes_meanwhile_is_gone_not_an_error(
        tmp_path, monkeypatch) -> None:
    """The two ranks of one torchrun launch refused alike share their run directory, and
    each removes it: the rank that came second raised FileNotFoundError through Hydra (a
    traceback, exit 1) instead of its one line."""
    import shutil
    from pathlib import Path

    from accelopt.cli import run_dirs

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("{}\n")
    (run_dir / "accelopt.log").touch()
    real_unlink = Path.unlink

    def the_peer_removed_it_all_first(self: Path, missing_ok: bool = False) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)  # the other rank, a moment earlier
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", the_peer_removed_it_all_first)
    assert run_dirs.remove_if_never_started(run_dir)
    assert not run_dir.exists()
