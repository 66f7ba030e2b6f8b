"""A job pruned after N iterations that had finished before a resume keeps its trained,
pruned model in the resumed run: its weights file, its checkpoint and gpu_kernels' row."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from clirun import run_in_process

PRUNED = ["workload=tiny", "cluster.mode=none", "run.progress=false", "run.compare=none",
          "run.checkpoint_every=2", "workload.jobs.0.iterations=6",
          "workload.jobs.1.iterations=6", "+plugins=[gpu_kernels]",
          "plugins.gpu_kernels.prune_amount=0.5", "plugins.gpu_kernels.prune_at_iteration=2"]


def _rows(record) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """gpu_kernels' row of each job of the run ``record``, by job name."""
    rows = [r for r in record.plugin_rows if r.plugin == "gpu_kernels"]
    return {r.metrics["job"]: r.summary for r in rows}


def _same(a: Any, b: Any) -> bool:
    """Whether two saved states are equal, tensors bitwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.timeout(120)
def test_a_pruned_job_finished_before_the_resume_keeps_its_pruned_weights(tmp_path):
    """The resume builds the job dense and gpu_kernels prunes it back from its state only
    once the run starts; the weights and the checkpoint of a job restored finished were
    written before that, from the dense model as built (net.1.weight (32, 64) where the
    run trained (16, 64)), and the row said it fine-tuned 0 iterations after pruning."""
    first = tmp_path / "first"
    old_rows = _rows(run_in_process(*PRUNED, run_dir=first))
    weights = {p.name: p.read_bytes() for p in (first / "weights").glob("*.pt")}
    assert len(weights) == 2
    (first / "metrics.json").unlink()  # as if stopped after both checkpoints, before the end
    new = tmp_path / "resumed"
    resumed = run_in_process(f"run.resume={first}", "run.progress=false", run_dir=new)
    for name, data in weights.items():
        assert (new / "weights" / name).read_bytes() == data, name  # bitwise
        old_ckpt = torch.load(first / "checkpoints" / name, weights_only=False)["job"]
        new_ckpt = torch.load(new / "checkpoints" / name, weights_only=False)["job"]
        assert "gpu_kernels" in old_ckpt["plugins"], name
        assert _same(new_ckpt, old_ckpt), name  # model, optimizer, random and plugin states
    new_rows = _rows(resumed)
    assert new_rows == old_rows
    assert all("fine-tuned 4 iterations after pruning" in row for row in new_rows.values())
    assert not any("warning" in row for row in new_rows.values()), new_rows


@pytest.mark.timeout(120)
def test_a_checkpoint_without_the_latest_iteration_says_so_instead_of_warning(tmp_path):
    """A checkpoint whose gpu_kernels state does not record the job's latest iteration (as
    written before it was kept): the row of the job restored finished says the count is not
    known, where it said "fine-tuned 0 iterations" and warned of a pruning at the last."""
    first = tmp_path / "first"
    run_in_process(*PRUNED, run_dir=first)
    for path in (first / "checkpoints").glob("*.pt"):
        state = torch.load(path, weights_only=False)
        state["job"]["plugins"]["gpu_kernels"].pop("last_iteration", None)
        torch.save(state, path)
    (first / "metrics.json").unlink()
    resumed = run_in_process(f"run.resume={first}", "run.progress=false",
                             run_dir=tmp_path / "resumed")
    rows = _rows(resumed)
    assert len(rows) == 2
    for row in rows.values():
        assert "node-pruned" in row and "does not record how many iterations" in row, row
        assert "warning" not in row and "fine-tuned 0" not in row, row


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("one_numba_thread")
def test_a_slide_job_finished_before_the_resume_keeps_its_plugin_state(tmp_path):
    """Any plugin's state of a job restored finished: its checkpoint in the resumed run was
    written from the job before the plugins had their states back, so slide's said the job
    had run 0 iterations (a further resume's row said it resumed at 0)."""
    from test_slide_inputs import tiny_xc_run

    first = tmp_path / "first"
    run_in_process(*tiny_xc_run(tmp_path, "workload.jobs.0.iterations=4",
                                "run.checkpoint_every=2"), run_dir=first)
    (first / "metrics.json").unlink()
    new = tmp_path / "resumed"
    run_in_process(f"run.resume={first}", "run.progress=false", run_dir=new)
    (name,) = [p.name for p in (first / "checkpoints").glob("*.pt")]
    old_ckpt = torch.load(first / "checkpoints" / name, weights_only=False)["job"]
    new_ckpt = torch.load(new / "checkpoints" / name, weights_only=False)["job"]
    assert old_ckpt["plugins"]["slide"] == {"iterations": 4}
    assert _same(new_ckpt, old_ckpt)
    assert (new / "weights" / name).read_bytes() == (first / "weights" / name).read_bytes()
