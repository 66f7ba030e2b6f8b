"""gpu_kernels under a loop of one's own (``accelopt.attach``): the plugin takes every hook
it put on the model off at ``close()`` (an armed pruning probe held a dense and a pruned
copy of the model and ran on the loop's first forward after it), and pruning after N
iterations keeps the interface of a sub-module the loop calls on its own (a GAN's
discriminator fed real data) instead of slicing it through the root module's forward."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelopt

pytestmark = pytest.mark.timeout(120)

PLUGIN_HOOK_OWNERS = ("_PruneProbe", "_ConvGuard", "ChannelsLast", "_LatePrune")


def _plugin_hooks(model: nn.Module) -> list[str]:
    """Every forward pre/post hook on ``model`` or a submodule bound to a gpu_kernels
    object."""
    found = []
    for path, module in model.named_modules():
        for table in (module._forward_pre_hooks, module._forward_hooks):
            for hook in table.values():
                owner = type(getattr(hook, "__self__", None)).__name__
                if owner in PLUGIN_HOOK_OWNERS or getattr(hook, "__module__", "").startswith(
                        "accelopt_plugins.gpu_kernels"):
                    found.append(f"{path or '<root>'}: {owner}")
    return found


def test_close_takes_the_pruning_probe_off_the_model(tmp_path: Path) -> None:
    """Pruned at build time and closed before any forward: the probe's hook stayed armed,
    holding a dense and a pruned deep copy, and ran on the loop's first forward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 5))
    ao = accelopt.attach(m, ["+plugins=[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5"],
                         run_dir=tmp_path / "y")
    assert _plugin_hooks(m)  # the probe waits for the first forward
    probe = next(h.__self__ for h in m._forward_pre_hooks.values()
                 if type(getattr(h, "__self__", None)).__name__ == "_PruneProbe")
    copies = [weakref.ref(probe.dense), weakref.ref(probe.pruned)]
    ao.close()
    assert _plugin_hooks(m) == []
    del probe
    gc.collect()
    assert [c() for c in copies] == [None, None]  # the copies are let go
    m(torch.randn(2, 16))  # the loop's own forward runs no probe


def test_close_takes_the_layout_and_conv_guard_hooks_off(tmp_path: Path) -> None:
    """channels_last and the conv guard hook the model too: none is left after close."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    ao = accelopt.attach(m, ["+plugins=[gpu_kernels]", "plugins.gpu_kernels.channels_last=on",
                             "plugins.gpu_kernels.conv_autotune=true",
                             "plugins.gpu_kernels.conv_cache=''"],
                         run_dir=tmp_path / "c")
    ao.model(torch.randn(2, 3, 8, 8))
    assert _plugin_hooks(m)  # channels_last converts every later input
    ao.close()
    assert _plugin_hooks(m) == []


class Gan(nn.Module):
    """The root forward is ``D(G(z))``; the loop also calls ``D`` on real data."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                               nn.Linear(32, 4))
        self.D = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                               nn.Linear(32, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.D(self.G(z))


def _train_gan(tmp_path: Path, d_alone: bool) -> tuple[Gan, accelopt.ReportRow]:
    """8 iterations of a GAN-style loop, pruned at the 5th. ``d_alone``: the loop calls
    ``m.D`` on real data itself; else only a deep copy of the model does (an EMA copy, say:
    its calls are not the loop's calls of ``m.D``)."""
    torch.manual_seed(0)
    m = Gan()
    z, real = torch.randn(16, 8), torch.randn(16, 4)
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    ao = accelopt.attach(m, ["+plugins=[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5",
                             "plugins.gpu_kernels.prune_at_iteration=5"],
                         example=(z, ones), lr=0.01, iterations=8, run_dir=tmp_path / "g")
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in ao.loop(range(8)):
        fake = F.binary_cross_entropy_with_logits(ao.model(z), zeros)
        if d_alone:
            loss = fake + F.binary_cross_entropy_with_logits(m.D(real), ones)
        else:
            ema = copy.deepcopy(m)
            ema.D(ema.G(z))
            loss = fake
        opt.zero_grad()
        ao.backward(loss)
        ao.step(opt)
    (row,) = [r for r in ao.close() if r.plugin == "gpu_kernels"]
    return m, row


def test_pruning_keeps_the_interface_of_a_child_the_loop_calls_alone(tmp_path: Path) -> None:
    """G's output and D's input (4 features) were pruned to 2 through the root forward, and
    the loop's ``m.D(real)`` then failed with a shape error right after the pruning."""
    m, row = _train_gan(tmp_path, d_alone=True)
    assert m.D[0].in_features == 4 and m.G[4].out_features == 4
    assert m.G[0].out_features == 16 and m.D[2].out_features == 16  # the insides are pruned
    assert "which the loop calls on its own" in row.summary
    assert "fine-tuned 3 iterations after pruning" in row.summary
    assert _plugin_hooks(m) == []


def test_children_called_only_through_the_forward_are_pruned_across(tmp_path: Path) -> None:
    """Only calls of the model's own children count: a deep copy's (run by the loop, or by
    the plugin's trial and measuring forwards) leaves the G -> D boundary prunable."""
    m, row = _train_gan(tmp_path, d_alone=False)
    assert m.D[0].in_features == 2 and m.G[4].out_features == 2
    assert "calls on its own" not in row.summary
    assert _plugin_hooks(m) == []
