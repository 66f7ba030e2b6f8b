"""gradcomm codec and plugin, in one process: error feedback loses no gradient mass, top-k and
threshold select what they say, fp16 halves the bytes, decoding sums ranks in order,
non-finite gradients are refused with the layer's name, bad options are one-line errors."""

from __future__ import annotations

import math
import re

import pytest
import torch
from accelopt_plugins.gradcomm import PLUGIN
from accelopt_plugins.gradcomm.codec import BucketCodec, CastOverflow, within
from accelopt_plugins.gradcomm.config import GradcommConfig
from accelopt_plugins.gradcomm.plugin import GradcommPlugin, NonFiniteGradient
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from accelopt import TransferRecord
from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def sent_dense(codec: BucketCodec, name: str, payload) -> torch.Tensor:
    """What this rank contributed, as a dense float32 vector (a one-rank 'all-reduce')."""
    if isinstance(payload, torch.Tensor):
        return payload.float()
    return codec.decode(name, [payload])


def run_steps(codec: BucketCodec, n: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)  # varied magnitudes
        true_sum += g.double()
        sent_sum += sent_dense(codec, "bucket0", codec.encode("bucket0", g)).double()
    return true_sum, sent_sum


@pytest.mark.parametrize("kwargs", [
    {"sparsify": "topk", "density": 0.01},
    {"sparsify": "topk", "density": 0.1, "dtype": "fp16"},
    {"sparsify": "threshold", "threshold": 0.5, "dtype": "bf16"},
    {"sparsify": "none", "dtype": "fp16"},
    {"sparsify": "none", "dtype": "bf16"},
])
def test_residual_plus_sent_equals_the_true_sum(kwargs):
    codec = BucketCodec(**kwargs)
    true_sum, sent_sum = run_steps(codec, n=2000, steps=30, seed=0)
    residual = codec.residual["bucket0"].double()
    torch.testing.assert_close(sent_sum + residual, true_sum, atol=1e-5, rtol=1e-6)
    assert codec.stats.sent_elements <= codec.stats.elements


def test_without_error_feedback_mass_is_lost():
    """The identity above is not automatic: without the residual, top-k drops mass."""
    codec = BucketCodec(sparsify="topk", density=0.01, error_feedback=False)
    true_sum, sent_sum = run_steps(codec, n=2000, steps=30, seed=0)
    assert (true_sum - sent_sum).abs().sum() > 100 * 1e-5
    assert "bucket0" not in codec.residual


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 400), density=st.floats(0.001, 1.0), steps=st.integers(1, 6),
       seed=st.integers(0, 2**16), dtype=st.sampled_from(["fp32", "fp16", "bf16"]))
def test_error_feedback_identity_property(n, density, steps, seed, dtype):
    codec = BucketCodec(sparsify="topk", density=density, dtype=dtype)
    true_sum, sent_sum = run_steps(codec, n=n, steps=steps, seed=seed)
    torch.testing.assert_close(sent_sum + codec.residual["bucket0"].double(), true_sum,
                               atol=1e-5, rtol=1e-6)
    assert codec.stats.sent_elements == steps * max(1, math.ceil(density * n))


def test_topk_sends_the_largest_magnitudes_and_threshold_what_exceeds_it():
    g = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.05, 0.0, 4.0, -0.2])
    idx, values = BucketCodec(sparsify="topk", density=0.3).encode("b", g)  # ceil(2.4) = 3
    assert idx.tolist() == [1, 3, 6] and values.tolist() == [-5.0, 2.0, 4.0]
    assert idx.dtype == torch.int32
    idx, values = BucketCodec(sparsify="threshold", threshold=0.25).encode("b", g)
    assert idx.tolist() == [1, 2, 3, 6]


def test_fp16_exactly_halves_the_bytes_and_fp32_dense_is_untouched():
    g = torch.randn(1000)
    half = BucketCodec(dtype="fp16", error_feedback=False)
    wire = half.encode("b", g)
    assert wire.dtype == torch.float16
    assert half.stats.wire_bytes * 2 == half.stats.dense_bytes == 4000
    assert BucketCodec().encode("b", g) is None  # plain fp32: nothing to do


