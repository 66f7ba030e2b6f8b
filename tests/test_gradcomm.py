"""gradcomm codec and plugin, in one process: error feedback loses no gradient mass, top-k and
threshold select what they say, fp16 halves the bytes, decoding sums ranks in order,
non-finite gradients are refused with the layer's name, bad options are one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
from accelopt_plugins.gradcomm import PLUGIN
from accelopt_plugins.gradcomm.codec import BucketCodec
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
