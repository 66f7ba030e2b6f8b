"""gpu_kernels' conv autotuning cache as a run sees it: a path that cannot be the cache is
refused before the run, a write the machine refuses never fails the job, a corrupt cache
and an unsaved one are said in the report row (not only on stderr), and the default path
follows ``XDG_CACHE_HOME``."""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pytest
import torch
from accelopt_plugins.gpu_kernels import autotune as at
from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig
from accelopt_plugins.gpu_kernels.plugin import GpuKernelsPlugin
from clirun import accelopt_in_process, the_error_line
from test_gpu_kernels_edges import gpu_kernels_row
from torch import nn

import accelopt

pytestmark = pytest.mark.timeout(120)


def _cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))


def _conv_row(tmp_path: Path, cache: Path) -> accelopt.ReportRow:
    """gpu_kernels' row after 2 iterations of a one-conv model autotuned with ``cache``."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gpu_kernels_row(_cnn(), x, y, ["plugins.gpu_kernels.conv_autotune=true",
                                              "plugins.gpu_kernels.autotune_reps=3",
                                              f"plugins.gpu_kernels.conv_cache={cache}"],
                               2, tmp_path / "r")


def test_a_directory_as_the_cache_is_refused_in_one_line(tmp_path: Path, capfd) -> None:
    """A directory was warned about as a "corrupted" cache, then the first decision's write
    failed the job (IsADirectoryError, exit 3)."""
    (tmp_path / "d2" / "c.json").mkdir(parents=True)
    result = accelopt_in_process(
        "run", "workload=tiny", "run.progress=false", "cluster.mode=none",
        "+plugins=[gpu_kernels]", "plugins.gpu_kernels.conv_autotune=true",
        "plugins.gpu_kernels.conv_cache=d2/c.json", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = the_error_line(result)
    assert "plugins.gpu_kernels.conv_cache=d2/c.json" in line
    assert "is a directory, not a file" in line and "conv_cache=''" in line
    assert "Traceback" not in result.stderr and "corrupted" not in result.stderr


def test_a_cache_write_refused_during_the_run_does_not_fail_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any OSError writing the cache (a full disk here) failed the training job; now the
    decision is used and the row says it was not saved, and why."""
    def full_disk(path: Path, *_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(at, "atomic_open", full_disk)
    cache = tmp_path / "conv.json"
    row = _conv_row(tmp_path, cache)
    assert f"conv decisions not saved to {cache} (No space left on device" in row.summary
    assert "\n" not in row.summary and row.metrics["conv_cache_unsaved"] == 1
    assert "autotuned 1 conv" in row.summary and not cache.exists()


def test_an_unsaved_decision_is_kept_in_memory(tmp_path: Path) -> None:
    """The library's view of the same (a directory where the cache should be, made after
    the run was checked): ``choose`` returns, ``unsaved`` says why, and a later write that
    succeeds clears it."""
    torch.manual_seed(0)
    conv, x = nn.Conv2d(2, 3, 3, padding=1), torch.randn(2, 2, 6, 6)
    (tmp_path / "d.json").mkdir()
    with pytest.warns(at.CacheCorruptedWarning):
        cache = at.DecisionCache.load(tmp_path / "d.json")
    decision = at.ConvAutotuner(cache, reps=3).choose(conv, x)
    assert [e["algorithm"] for e in cache.entries.values()] == [decision.algorithm]
    assert cache.unsaved is not None and "Is a directory" in cache.unsaved
    unreadable, unsaved = cache.notes()
    assert unreadable == f"conv cache {cache.path} was unreadable (Is a directory): rebuilt"
    assert unsaved.startswith(f"conv decisions not saved to {cache.path} (Is a directory)")
    cache.path = tmp_path / "c.json"
    cache.put("other", decision)
    assert cache.unsaved is None and cache.path.exists()
    assert [n for n in cache.notes() if "not saved" in n] == []


@pytest.mark.parametrize(("text", "why"), [
    ('{"version": 1, "entries": {"k": ', "not valid JSON"),
    ('{"version": 1, "entries": {"k": 3}}', "malformed entries"),
    ("[1, 2, 3]", "not an accelopt gpu_kernels cache"),
])
def test_a_corrupt_cache_is_said_in_the_row(tmp_path: Path, text: str, why: str) -> None:
    """A truncated or ill-typed cache was a warning on stderr only; the row (and so
    metrics.json) now says it was unreadable and rebuilt."""
    cache = tmp_path / "conv.json"
    cache.write_text(text)
    row = _conv_row(tmp_path, cache)
    assert f"conv cache {cache} was unreadable ({why}" in row.summary, row.summary
    assert "): rebuilt" in row.summary and "\n" not in row.summary
    assert row.metrics["conv_cache_rebuilt"] == 1
    assert "not saved" not in row.summary


def _default_cache() -> Path | None:
    plugin = GpuKernelsPlugin(GpuKernelsConfig(conv_autotune=True))
    return plugin._tuner().cache.path


def test_the_default_cache_follows_xdg_cache_home(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _default_cache() == tmp_path / "xdg" / "accelopt" / "gpu_kernels_conv.json"
    # unset, or relative (which the XDG spec says to ignore): under ~/.cache
    for value in (None, "relative/dir"):
        if value is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", value)
        want = tmp_path / "home" / ".cache" / "accelopt" / "gpu_kernels_conv.json"
        assert _default_cache() == want


def _prune_row(tmp_path: Path, amount: str) -> accelopt.ReportRow:
    """gpu_kernels' row for a 16-32-32-4 MLP pruned by ``amount`` at build time."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = accelopt.attach(model, ["+plugins=[gpu_kernels]",
                                     f"plugins.gpu_kernels.prune_amount={amount}"],
                             example=(x, y), lr=0.1, iterations=1, run_dir=tmp_path / amount)
        (row,) = [r for r in ao.close() if r.plugin == "gpu_kernels"]
    return row


@pytest.mark.parametrize("amount", ["0.01", "1e-09"])
def test_an_amount_that_rounds_to_no_unit_says_so(tmp_path: Path, amount: str) -> None:
    """0.01 of 32 units is 0.32, rounded down to none: the row said "no prunable layer",
    although the model has two (0.05 prunes both)."""
    row = _prune_row(tmp_path, amount)
    assert "no prunable layer" not in row.summary, row.summary
    assert (f"prune_amount={float(amount):g} removes no unit of any of the 2 prunable layers: "
            "it rounds to 0 of 32 units") in row.summary
    assert "an amount >= 0.03125 removes one unit" in row.summary
    assert row.metrics["layers_pruned"] == 0 and "\n" not in row.summary
    pruned = _prune_row(tmp_path, "0.05")
    assert pruned.metrics["layers_pruned"] == 2 and "removes no unit" not in pruned.summary