def test_sparse_decode_adds_every_rank_in_rank_order():
    codec = BucketCodec(sparsify="topk", density=0.5)
    codec.numel["b"] = 4
    ranks = [(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1.0, 2.0])),
             (torch.tensor([2, 3], dtype=torch.int32), torch.tensor([0.5, -1.0], dtype=torch.float16))]
    assert codec.decode("b", ranks).tolist() == [1.0, 0.0, 2.5, -1.0]
    assert codec.decode("b", torch.ones(3, dtype=torch.bfloat16)).dtype == torch.float32


def record(bucket: str = "bucket0", iteration: int = 3) -> TransferRecord:
    return TransferRecord(job_id="j", iteration=iteration, source=1, destination=-1,
                          tensor=bucket, nbytes=40, layer_index=0, kind="grad")


def plugin_with_layout(**options) -> GradcommPlugin:
    plugin = GradcommPlugin(GradcommConfig())
    run_config = OmegaConf.create({"cluster": {"mode": "allreduce", "bucket_mb": 25}})
    plugin.accelopt_configure(config=GradcommConfig(**options), run_config=run_config)
    # bucket0 = head (last layer first, as backward produces it), then the hidden layer
    plugin.layout = {"bucket0": [("net.4.weight", "net.4", 0, 6), ("net.4.bias", "net.4", 6, 8),
                                 ("net.2.weight", "net.2", 8, 10)]}
    return plugin


def test_a_non_finite_gradient_is_refused_with_the_layer_name():
    plugin = plugin_with_layout(sparsify="topk", density=0.5)
    g = torch.zeros(10)
    g[9] = float("nan")
    with pytest.raises(NonFiniteGradient) as info:
        plugin.accelopt_transfer_encode(record=record(), payload=g)
    message = str(info.value)
    assert "layer 'net.2'" in message and "net.2.weight: 1 NaN, 0 Inf" in message
    assert "iteration 3" in message and "not sent" in message and "\n" not in message
    assert "bucket0" not in plugin.codec.residual  # nothing of it entered the state


def test_fp16_overflow_is_refused_and_bf16_suggested():
    plugin = plugin_with_layout(dtype="fp16")
    g = torch.zeros(10)
    g[7] = 1e6  # finite in fp32, Inf in fp16
    with pytest.raises(NonFiniteGradient) as info:
        plugin.accelopt_transfer_encode(record=record(), payload=g)
    assert "net.4.bias" in str(info.value) and "bf16" in str(info.value)
    ok = plugin_with_layout(dtype="bf16").accelopt_transfer_encode(record=record(), payload=g)
    assert ok.dtype == torch.bfloat16 and torch.isfinite(ok).all()


@pytest.mark.parametrize("error_feedback, passes", [(False, [1, 1]), (True, [1, 2])])
def test_the_finite_check_and_the_cast_check_share_one_pass(monkeypatch, error_feedback,
                                                             passes):
    """A bucket sent as it is is measured once for both checks; once error feedback has
    added a residual, the cast sees other values and measures them itself."""
    plugin = plugin_with_layout(dtype="fp16", error_feedback=error_feedback)
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    counted = []
    for iteration in range(2):
        before = len(calls)
        plugin.accelopt_transfer_encode(record=record(iteration=iteration),
                                        payload=torch.linspace(-1, 1, 10))
        counted.append(len(calls) - before)
    assert counted == passes


def test_params_and_point_to_point_transfers_are_left_alone():
    plugin = plugin_with_layout(dtype="fp16")
    param = TransferRecord("j", 0, 0, 1, "w", 40, 0, "param")
    grad_to_server = TransferRecord("j", 0, 1, 0, "w", 40, 0, "grad")
    for rec in (param, grad_to_server):
        assert plugin.accelopt_transfer_encode(record=rec, payload=torch.ones(10)) is None


def test_overlap_off_holds_buckets_until_backward_ends():
    records = [record(f"bucket{b}", 0) for b in range(3)]
    assert plugin_with_layout().accelopt_transfer_order(transfers=records, destination=-1) is None
    order = plugin_with_layout(overlap=False).accelopt_transfer_order(transfers=records,
                                                                      destination=-1)
    assert order == ["bucket2", "bucket1", "bucket0"]  # bucket2 (first layers) comes last


