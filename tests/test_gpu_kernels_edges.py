"""gpu_kernels on models and settings that used to fail a job that runs fine without it, or
to end it silently wrong: a forward that ``view``s a conv output under channels_last, an
unbatched Conv2d call under conv_autotune, pruning at the job's last iteration, and a layer
another plugin put in before pruning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelopt_plugins.gpu_kernels.autotune import AutotunedConv2d, ConvAutotuner, DecisionCache
from accelopt_plugins.gpu_kernels.conv_algos import ALGORITHMS, run_algorithm, supports
from accelopt_plugins.gpu_kernels.layout import ChannelsLast
from torch import nn

import accelopt
from accelopt import UserError
from accelopt.plugin import PluginWarning

pytestmark = pytest.mark.timeout(120)


class ViewCNN(nn.Module):
    """Flattens its conv output with ``view``: fine in NCHW, an error in NHWC."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        return self.fc(h.view(h.size(0), -1))


def test_channels_last_auto_falls_back_when_the_model_fails_in_nhwc() -> None:
    """auto let the NHWC copy's error escape: the job failed (the line blaming its inputs)
    and the row said "model never ran"."""
    torch.manual_seed(0)
    model, x = ViewCNN(), torch.randn(2, 3, 6, 6)
    want = model(x)
    layout = ChannelsLast(model, "auto", reps=1)
    out = model(x)
    d = layout.decision
    assert d is not None and not d.channels_last
    assert "view" in d.reason and ".reshape()" in d.reason, d.reason
    assert torch.allclose(out, want)
    assert model.c1.weight.is_contiguous()


def test_channels_last_on_refuses_in_one_line_naming_the_cause() -> None:
    torch.manual_seed(0)
    model = ViewCNN()
    ChannelsLast(model, "on")
    with pytest.raises(UserError) as info:
        model(torch.randn(2, 3, 6, 6))
    line = str(info.value)
    assert "\n" not in line and "channels_last=on" in line and "view" in line
    assert "channels_last=auto" in line and "off" in line


def test_channels_last_does_not_blame_the_layout_for_the_models_own_error() -> None:
    """A model that fails in both layouts fails with its own error, not a layout refusal."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(5, 2))
    ChannelsLast(model, "on")
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 3, 6, 6))
    assert not isinstance(info.value, UserError)


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "direct"])
def test_the_conv_algorithms_take_an_unbatched_input(algorithm: str) -> None:
    """nn.Conv2d takes (C, H, W); the algorithms unpacked (N, C, H, W) and raised."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1)
    assert supports(algorithm, conv)
    x = torch.randn(3, 8, 8)
    out = run_algorithm(algorithm, conv, x)
    assert out.shape == (5, 8, 8)
    assert torch.allclose(out, conv(x), atol=1e-4)


def test_an_autotuned_conv_takes_an_unbatched_input() -> None:
    """conv_autotune=true crashed on a per-sample conv ("not enough values to unpack"), the
    line blaming the dataset."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1)
    tuned = AutotunedConv2d.from_tuner(conv, ConvAutotuner(DecisionCache.load(None), reps=1))
    x = torch.randn(3, 8, 8)
    out = tuned(x)
    assert out.shape == (5, 8, 8) and torch.allclose(out, conv(x), atol=1e-4)
    assert len(tuned.decisions) == 1
    assert next(iter(tuned.decisions))[0] == (1, 3, 8, 8)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def gpu_kernels_row(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: list[str],
                    iterations: int, run_dir: Path, momentum: float = 0.0) -> accelopt.ReportRow:
    """gpu_kernels' row after ``iterations`` of a loop of one's own (``accelopt.attach``)
    training ``model`` on one batch under ``settings``."""
    ao = accelopt.attach(model, ["+plugins=[gpu_kernels]", *settings], example=(x, y),
                         lr=0.1, iterations=iterations, run_dir=run_dir)
    opt = torch.optim.SGD(ao.model.parameters(), lr=0.1, momentum=momentum)
    for _ in ao.loop(range(iterations)):
        loss = F.cross_entropy(ao.model(x), y)
        opt.zero_grad()
        ao.backward(loss)
        ao.step(opt)
    (row,) = [r for r in ao.close() if r.plugin == "gpu_kernels"]
    return row


def _late_prune_row(tmp_path: Path, at: int, iterations: int) -> accelopt.ReportRow:
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(4, (32,))
    return gpu_kernels_row(_mlp(), x, y, ["plugins.gpu_kernels.prune_amount=0.5",
                                          f"plugins.gpu_kernels.prune_at_iteration={at}"],
                           iterations, tmp_path / "r", momentum=0.9)


def test_pruning_at_the_last_iteration_says_nothing_was_fine_tuned(tmp_path: Path) -> None:
    """prune_at_iteration = iterations ended the job with the pruned model untrained (digits:
    accuracy 0.34 against 0.59), the row silent and every logged loss the dense model's."""
    with pytest.warns(PluginWarning, match="no iteration fine-tuned"):
        row = _late_prune_row(tmp_path, at=4, iterations=4)
    assert "fine-tuned 0 iterations after pruning" in row.summary
    assert "warning: pruned at iteration 4, the job's last" in row.summary
    assert row.metrics["fine_tuned_iterations"] == 0


