"""The slide plugin on models and settings it used to get silently wrong: an ``nn.Linear``
subclass with its own forward, a head registered under two names or called twice, settings
that leave only the labels active, a decaying rebuild capped below its period, and targets
or logit shapes dense cross-entropy refuses. Sizes are small and seeds fixed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from accelopt_plugins.slide.config import SlideConfig, validate
from accelopt_plugins.slide.layer import SEQUENCE_LOGITS, SampledTargetError, SlideLinear
from accelopt_plugins.slide.plugin import SlidePlugin
from torch import nn

from accelopt import LayerOffer
from accelopt.errors import ConfigError, UserError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_numba_thread")]


def _layer(n: int = 300, d: int = 16, **kw) -> SlideLinear:
    cfg = SlideConfig(**{"k": 4, "l": 8, "bucket_size": 16, "min_active": 40, **kw})
    validate(cfg)
    torch.manual_seed(0)
    return SlideLinear(d, n, cfg, lr=1e-2)


def _plugin(**kw) -> SlidePlugin:
    return SlidePlugin(SlideConfig(**{"min_width": 256, "lr": 1e-2, "l": 4, "bucket_size": 16,
                                      **kw}))


def _offer(plugin: SlidePlugin, model: nn.Module) -> nn.Module | None:
    return plugin.accelopt_layer_build(LayerOffer(
        job=SimpleNamespace(name="j", kind="train"), path="", index=0, module=model,
        module_type=type(model).__name__, in_features=None, out_features=None))


class _CosineLinear(nn.Linear):
    """A cosine classifier: normalised features and weights, scaled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 16.0 * F.linear(F.normalize(x, dim=-1), F.normalize(self.weight, dim=-1))


class _Cosine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.head = _CosineLinear(32, 300)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inp(x)))


def test_a_linear_subclass_with_its_own_forward_is_left_dense_and_the_row_says_why() -> None:
    """A cosine head (``class CosineLinear(nn.Linear)``) was swapped for a plain sampled
    linear: eval outputs differed by up to 10 before any training, the row saying it
    trained with LSH-sampled softmax."""
    torch.manual_seed(0)
    net, x = _Cosine(), torch.randn(4, 16)
    before = net(x)
    plugin = _plugin()
    _offer(plugin, net)
    assert type(net.head) is _CosineLinear
    assert torch.equal(net(x), before)
    (row,) = plugin.accelopt_report_rows(None)
    assert "j:head (300 outputs, _CosineLinear subclasses nn.Linear with its own forward" \
        in row.summary
    root = _plugin()
    assert _offer(root, _CosineLinear(16, 300)) is None  # a model that is the one layer
    assert "_CosineLinear subclasses nn.Linear" in root.accelopt_report_rows(None)[0].summary


class _AliasHead(nn.Module):
    """One head registered under two names; the forward calls the second."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.head = nn.Linear(32, 300)
        self.alias = self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alias(torch.relu(self.inp(x)))


def test_a_head_registered_under_two_names_is_replaced_under_both() -> None:
    """Only the first name was replaced: the forward's ``self.alias`` stayed dense, and the
    row said 'no batch ran through it' and 'kept tied to alias.weight'."""
    torch.manual_seed(0)
    net = _AliasHead()
    plugin = _plugin()
    _offer(plugin, net)
    assert isinstance(net.alias, SlideLinear) and net.alias is net.head
    loss = F.cross_entropy(net(torch.randn(8, 16)), torch.randint(300, (8,)))
    loss.backward()
    (row,) = plugin.accelopt_report_rows(None)
    assert row.summary.startswith("j:head 300 outputs trained with")
    assert "also registered as alias: replaced under every name" in row.summary
    assert "tied" not in row.summary and row.metrics["active_per_sample"] > 0


class _SharedTwice(nn.Module):
    """A wide square layer used as a hidden layer and then as the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 300)
        self.head = nn.Linear(300, 300)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.head(torch.relu(self.inp(x)))))


def test_a_wide_layer_called_twice_is_left_dense_naming_the_calls() -> None:
    """It was replaced and the job failed on 'relu on the wide output layer's training
    output', which did not name the cause (the layer is called twice)."""
    net = _SharedTwice()
    plugin = _plugin()
    _offer(plugin, net)
    assert type(net.head) is nn.Linear
    (row,) = plugin.accelopt_report_rows(None)
    assert "j:head (300 outputs, called 2 times in the forward" in row.summary
    assert net(torch.randn(4, 16)).shape == (4, 300)


@pytest.mark.parametrize("min_active", [0, 1])
def test_random_sampling_that_leaves_only_the_labels_is_refused(min_active: int) -> None:
    """``sampling=random min_active=0`` trained nothing (loss exactly 0) while the row said
    '64 rows updated per batch'."""
    with pytest.raises(ConfigError, match=r"min_active=\d with sampling=random leaves each "
                                          r"sample only its labels active.*set min_active"
                       ) as info:
        validate(SlideConfig(sampling="random", min_active=min_active))
    assert "\n" not in str(info.value)
    validate(SlideConfig(sampling="random", min_active=min_active, topup="batch"))