def test_outside_allreduce_it_says_it_had_nothing_to_do(run_tiny):
    record_ = run_tiny(PLUGIN, overrides=["plugins.gradcomm.dtype=fp16"])
    rows = [r for r in record_.plugin_rows if r.plugin == "gradcomm"]
    assert len(rows) == 1 and "nothing to do" in rows[0].summary
    assert "cluster.mode=none" in rows[0].summary


@pytest.mark.parametrize("override, key", [
    ("plugins.gradcomm.density=0", "plugins.gradcomm.density"),
    ("plugins.gradcomm.density=1.5", "plugins.gradcomm.density"),
    ("plugins.gradcomm.density=-0.1", "plugins.gradcomm.density"),
    ("plugins.gradcomm.dtype=fp8", "plugins.gradcomm.dtype"),
    ("plugins.gradcomm.sparsify=random", "plugins.gradcomm.sparsify"),
])
def test_bad_options_are_one_line_errors(run_tiny, override, key):
    with pytest.raises(ConfigError) as info:
        run_tiny(PLUGIN, overrides=[override])
    assert key in str(info.value) and "\n" not in str(info.value)


def test_threshold_mode_needs_a_positive_threshold():
    plugin = GradcommPlugin(GradcommConfig())
    with pytest.raises(ConfigError, match="plugins.gradcomm.threshold must be > 0"):
        plugin.accelopt_configure(config=GradcommConfig(sparsify="threshold"), run_config=None)


@pytest.mark.parametrize(("settings", "message"), [
    ({"density": 0.1}, "plugins.gradcomm.density=0.1 has no effect with sparsify=none (it is "
                       "topk's setting); set plugins.gradcomm.sparsify=topk, or drop it"),
    ({"sparsify": "threshold", "threshold": 0.5, "topk_scope": "bucket"},
     "plugins.gradcomm.topk_scope=bucket has no effect with sparsify=threshold"),
    ({"sparsify": "topk", "threshold": 0.5}, "plugins.gradcomm.threshold=0.5 has no effect "
                                             "with sparsify=topk"),
    ({"factor_masking": False}, "plugins.gradcomm.factor_masking=False has no effect with "
                                "sparsify=none (it is momentum correction's setting"),
])
def test_a_setting_of_another_method_is_refused_not_ignored(settings, message):
    """``density=0.1`` without ``sparsify=topk`` ran dense, exit 0, the setting ignored."""
    plugin = GradcommPlugin(GradcommConfig())
    with pytest.raises(ConfigError, match=re.escape(message)):
        plugin.accelopt_configure(config=GradcommConfig(**settings), run_config=None)


@pytest.mark.parametrize("override, key", [
    ("plugins.gradcomm.density=0.01", "density=0.01"),
    ("plugins.gradcomm.topk_scope=model", "topk_scope=model"),
    ("plugins.gradcomm.threshold=0.0", "threshold=0.0"),
    ("plugins.gradcomm.factor_masking=true", "factor_masking=True"),
])
def test_a_setting_equal_to_its_default_is_refused_without_its_method(run_tiny, override, key):
    """Compared with the defaults, ``density=0.01`` without ``sparsify=topk`` was accepted
    (and ignored) where ``density=0.1`` was refused: the composed config holds every key, so
    only a ``null`` default shows that a value was given."""
    with pytest.raises(ConfigError) as info:
        run_tiny(PLUGIN, overrides=[override])
    assert f"plugins.gradcomm.{key} has no effect with sparsify=none" in str(info.value)
    assert "\n" not in str(info.value)


def test_method_settings_left_null_read_as_their_defaults():
    """``null`` stands for the method's default; nothing given is nothing refused."""
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GradcommConfig),
                                                 {"dtype": "fp16"}))
    assert (config.density, config.threshold, config.factor_masking, config.topk_scope) == (
        0.01, 0.0, True, "model")
    assert config.explicit == frozenset()
    GradcommPlugin(GradcommConfig()).accelopt_configure(config=config, run_config=None)
    given = GradcommConfig(sparsify="topk", density=0.01, topk_scope="model")
    assert given.explicit == {"density", "topk_scope"} and given == GradcommConfig(sparsify="topk")


