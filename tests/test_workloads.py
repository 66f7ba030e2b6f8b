"""Tests for the workload zoo: models, stateless datasets and job traces.

Everything here is tiny (small n_train, batch <= 32) because the suite shares a 2-core machine.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from accelopt.workloads import (
    DATASET_NAMES,
    MODEL_NAMES,
    TraceJob,
    build_dataset,
    build_model,
    check_compatible,
    default_dataset_for,
    generate_trace,
)
from accelopt.workloads.models import model_input_kind

BATCH = 32
SMALL = 256  # n_train for synthetic datasets in tests: building stays in milliseconds


def _model_and_batch(name: str, dataset: str | None = None):
    ds = build_dataset(dataset or default_dataset_for(name), seed=0, n_train=SMALL)
    torch.manual_seed(0)
    model = build_model(
        name, input_shape=ds.input_shape, num_classes=ds.num_classes, vocab_size=ds.vocab_size
    )
    return model, ds, ds.batch(0, BATCH)


# ------------------------------------------------------------------------------------ models


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_forward_backward_and_fx_trace(name: str) -> None:
    model, ds, (x, y) = _model_and_batch(name)
    out = model(x)
    assert out.shape == (BATCH, ds.num_classes)
    torch.nn.functional.cross_entropy(out, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    # fx-traceable, and the traced graph computes the same function
    traced = torch.fx.symbolic_trace(model)
    model.eval()
    traced.eval()
    torch.testing.assert_close(traced(x), model(x))


def test_no_dropout_anywhere() -> None:
    """Dropout would make a step depend on RNG state, breaking reproducibility across jobs.
    (nn.TransformerEncoderLayer always holds Dropout modules; they must have p == 0.)"""
    for name in MODEL_NAMES:
        model, _, _ = _model_and_batch(name)
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                assert mod.p == 0.0, name
            if isinstance(mod, torch.nn.MultiheadAttention):
                assert mod.dropout == 0.0, name
            if isinstance(mod, torch.nn.LSTM):
                assert mod.dropout == 0.0, name


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet", "inception"])
def test_image_models_accept_digits_8x8(name: str) -> None:
    model, _, (x, _) = _model_and_batch(name, "digits")
    assert model(x).shape == (BATCH, 10)


def test_inception_blocks_have_four_parallel_branches() -> None:
    """The comm-scheduling plugin relies on real parallel paths feeding one concat."""
    model, _, _ = _model_and_batch("inception")
    graph = torch.fx.symbolic_trace(model).graph
    cats = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert len(cats) == 2
    assert all(len(n.args[0]) == 4 for n in cats)


def test_width_changes_model_size() -> None:
    small = build_model("mlp", input_shape=(8,), num_classes=2, width=4)
    big = build_model("mlp", input_shape=(8,), num_classes=2, width=32)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in big.parameters())


def test_unknown_model_error_names_options() -> None:
    with pytest.raises(ValueError, match="known models: mlp, cnn, resnet") as err:
        build_model("vgg", input_shape=(4,), num_classes=2)
    assert "\n" not in str(err.value)


def test_sequence_model_needs_vocab_and_image_model_needs_chw() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("lstm", input_shape=(16,), num_classes=2)
    with pytest.raises(ValueError, match="image input_shape"):
        build_model("cnn", input_shape=(64,), num_classes=2)


def test_model_input_kind() -> None:
    assert [model_input_kind(m) for m in MODEL_NAMES] == [
        "vector",
        "image",
        "image",
        "image",
        "sequence",
        "sequence",
    ]


# ---------------------------------------------------------------------------------- datasets


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_batch_is_pure_function_of_seed_index_size(name: str) -> None:
    a = build_dataset(name, seed=3, n_train=100)
    b = build_dataset(name, seed=3, n_train=100)
    xa, ya = a.batch(5, 16)
    xb, yb = b.batch(5, 16)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.batch(5, 16)[0], xa)  # repeatable on the same object
    assert not torch.equal(a.batch(6, 16)[0], xa)
    assert xa.shape == (16, *a.input_shape) and ya.shape == (16,)
    assert xa.is_contiguous() and ya.is_contiguous()


def test_batch_does_not_alias_storage_and_ignores_global_rng() -> None:
    ds = build_dataset("synthetic_vectors", seed=1, n_train=64)
    x, _ = ds.batch(0, 8)
    before = x.clone()
    x.add_(100.0)  # a training step mutating its input must not leak back
    torch.manual_seed(12345)
    assert torch.equal(ds.batch(0, 8)[0], before)


def test_different_seeds_give_different_data() -> None:
    a = build_dataset("synthetic_images", seed=0, n_train=64).batch(0, 8)[0]
    b = build_dataset("synthetic_images", seed=1, n_train=64).batch(0, 8)[0]
    assert not torch.equal(a, b)


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    ds = build_dataset("synthetic_vectors", seed=0, n_train=40)
    epoch0 = torch.cat([ds.indices(i, 8) for i in range(5)])
    epoch1 = torch.cat([ds.indices(i, 8) for i in range(5, 10)])
    assert sorted(epoch0.tolist()) == list(range(40))
    assert sorted(epoch1.tolist()) == list(range(40))
    assert not torch.equal(epoch0, epoch1)
    # a batch straddling the boundary (positions 36..47) agrees with the stream
    stream = torch.cat([epoch0, epoch1])
    assert torch.equal(ds.indices(3, 12), stream[36:48])
    assert ds.batch(0, 100)[0].shape[0] == 100  # larger than the training set is fine


def test_bad_batch_arguments() -> None:
    ds = build_dataset("synthetic_vectors", seed=0, n_train=16)
    with pytest.raises(ValueError, match="index"):
        ds.batch(-1, 4)
    with pytest.raises(ValueError, match="batch_size"):
        ds.batch(0, 0)


def test_digits_real_data() -> None:
    ds = build_dataset("digits", seed=0)
    x_eval, y_eval = ds.eval_set()
    assert ds.n_train + len(x_eval) == 1797
    assert ds.n_train == 1438 and ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    x, _ = ds.batch(0, ds.n_train)
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.9
    assert set(y_eval.tolist()) == set(range(10))
    # the split is fixed: another seed changes order, not membership
    other_eval = build_dataset("digits", seed=7).eval_set()[0]
    assert torch.equal(other_eval, x_eval)
    with pytest.raises(ValueError, match="n_train"):
        build_dataset("digits", seed=0, n_train=5000)


def test_sequence_tokens_in_vocab() -> None:
    ds = build_dataset("synthetic_sequences", seed=0, n_train=64)
    x, y = ds.batch(0, 64)
    assert x.dtype == torch.int64 and ds.input_shape == (16,) and ds.vocab_size == 64
    assert int(x.min()) >= 0 and int(x.max()) < 64
    assert int(y.max()) < ds.num_classes == 4


def test_eval_set_is_a_copy() -> None:
    ds = build_dataset("synthetic_vectors", seed=0, n_train=16)
    x, _ = ds.eval_set()
    x.zero_()
    assert ds.eval_set()[0].abs().sum() > 0


def test_unknown_dataset_error_names_options() -> None:
    with pytest.raises(ValueError, match="known datasets: synthetic_vectors") as err:
        build_dataset("mnist", seed=0)
    assert "digits" in str(err.value) and "\n" not in str(err.value)


def test_default_dataset_and_compatibility() -> None:
    assert default_dataset_for("mlp") == "synthetic_vectors"
    assert {default_dataset_for(m) for m in ("cnn", "resnet", "inception")} == {"synthetic_images"}
    assert {default_dataset_for(m) for m in ("lstm", "transformer")} == {"synthetic_sequences"}
    digits = build_dataset("digits", seed=0, n_train=10)
    check_compatible("mlp", digits)  # the MLP flattens images
    check_compatible("cnn", digits)
    with pytest.raises(ValueError) as err:
        check_compatible("lstm", digits)
    assert str(err.value) == (
        "model 'lstm' needs sequence data; dataset 'digits' gives images: "
        "choose dataset=synthetic_sequences"
    )
    seqs = build_dataset("synthetic_sequences", seed=0, n_train=10)
    with pytest.raises(ValueError, match="choose dataset=synthetic_vectors"):
        check_compatible("mlp", seqs)


def test_mlp_learns_synthetic_vectors() -> None:
    ds = build_dataset("synthetic_vectors", seed=0, n_train=512)
    torch.manual_seed(0)
    model = build_model("mlp", input_shape=ds.input_shape, num_classes=ds.num_classes, width=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x_eval, y_eval = ds.eval_set()
    loss_fn = torch.nn.functional.cross_entropy
    with torch.no_grad():
        before = loss_fn(model(x_eval), y_eval).item()
    for i in range(30):
        x, y = ds.batch(i, BATCH)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = loss_fn(model(x_eval), y_eval).item()
    assert after < 0.5 * before


# ------------------------------------------------------------------------------------ traces

TRACE_ARGS = dict(
    n_jobs=200,
    seed=42,
    mean_interarrival_s=30.0,
    models=MODEL_NAMES,
    batch_sizes=(16, 32, 64),
    min_iterations=10,
    max_iterations=100_000,
)


def test_trace_deterministic_and_well_formed() -> None:
    jobs = generate_trace(**TRACE_ARGS)
    assert jobs == generate_trace(**TRACE_ARGS)
    assert jobs != generate_trace(**{**TRACE_ARGS, "seed": 43})
    assert len(jobs) == 200 and all(isinstance(j, TraceJob) for j in jobs)
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert all(10 <= j.iterations <= 100_000 for j in jobs)
    assert jobs[7].name == f"{jobs[7].model}-07"
    assert all(j.dataset == default_dataset_for(j.model) for j in jobs)
    assert {j.batch_size for j in jobs} == {16, 32, 64}
    assert len({j.seed for j in jobs}) == 200


def test_trace_iterations_are_heavy_tailed() -> None:
    iters = [j.iterations for j in generate_trace(**TRACE_ARGS)]
    assert max(iters) > 3 * statistics.median(iters)


def test_trace_tiny_alpha_does_not_overflow() -> None:
    jobs = generate_trace(**{**TRACE_ARGS, "pareto_alpha": 0.01})
    assert all(10 <= j.iterations <= 100_000 for j in jobs)
    assert max(j.iterations for j in jobs) == 100_000


def test_trace_zero_interarrival_means_batch_arrival() -> None:
    jobs = generate_trace(**{**TRACE_ARGS, "n_jobs": 5, "mean_interarrival_s": 0.0})
    assert [j.arrival_s for j in jobs] == [0.0] * 5


@pytest.mark.parametrize(
    "override, match",
    [
        ({"n_jobs": 0}, "n_jobs"),
        ({"pareto_alpha": 0.0}, "pareto_alpha"),
        ({"pareto_alpha": -1.0}, "pareto_alpha"),
        ({"min_iterations": 50, "max_iterations": 10}, "min_iterations"),
        ({"min_iterations": 0}, "min_iterations"),
        ({"models": ()}, "models"),
        ({"models": ("mlp", "vgg")}, "known models"),
        ({"batch_sizes": ()}, "batch_sizes"),
        ({"mean_interarrival_s": -1.0}, "mean_interarrival_s"),
    ],
)
def test_trace_bad_arguments(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        generate_trace(**{**TRACE_ARGS, **override})
    assert "\n" not in str(err.value)


@settings(max_examples=50, deadline=None)
@given(
    n_jobs=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    mean=st.floats(0.0, 1e4, allow_nan=False),
    models=st.lists(st.sampled_from(MODEL_NAMES), min_size=1, max_size=4),
    batch_sizes=st.lists(st.integers(1, 512), min_size=1, max_size=4),
    lo=st.integers(1, 1000),
    extra=st.integers(0, 10_000),
    alpha=st.floats(0.001, 100.0),
)
def test_trace_invariants_property(n_jobs, seed, mean, models, batch_sizes, lo, extra, alpha):
    kwargs = dict(
        n_jobs=n_jobs,
        seed=seed,
        mean_interarrival_s=mean,
        models=models,
        batch_sizes=batch_sizes,
        min_iterations=lo,
        max_iterations=lo + extra,
        pareto_alpha=alpha,
    )
    jobs = generate_trace(**kwargs)
    assert jobs == generate_trace(**kwargs)
    assert len(jobs) == n_jobs and jobs[0].arrival_s == 0.0
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals)
    for i, job in enumerate(jobs):
        assert lo <= job.iterations <= lo + extra
        assert job.model in models and job.batch_size in batch_sizes
        assert job.name == f"{job.model}-{i:02d}"