def test_label_only_active_sets_are_reported_not_counted_as_updates() -> None:
    """A threshold no neuron passes with no top-up leaves each sample only its label: the
    rows were counted as updated (their gradient is zero) and the tables' candidates as
    retrieved (before the threshold), and the row said the layer trained."""
    layer = _layer(sampling="threshold", threshold=7, min_active=0)
    h = torch.randn(16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = torch.randint(300, (16,), generator=torch.Generator().manual_seed(2))
    w0 = layer.weight.clone()
    loss = layer(h).loss_against(y)
    loss.backward()
    assert float(loss.detach()) == 0.0  # every set was the label alone
    s = layer.summary()
    assert s["label_only_fraction"] == 1.0
    assert s["union_rows_per_batch"] == int((layer.weight != w0).any(1).sum()) == 0
    assert s["retrieved_per_sample"] == 0.0
    plugin = _plugin(sampling="threshold", threshold=3, min_active=0)
    plugin.layers.append(("j", "head", layer))
    (row,) = plugin.accelopt_report_rows(None)
    assert row.summary.startswith("j:head 300 outputs NOT trained")
    assert "lower plugins.slide.threshold or raise plugins.slide.min_active" in row.summary
    assert "rows updated" not in row.summary


def test_the_union_counts_only_rows_with_a_gradient() -> None:
    """Half the batch label-only (a repeated sample whose set is its label), half with a
    top-up: the rows reported as updated are the rows the step changed."""
    layer = _layer(sampling="threshold", threshold=7, min_active=0)
    h = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = torch.randint(300, (8,), generator=torch.Generator().manual_seed(4))
    w0 = layer.weight.clone()
    layer(h).loss_against(y).backward()
    changed = int((layer.weight != w0).any(1).sum())
    assert layer.summary()["union_rows_per_batch"] == changed
    topped = _layer(sampling="threshold", threshold=7, min_active=5)
    w0 = topped.weight.clone()
    topped(h).loss_against(y).backward()
    changed = int((topped.weight != w0).any(1).sum())
    assert changed > 0 and topped.summary()["union_rows_per_batch"] == changed
    assert topped.summary()["label_only_fraction"] == 0.0


def test_a_decaying_rebuild_capped_below_its_period_is_refused() -> None:
    """period=10 max_period=3 rebuilt every 3 steps, more often than ``fixed``."""
    with pytest.raises(ConfigError, match=r"rebuild_max_period=3 is below plugins\.slide\."
                                          r"rebuild_period=10") as info:
        validate(SlideConfig(rebuild="decay", rebuild_period=10, rebuild_max_period=3))
    assert "\n" not in str(info.value)
    validate(SlideConfig(rebuild="fixed", rebuild_period=10, rebuild_max_period=3))
    validate(SlideConfig(rebuild="decay", rebuild_period=10, rebuild_max_period=10))


@pytest.mark.parametrize("bad", [-1, 300])
def test_cross_entropy_refuses_targets_out_of_range_as_dense_does(bad: int) -> None:
    """Target -1 was read as padding (a row counted in the mean at loss 0) where dense
    cross-entropy raises 'Target -1 is out of bounds'."""
    y = torch.tensor([bad, 1, 2, 3])
    with pytest.raises(IndexError):
        F.cross_entropy(torch.randn(4, 300), y)
    layer = _layer()
    for call in (lambda out: F.cross_entropy(out, y), lambda out: out.loss_against(y)):
        with pytest.raises(SampledTargetError, match=rf"label ids must be in \[0, 300\).*got "
                                                     rf"{bad}") as info:
            call(layer(torch.randn(4, 16)))
        assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def test_cross_entropy_honours_ignore_index_as_dense_does() -> None:
    """Rows whose target is ``ignore_index`` (-100 by default, or given) are dropped, and
    the loss is that of the other rows."""
    h = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([7, 1, 2, 3])
    expected = float(_layer()(h[1:]).loss_against(y[1:]).detach())
    for target, kw in ((torch.tensor([-100, 1, 2, 3]), {}),
                       (torch.tensor([-1, 1, 2, 3]), {"ignore_index": -1}),
                       (torch.tensor([5, 1, 2, 3]), {"ignore_index": 5})):
        assert float(F.cross_entropy(_layer()(h), target, **kw).detach()) == expected
    assert float(_layer()(h).loss_against(torch.tensor([-100, 1, 2, 3])).detach()) == expected
    label_sets = torch.tensor([[4, -1], [1, 2]])  # the multi-label form keeps -1 padding
    assert torch.isfinite(_layer()(h[:2]).loss_against(label_sets))


def test_per_token_logits_are_refused_as_the_dense_job_refuses_them() -> None:
    """[B, T, V] logits against [B, T] labels: the dense job's default loss refuses them
    (torch reads dimension 1 as the classes), but slide's output trained on them, so a
    comparison's dense baseline failed where slide succeeded. Both refuse now, with the
    dense job's reason; the flattened logits still train."""
    from accelopt.job.job import job_loss

    h, y = torch.randn(2, 3, 16), torch.randint(300, (2, 3))
    with pytest.raises(UserError, match="a sequence model's per-token logits") as dense:
        job_loss(SimpleNamespace())(torch.randn(2, 3, 300), y)
    assert SEQUENCE_LOGITS in str(dense.value)
    with pytest.raises(SampledTargetError) as info:
        job_loss(SimpleNamespace())(_layer()(h), y)
    assert SEQUENCE_LOGITS in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SampledTargetError, match=r"flatten both first: F\.cross_entropy\("
                                                 r"out\.view\(-1, 300\), y\.view\(-1\)\)"):
        F.cross_entropy(_layer()(h), y)
    flat = F.cross_entropy(_layer()(h).view(-1, 300), y.view(-1))
    rows = _layer()(h.reshape(6, 16)).loss_against(y.reshape(6))
    assert float(flat.detach()) == float(rows.detach())