def test_encode_decode_hooks_round_trip_a_bucket():
    """accelopt_transfer_encode on the sender, accelopt_transfer_decode on every rank."""
    g = torch.randn(10)
    dense = plugin_with_layout(dtype="bf16")
    wire = dense.accelopt_transfer_encode(record=record(), payload=g)
    back = dense.accelopt_transfer_decode(record=record(), payload=wire)
    assert back.dtype == torch.float32 and torch.allclose(back, g, rtol=1e-2)
    sparse = plugin_with_layout(sparsify="topk", density=0.3)
    idx, values = sparse.accelopt_transfer_encode(record=record(), payload=g)
    summed = sparse.accelopt_transfer_decode(record=record(), payload=[(idx, values)] * 2)
    assert torch.equal(summed[idx.long()], 2 * g[idx.long()])
    assert int((summed != 0).sum()) == 3


# -- DGC momentum correction and factor masking ------------------------------------------


def run_corrected(codec: BucketCodec, n: int, steps: int, seed: int, m: float):
    """Feed random gradients; return (sum of the reference velocities, sum of what was sent).
    The reference ``u <- m*u + g`` is computed here, independently of the codec, and masked
    only from what the wire shows (the sent indices) when the codec masks."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.zeros(n, dtype=torch.float64)
    velocity_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen)
        u = m * u + g.double()
        velocity_sum += u
        idx, values = codec.encode("bucket0", g)
        sent_sum.index_add_(0, idx.long(), values.double())
        if codec.corrected and codec.factor_masking:
            u[idx.long()] = 0.0
            assert not codec.velocity["bucket0"][idx.long()].any()
    return velocity_sum, sent_sum


@pytest.mark.parametrize("kwargs", [
    {"sparsify": "topk", "density": 0.01},
    {"sparsify": "topk", "density": 0.05, "dtype": "fp16"},
    {"sparsify": "topk", "density": 0.01, "factor_masking": False},
    {"sparsify": "threshold", "threshold": 1.0, "dtype": "bf16"},
])
def test_corrected_residual_plus_sent_equals_the_velocity_sum(kwargs):
    """The corrected form of the mass identity: nothing of the accumulated velocity is lost.
    Without masking the reference velocities are dense momentum SGD's own (what it applies,
    in units of the learning rate)."""
    codec = BucketCodec(momentum=0.9, **kwargs)
    assert codec.corrected
    velocity_sum, sent_sum = run_corrected(codec, n=2000, steps=30, seed=1, m=0.9)
    residual = codec.residual["bucket0"].double()
    torch.testing.assert_close(sent_sum + residual, velocity_sum, atol=2e-4, rtol=1e-6)
    # and the correction really changed what is sent: the plain codec sends other values
    _, plain_sent = run_corrected(BucketCodec(**kwargs), n=2000, steps=30, seed=1, m=0.0)
    assert not torch.allclose(plain_sent, sent_sum)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), density=st.floats(0.001, 1.0), steps=st.integers(1, 8),
       seed=st.integers(0, 2**16), m=st.floats(0.1, 0.99), masking=st.booleans(),
       dtype=st.sampled_from(["fp32", "fp16", "bf16"]))
def test_corrected_identity_property(n, density, steps, seed, m, masking, dtype):
    codec = BucketCodec(sparsify="topk", density=density, dtype=dtype, momentum=m,
                        factor_masking=masking)
    velocity_sum, sent_sum = run_corrected(codec, n=n, steps=steps, seed=seed, m=m)
    torch.testing.assert_close(sent_sum + codec.residual["bucket0"].double(), velocity_sum,
                               atol=1e-4, rtol=1e-5)


def sgd_momentum(lr: float = 0.1, m: float = 0.9, n: int = 64):
    """The job's own optimizer, as the core builds it, on one flat parameter."""
    from accelopt.config import JobConfig
    from accelopt.job.optim import make_optimizer

    model = torch.nn.Linear(n, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model.weight, make_optimizer(JobConfig(name="t", lr=lr, momentum=m),
                                        model.parameters())


@pytest.mark.parametrize("masking", [True, False])
def test_the_decoder_cancels_the_optimizers_momentum(masking):
    """Two ranks' codecs; every rank decodes the same gathered payloads to the same tensor,
    and the job's SGD-with-momentum then moves the weights by exactly lr * (sum of the sent
    values): DGC's update, with no momentum applied on top."""
    n, lr = 64, 0.1
    w, opt = sgd_momentum(lr=lr, n=n)
    ranks = [BucketCodec(sparsify="topk", density=0.1, momentum=0.9, factor_masking=masking)
             for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    applied = torch.zeros(n, dtype=torch.float64)
    for _ in range(25):
        payloads = [c.encode("b", torch.randn(n, generator=gen)) for c in ranks]
        for idx, values in payloads:
            applied.index_add_(0, idx.long(), values.double())
        decoded = [c.decode("b", payloads) for c in ranks]
        assert torch.equal(decoded[0], decoded[1])  # replicas stay identical
        w.grad = decoded[0].view_as(w).clone()
        opt.step()
    torch.testing.assert_close(w.detach().double().reshape(-1), -lr * applied,
                               atol=1e-5, rtol=1e-5)


def test_density_one_without_masking_is_dense_momentum_sgd():
    n = 64
    w, opt = sgd_momentum(n=n)
    w_dense, opt_dense = sgd_momentum(n=n)
    ranks = [BucketCodec(sparsify="topk", density=1.0, momentum=0.9, factor_masking=False)
             for _ in range(2)]
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        grads = [torch.randn(n, generator=gen) for _ in ranks]
        payloads = [c.encode("b", g) for c, g in zip(ranks, grads, strict=True)]
        w.grad = ranks[0].decode("b", payloads).view_as(w).clone()
        w_dense.grad = (grads[0] + grads[1]).view_as(w)
        opt.step()
        opt_dense.step()
    torch.testing.assert_close(w, w_dense, atol=1e-5, rtol=1e-5)


def configured(options: dict, optimizer: str | None = "sgd", momentum: float = 0.9):
    run_config = {"cluster": {"mode": "allreduce", "bucket_mb": 25}}
    if optimizer is not None:
        run_config["workload"] = {"jobs": [{"name": "j", "optimizer": optimizer,
                                            "momentum": momentum}]}
    plugin = GradcommPlugin(GradcommConfig())
    plugin.accelopt_configure(config=GradcommConfig(**options),
                              run_config=OmegaConf.create(run_config))
    return plugin


def test_momentum_correction_is_on_by_default_only_where_it_applies():
    topk = {"sparsify": "topk", "density": 0.1}
    assert configured(topk).codec.momentum == 0.9 and configured(topk).codec.corrected
    assert configured({"sparsify": "threshold", "threshold": 0.1}).codec.corrected
    assert not configured(topk, optimizer="adam").codec.corrected
    assert not configured(topk, momentum=0.0).codec.corrected
    assert not configured(topk, optimizer=None).codec.corrected
    assert not configured({**topk, "error_feedback": False}).codec.corrected
    assert not configured({"dtype": "fp16"}).codec.corrected
    assert not configured({**topk, "momentum_correction": False}).codec.corrected


@pytest.mark.parametrize("options, optimizer, momentum, reason", [
    ({"sparsify": "topk"}, "adam", 0.9, "optimizer is adam"),
    ({"sparsify": "topk"}, "sgd", 0.0, "momentum 0"),
    ({"dtype": "fp16"}, "sgd", 0.9, "sparsify=topk"),
    ({"sparsify": "topk", "error_feedback": False}, "sgd", 0.9, "error_feedback=true"),
])
def test_momentum_correction_true_where_it_cannot_apply_is_one_line(options, optimizer,
                                                                    momentum, reason):
    with pytest.raises(ConfigError) as info:
        configured({**options, "momentum_correction": True}, optimizer, momentum)
    message = str(info.value)
    assert "plugins.gradcomm.momentum_correction" in message and reason in message
    assert "\n" not in message


def test_momentum_correction_override_reaches_the_plugin(run_tiny):
    """``plugins.gradcomm.momentum_correction=true`` parses (an optional bool) and is checked
    against the workload's optimizer (tiny: SGD momentum 0.9 by default, Adam refused)."""
    record_ = run_tiny(PLUGIN, overrides=["plugins.gradcomm.sparsify=topk",
                                          "plugins.gradcomm.momentum_correction=true"])
    assert any(r.plugin == "gradcomm" for r in record_.plugin_rows)
    with pytest.raises(ConfigError, match="optimizer is adam"):
        run_tiny(PLUGIN, overrides=["plugins.gradcomm.sparsify=topk",
                                    "plugins.gradcomm.momentum_correction=true",
                                    "workload.jobs.0.optimizer=adam"])


# -- top-k budget shared over the model --------------------------------------------------


def test_model_scope_moves_the_budget_to_where_the_largest_values_are():
    """Bucket 'head' is small with large gradients, 'body' large with small ones. Per bucket,
    the head gets 1% of its own entries; with scope=model it gets the share of the model's
    top-1% it holds (from the second step on), and the total stays the model's budget."""
    gen = torch.Generator().manual_seed(5)
    sizes = {"head": 500, "body": 9500}
    k_model = math.ceil(0.01 * sum(sizes.values()))
    per_bucket, per_model = (BucketCodec(sparsify="topk", density=0.01, scope=s)
                             for s in ("bucket", "model"))
    sent = {"bucket": [], "model": []}
    for it in range(6):
        grads = {"head": 10 * torch.randn(500, generator=gen),
                 "body": torch.randn(9500, generator=gen)}
        for scope, codec in (("bucket", per_bucket), ("model", per_model)):
            counts = {b: codec.encode(b, g, iteration=it)[0].numel() for b, g in grads.items()}
            sent[scope].append(counts)
    assert all(c == {"head": 5, "body": 95} for c in sent["bucket"])
    assert sent["model"][0] == {"head": 5, "body": 95}  # first step: nothing known yet
    for counts in sent["model"][1:]:
        assert counts["head"] > 40  # most of the model's largest values are in the head
        assert k_model <= sum(counts.values()) <= k_model + len(sizes)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_model_scope_keeps_the_mass_identity(momentum):
    codec = BucketCodec(sparsify="topk", density=0.02, scope="model", momentum=momentum,
                        dtype="fp16")
    gen = torch.Generator().manual_seed(6)
    n = {"b0": 300, "b1": 1700}
    u = {b: torch.zeros(k, dtype=torch.float64) for b, k in n.items()}
    reference = {b: torch.zeros(k, dtype=torch.float64) for b, k in n.items()}
    sent = {b: torch.zeros(k, dtype=torch.float64) for b, k in n.items()}
    for it in range(12):
        for b, k in n.items():
            g = torch.randn(k, generator=gen) * (5.0 if b == "b0" else 1.0)
            u[b] = momentum * u[b] + g.double()
            reference[b] += u[b]
            idx, values = codec.encode(b, g, iteration=it)
            sent[b].index_add_(0, idx.long(), values.double())
            if codec.corrected:
                u[b][idx.long()] = 0.0
    for b in n:
        torch.testing.assert_close(sent[b] + codec.residual[b].double(), reference[b],
                                   atol=2e-4, rtol=1e-6)


def test_unknown_topk_scope_is_a_one_line_error():
    with pytest.raises(ConfigError, match="plugins.gradcomm.topk_scope: unknown scope 'layer'"):
        GradcommPlugin(GradcommConfig()).accelopt_configure(
            config=GradcommConfig(sparsify="topk", topk_scope="layer"), run_config=None)


def test_fp16_range_edge_values_pass_and_the_first_overflowing_one_is_named():
    """The range check settles in-range buckets with one pass: 65504 is fp16's largest finite
    value and 65519 rounds down to it, 65520 rounds up to Inf; only that one is refused."""
    codec = BucketCodec(dtype="fp16", error_feedback=False)
    edge = torch.tensor([0.0, 65504.0, -65519.0, 1.0])
    assert torch.equal(codec.encode("bucket0", edge).float(),
                       torch.tensor([0.0, 65504.0, -65504.0, 1.0]))
    with pytest.raises(CastOverflow) as info:
        codec.encode("bucket0", torch.tensor([1.0, -65520.0, 3.0]))
    assert info.value.index.tolist() == [1]


def test_a_gradient_already_nan_is_not_called_a_cast_overflow():
    """With the finite check off the codec still names only values the cast made infinite."""
    codec = BucketCodec(dtype="fp16", error_feedback=False)
    wire = codec.encode("bucket0", torch.tensor([float("nan"), 2.0]))
    assert torch.isnan(wire[0]) and wire[1] == 2.0


@pytest.mark.parametrize("value, limit, expected", [
    (1.0, math.inf, True), (float("inf"), math.inf, False), (float("-inf"), math.inf, False),
    (float("nan"), math.inf, False), (65504.0, 65504.0, True), (65505.0, 65504.0, False),
])
def test_within_checks_finiteness_and_range_in_one_pass(value, limit, expected):
    values = torch.zeros(1000)
    values[617] = value
    assert within(values, limit) is expected
    assert within(torch.zeros(0), limit)


def test_the_row_says_more_bytes_when_the_encoding_costs_more_than_it_saves():
    """A threshold sending most elements (each with its index) sent 1.9x the dense bytes and
    the row read '0.5x fewer bytes than fp32'."""
    from accelopt_plugins.gradcomm.plugin import _bytes_vs_dense

    assert _bytes_vs_dense(4.0) == "4.0x fewer bytes than fp32"
    assert _bytes_vs_dense(26128 / 50293).startswith("1.9x more bytes than fp32")
    assert _bytes_vs_dense(1.0, "bf16") == "as many bytes as bf16: no saving"


@pytest.mark.parametrize("dtype, options, dense, wire", [
    (torch.bfloat16, {"dtype": "fp16"}, 2, 2),  # read '2.0x fewer bytes than fp32'
    (torch.float64, {"dtype": "fp16"}, 8, 2),  # the dense baseline read 4 bytes
    (torch.bfloat16, {"sparsify": "topk", "density": 0.1}, 2, 4 + 2),  # fp32 values: 4 + 4
    (torch.float64, {"sparsify": "topk", "density": 0.1}, 8, 4 + 4),
])
def test_bytes_count_against_the_gradients_own_dtype(dtype, options, dense, wire):
    """DDP sends a gradient in its own dtype: that is the dense baseline, and a sparse
    codec's values are not widened past it (the default fp32 sent a bf16 model's top-k
    values in 4 bytes). Error feedback still keeps the rounding."""
    codec = BucketCodec(**options)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    payload = codec.encode("b", g)
    sent = 1000 if isinstance(payload, torch.Tensor) else 100
    assert codec.stats.dense_bytes == 1000 * dense
    assert codec.stats.wire_bytes == sent * wire
    if not isinstance(payload, torch.Tensor):
        assert payload[1].dtype == (torch.bfloat16 if dtype == torch.bfloat16
                                    else torch.float32)
        rest = codec.residual["b"].double()
        rest[payload[0].long()] += payload[1].double()
        torch.testing.assert_close(rest, g.double(), atol=1e-6, rtol=0)


def test_the_row_names_the_gradients_dtype_as_the_dense_baseline():
    """An all-bf16 model's fp16 buckets read '2.0x fewer bytes than fp32': DDP sends it in
    2 bytes per element too, no saving."""
    from accelopt.types import ClusterInfo, JobInfo, RunInfo

    plugin = GradcommPlugin(GradcommConfig(dtype="fp16"))
    job = JobInfo(job_id="ddp", name="ddp", model="Linear", kind="train", arrival_s=0.0,
                  iterations=0, batch_size=0)
    run = RunInfo(run_dir=".", device="cpu", plugins=("gradcomm",), jobs=(job,), seed=0,
                  cluster=ClusterInfo(mode="allreduce", workers=2, bucket_bytes=2**20),
                  job=job)
    plugin.accelopt_run_start(run=run)
    plugin.accelopt_transfer_encode(record=record(iteration=0),
                                    payload=torch.randn(100).to(torch.bfloat16))
    (row,) = plugin.accelopt_report_rows(run=run)
    assert "(as many bytes as bf16: no saving)" in row.summary, row.summary
    assert row.metrics["compression_ratio"] == 1.0


@pytest.mark.parametrize("options, codec", [
    ({"dtype": "fp16"}, "dense, fp16 values, with error feedback"),
    ({"sparsify": "topk", "density": 0.1},
     "top-k density 0.1 (k over the model), fp32 values, with error feedback"),
])
def test_a_report_before_the_first_bucket_describes_the_configured_codec(options, codec):
    """``state.report()`` taken before any bucket was sent said 'fp32 dense all-reduce (no
    compression)' for an fp16 hook, and the bucket size of ``bucket_mb=0.01`` read
    0.00999928 MiB (its bytes, ``int(0.01 * 2**20)``, converted back)."""
    from accelopt.types import ClusterInfo, JobInfo, RunInfo

    plugin = GradcommPlugin(GradcommConfig(**options))  # as gradcomm's comm_hook makes it
    job = JobInfo(job_id="ddp", name="ddp", model="Linear", kind="train", arrival_s=0.0,
                  iterations=0, batch_size=0)
    run = RunInfo(run_dir=".", device="cpu", plugins=("gradcomm",), jobs=(job,), seed=0,
                  cluster=ClusterInfo(mode="allreduce", workers=2,
                                      bucket_bytes=int(0.01 * 2**20)), job=job)
    plugin.accelopt_run_start(run=run)
    (row,) = plugin.accelopt_report_rows(run=run)
    assert row.summary.startswith(f"{codec}: nothing sent yet"), row.summary
    assert "fp32 dense" not in row.summary and "closed at 0.01 MiB," in row.summary


@pytest.mark.parametrize("mb, shown", [(0.01, "0.01"), (0.001, "0.001"), (25, "25"),
                                       (1.5, "1.5"), (1000, "1000"), (2**-20, "0.000001")])
def test_a_bucket_size_is_shown_as_it_was_set(mb, shown):
    from accelopt_plugins.gradcomm.plugin import _mib

    assert _mib(max(1, int(mb * 2**20)) / 2**20) == shown


@pytest.mark.parametrize("options", [{}, {"dtype": "fp16"}, {"sparsify": "topk", "density": 0.5}],
                         ids=["lossless", "fp16", "topk"])
def test_a_float64_bucket_is_decoded_in_float64(options):
    """A float64 model's buckets: the lossless codec left its gradients as they were on the
    wire but decoded them to float32 (every step 1e-9 off one process); a compressed one
    gives them back in float64 too."""
    codec = BucketCodec(**options)
    flat = torch.randn(64, dtype=torch.float64)
    payload = codec.encode("bucket0", flat)
    if payload is None:  # lossless: the bucket goes as it is
        assert codec.decode("bucket0", flat) is None
        return
    out = codec.decode("bucket0", payload if isinstance(payload, torch.Tensor) else [payload])
    assert out.dtype == torch.float64
    sent = out != 0  # top-k: the half it sent, each as its float32 value
    assert int(sent.sum()) == (32 if options.get("sparsify") else 64)
    assert torch.allclose(out[sent], flat[sent], atol=1e-2)


def test_the_lossless_row_names_the_gradients_dtype():
    from accelopt_plugins.gradcomm.plugin import _dtype_names

    assert _dtype_names([]) == "fp32"
    assert _dtype_names([torch.float64]) == "fp64"
    assert _dtype_names([torch.float32, torch.float64, torch.float32]) == "fp32 and fp64"


@pytest.mark.parametrize("options", [
    {"sparsify": "topk", "density": 0.3},
    {"sparsify": "threshold", "threshold": 0.5, "dtype": "fp16"},
    {"sparsify": "none", "dtype": "bf16"},
    {"sparsify": "topk", "density": 0.3, "momentum": 0.9, "factor_masking": False},
], ids=["topk", "threshold-fp16", "bf16", "topk-dgc"])
def test_error_feedback_keeps_a_float64_buckets_rounding(options):
    """A float64 model's gradients were accumulated in float32 (``flat.float()``) before error
    feedback saw them: the float64 -> float32 rounding of every value was lost each step
    (1e-9 on the weights after 4 steps of top-k at density 1 against plain DDP), against
    the documented ``sum(sent) + residual == sum(gradients)``. The residual (and DGC's
    velocity) now keep the bucket's own precision."""
    codec = BucketCodec(**options)
    gen = torch.Generator().manual_seed(3)
    true_sum = torch.zeros(500, dtype=torch.float64)
    sent_sum = torch.zeros(500, dtype=torch.float64)
    velocity = torch.zeros(500, dtype=torch.float64)
    for _ in range(5):
        g = torch.randn(500, generator=gen, dtype=torch.float64) / 3  # not float32 values
        velocity = velocity * options.get("momentum", 0.0) + g
        true_sum += velocity if "momentum" in options else g
        payload = codec.encode("bucket0", g)
        if isinstance(payload, torch.Tensor):
            sent_sum += payload.double()
        else:  # what went on the wire, before the decoder cancels the optimizer's momentum
            sent_sum.index_add_(0, payload[0].long(), payload[1].double())
    assert codec.residual["bucket0"].dtype == torch.float64
    torch.testing.assert_close(sent_sum + codec.residual["bucket0"], true_sum,
                               atol=1e-12, rtol=0)
