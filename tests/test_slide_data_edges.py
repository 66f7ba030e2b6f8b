"""Edges of slide's data and losses: a label repeated within a point (every loss counts it
once, ``read_xc`` drops it), feature ids beyond float32's exact integers (refused), and a
held-out figure scored with LSH inference (its row says so)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelopt_plugins.slide.config import SlideConfig
from accelopt_plugins.slide.layer import SlideLinear, as_label_matrix
from accelopt_plugins.slide.plugin import SlidePlugin
from accelopt_plugins.slide.xcdata import MAX_FEATURES, from_files, read_xc
from accelopt_plugins.slide.xcmodel import xc_softmax_loss

from accelopt import LayerOffer, ReportRow

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_numba_thread")]

N, D = 600, 16
WITH_REPEATS = [[7, 7, 9], [7, 7, 7], [3, 5, 3], [1, -1, 1]]
WITHOUT_REPEATS = [[7, 9, -1], [7, -1, -1], [3, 5, -1], [1, -1, -1]]


def _losses(y: list[list[int]]) -> dict[str, tuple[float, torch.Tensor]]:
    """(loss, d loss / d h) of the dense XC loss and of SLIDE's two sampled losses with every
    neuron active (min_active = the width), where the sampled softmax is the full one."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(D, N)
    h = torch.randn(len(y), D)
    target = torch.tensor(y)
    out: dict[str, tuple[float, torch.Tensor]] = {}
    hd = h.clone().requires_grad_(True)
    loss = xc_softmax_loss(lin(hd), target)
    loss.backward()
    loss = loss.detach()
    out["dense"] = (loss.item(), hd.grad)
    for topup in ("sample", "batch"):
        cfg = SlideConfig(min_active=N, threads=1, sparse_input=False, topup=topup)
        layer = SlideLinear.from_linear(lin, cfg, lr=1e-12)
        layer.train()
        hs = h.clone().requires_grad_(True)
        loss = layer(hs).loss_against(target)
        loss.backward()
        out[topup] = (loss.item(), hs.grad)
    return out


@pytest.mark.parametrize("rows", [WITH_REPEATS, WITHOUT_REPEATS], ids=["repeats", "none"])
def test_dense_and_both_sampled_losses_agree_and_count_a_repeat_once(rows) -> None:
    """Labels [7, 7, 9] with every neuron active: dense 8.85 (targets 2/3, 1/3), topup=sample
    8.80 (1/2, 1/2: its kernel marks a label once), topup=batch 8.85. A point's labels are
    a set: all three count a repeat once, so they equal each other and the loss of the same
    rows without the repeats."""
    got = _losses(rows)
    deduped = [[v if v not in r[:i] else -1 for i, v in enumerate(r)] for r in rows]
    want = _losses(deduped)["dense"]
    for name, (loss, grad) in got.items():
        assert loss == pytest.approx(want[0], rel=1e-5), name
        torch.testing.assert_close(grad, want[1], rtol=1e-4, atol=1e-6, msg=name)


def test_label_matrix_drops_repeats_without_touching_the_callers_labels() -> None:
    y = torch.tensor([[4, 2, 4, 2, -1], [1, 2, 3, -1, -1]])
    before = y.clone()
    arr = as_label_matrix(y, 10)
    assert arr.tolist() == [[4, 2, -1, -1, -1], [1, 2, 3, -1, -1]]
    assert torch.equal(y, before)  # the numpy view shares the tensor's memory: copied first


def _xc(path, body: str):
    path.write_text(body)
    return path


def test_read_xc_keeps_a_repeated_label_once_and_says_how_many_points_had_one(
        tmp_path, caplog) -> None:
    """'7,7,9' was read as three labels, silently."""
    path = _xc(tmp_path / "train.txt", "3 5 10\n7,7,9 0:1\n1,2 1:1\n3,3,3 2:1\n")
    with caplog.at_level(logging.WARNING, logger="accelopt_plugins.slide.xcdata"):
        data = read_xc(path)
    assert [s.tolist() for s in data.label_sets()] == [[7, 9], [1, 2], [3]]
    (record,) = caplog.records
    assert "2 of 3 points list a label more than once" in record.getMessage()
    assert str(path) in record.getMessage()


def test_read_xc_without_repeats_says_nothing(tmp_path, caplog) -> None:
    path = _xc(tmp_path / "train.txt", "2 5 10\n7,9 0:1\n1 1:1\n")
    with caplog.at_level(logging.WARNING, logger="accelopt_plugins.slide.xcdata"):
        read_xc(path)
    assert not caplog.records


def test_a_feature_id_past_float32s_exact_integers_is_refused_naming_file_line_and_fix(
        tmp_path) -> None:
    """Feature ids travel as float32 in x: 16777217 arrived as 16777216 (another feature)."""
    last_exact = MAX_FEATURES - 1
    path = _xc(tmp_path / "big.txt",
               f"2 20000000 5\n1 {last_exact}:1.0\n2 {MAX_FEATURES + 1}:1.0 3:0.5\n")
    with pytest.raises(ValueError) as info:
        from_files(path, path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: feature id {MAX_FEATURES + 1} ") and "\n" not in msg
    assert str(MAX_FEATURES) in msg and "renumber the features" in msg
    ok = _xc(tmp_path / "ok.txt", f"1 20000000 5\n1 {last_exact}:1.0\n")
    x, _ = from_files(ok, ok).batch(0, 1)
    assert int(x[0, 0, 0]) == last_exact


class Wide400(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(16, 400)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def slide_row_after_one_batch(**settings: object) -> ReportRow:
    """The SLIDE row of a 400-output layer after one training batch, under ``settings``
    (``SlideConfig`` fields beside a small fixed layer's)."""
    net = Wide400()
    plugin = SlidePlugin(SlideConfig(min_width=350, lr=1e-2, l=4, bucket_size=16,
                                     **settings))
    plugin.accelopt_layer_build(LayerOffer(
        job=SimpleNamespace(name="j", kind="train"), path="", index=0, module=net,
        module_type="Wide400", in_features=None, out_features=None))
    assert isinstance(net.out, SlideLinear)
    net.train()
    torch.manual_seed(0)
    net(torch.randn(8, 16)).loss_against(torch.randint(0, 400, (8, 2))).backward()
    (row,) = plugin.accelopt_report_rows(None)
    return row


@pytest.mark.parametrize("inference", ["lsh", "dense"])
def test_a_training_row_says_when_held_out_was_scored_with_lsh(inference: str) -> None:
    """Under inference=lsh the core's held-out scoring (eval mode) gets LSH logits: P@1 0.757
    for weights that score 0.900 densely, in a row that read like a dense-scored run's."""
    row = slide_row_after_one_batch(inference=inference)
    assert row.summary.startswith("j:out 400 outputs trained with")
    said = "the held-out column was scored with LSH inference" in row.summary
    assert said == (inference == "lsh")
    assert row.metrics.get("heldout_lsh_inference") == (1.0 if inference == "lsh" else None)
    assert np.isfinite(row.metrics["active_fraction"])