def test_pruning_before_the_last_iteration_counts_the_fine_tuning(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        row = _late_prune_row(tmp_path, at=2, iterations=5)
    assert "fine-tuned 3 iterations after pruning" in row.summary
    assert "warning" not in row.summary and row.metrics["fine_tuned_iterations"] == 3


def _slide_with_pruning(tmp_path: Path, order: str, at: int = 0
                        ) -> tuple[nn.Module, accelopt.ReportRow, list[float]]:
    """A 16-32-32-512 MLP under ``+plugins=[order]`` (slide on the 512-wide head, pruning
    50% at iteration ``at``), trained 3 Adam steps; the model, gpu_kernels' row and the
    losses."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(512, (32,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 512))
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = accelopt.attach(model, [f"+plugins=[{order}]", "plugins.gpu_kernels.prune_amount=0.5",
                                     "plugins.slide.min_width=256",
                                     f"plugins.gpu_kernels.prune_at_iteration={at}"],
                             example=(x, y), optimizer="adam", lr=1e-2, iterations=3,
                             run_dir=tmp_path / order.replace(",", "+"))
        opt = torch.optim.Adam(ao.model.parameters(), lr=1e-2)
        for _ in ao.loop(range(3)):
            loss = F.cross_entropy(ao.model(x), y)
            opt.zero_grad()
            ao.backward(loss)
            ao.step(opt)
            losses.append(float(loss))
        rows = ao.close()
    (row,) = [r for r in rows if r.plugin == "gpu_kernels"]
    return ao.model, row, losses


@pytest.mark.parametrize("order", ["slide,gpu_kernels", "gpu_kernels,slide"])
@pytest.mark.parametrize("at", [0, 1])
def test_gpu_kernels_after_slide_prunes_what_it_can_in_either_order(
        tmp_path: Path, order: str, at: int) -> None:
    """After slide replaced the output layer, tracing into slide's layer raised and every
    layer was refused as "not torch.fx-traceable"; now slide's layer is one opaque call: the
    layers before the one feeding it are pruned, in either list order (gpu_kernels runs
    after slide), and that one's refusal says it stays dense (it named an order that could
    not prune it; pruning late, ``at`` 1, too)."""
    model, row, _ = _slide_with_pruning(tmp_path, order, at)
    assert "not torch.fx-traceable" not in row.summary, row.summary
    assert model[0].out_features == 16 and model[2].out_features == 32
    assert type(model[4]).__name__ == "SlideLinear"
    assert row.metrics["layers_pruned"] == 1
    assert "list gpu_kernels first" not in row.summary and "stays dense" in row.summary


def test_slide_with_gpu_kernels_is_the_same_run_in_either_order(tmp_path: Path) -> None:
    """Listed first, gpu_kernels pruned the layer feeding SLIDE's head and SLIDE trained on
    the pruned width; listed second, that layer stayed dense: two experiments under one
    name. Either order now runs slide first, with the same pruning and losses."""
    (_, first, loss_a), (_, second, loss_b) = [
        _slide_with_pruning(tmp_path, order) for order in ("slide,gpu_kernels", "gpu_kernels,slide")]
    assert first.metrics["params_after"] == second.metrics["params_after"]
    assert loss_a == loss_b
