"""Tests of the slide plugin: hash families, tables, the SLIDE layer's math, sparse Adam,
XC data, reproducibility and the plugin on ``workload=xc``. Sizes are small; numba kernels
compile once per process (cached on disk)."""

from __future__ import annotations

import math
import os

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from accelopt_plugins.slide import PLUGIN, kernels
from accelopt_plugins.slide.config import SlideConfig, validate
from accelopt_plugins.slide.hashing import make_family
from accelopt_plugins.slide.layer import SlideLinear, SlideLogits, SlideSparseInput
from accelopt_plugins.slide.metrics import precision_at_k
from accelopt_plugins.slide.rowgrads import RowGradients
from accelopt_plugins.slide.tables import RebuildSchedule, build_tables
from accelopt_plugins.slide.xcdata import XCSpec, generate, read_xc, write_xc
from accelopt_plugins.slide.xcmodel import XCNet, xc_softmax_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from accelopt.errors import ConfigError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_numba_thread")]


def _pair_at_angle(rng: np.random.Generator, dim: int, theta: float) -> np.ndarray:
    a = rng.standard_normal(dim)
    a /= np.linalg.norm(a)
    b = rng.standard_normal(dim)
    b -= (b @ a) * a
    b /= np.linalg.norm(b)
    return np.stack([a, math.cos(theta) * a + math.sin(theta) * b]).astype(np.float32)


# --------------------------------------------------------------------------------- hashing


@pytest.mark.parametrize("density", [1.0, 1.0 / 3.0])
def test_simhash_collision_probability_is_one_minus_theta_over_pi(density: float) -> None:
    fam = make_family("simhash", 48, 1, 3000, seed=1, density=density)
    rng = np.random.default_rng(0)
    for theta in (0.3, 1.0, 1.8, 2.6):
        rates = []
        for _ in range(4):
            v = fam.values_dense(_pair_at_angle(rng, 48, theta))
            rates.append(np.mean(v[0] == v[1]))
        expected = 1.0 - theta / math.pi
        tol = 0.03 if density == 1.0 else 0.06  # sparse projections approximate the sphere
        assert abs(np.mean(rates) - expected) < tol, (theta, np.mean(rates), expected)


@pytest.mark.parametrize("kind", ["simhash", "wta", "dwta"])
def test_csr_and_dense_inputs_give_identical_keys(kind: str) -> None:
    rng = np.random.default_rng(2)
    dense = rng.standard_normal((30, 200)).astype(np.float32)
    dense[rng.random(dense.shape) < 0.9] = 0.0  # sparse rows, some bins empty
    dense[3] = 0.0  # an all-zero row
    fam = make_family(kind, 200, 4, 6, seed=3, range_pow=10)
    indptr = np.concatenate([[0], np.cumsum((dense != 0).sum(1))])
    rows, cols = np.nonzero(dense)
    keys_csr = fam.keys_csr(indptr, cols, dense[rows, cols])
    assert np.array_equal(keys_csr, fam.keys_dense(dense))
    assert keys_csr.min() >= 0 and keys_csr.max() < fam.n_buckets


def test_dwta_densification_fills_empty_bins_and_tracks_similarity() -> None:
    rng = np.random.default_rng(4)
    dim = 1000
    fam = make_family("dwta", dim, 1, 400, seed=5, bin_size=8)
    base = np.zeros(dim, np.float32)
    support = rng.choice(dim, 20, replace=False)
    base[support] = rng.random(20) + 0.1
    near, far = base.copy(), np.zeros(dim, np.float32)
    near[support[:2]] *= 0.5  # perturb two of twenty values
    far[rng.choice(dim, 20, replace=False)] = rng.random(20) + 0.1
    v = fam.values_dense(np.stack([base, near, far]))
    # with 20 of 1000 coordinates set, most bins of 8 are empty: values still span the range
    assert len(np.unique(v[0])) > 1
    assert np.mean(v[0] == v[1]) > np.mean(v[0] == v[2]) + 0.3


def test_bad_family_arguments() -> None:
    with pytest.raises(ValueError, match="hash family must be one of"):
        make_family("minhash", 8, 1, 1, seed=0)
    with pytest.raises(ValueError, match="power of two"):
        make_family("wta", 8, 1, 1, seed=0, bin_size=6)


# ---------------------------------------------------------------------------------- tables


@pytest.mark.parametrize("reservoir", [0, 1])
def test_tables_hold_each_neuron_in_its_bucket_and_cap_overflow(reservoir: int) -> None:
    rng = np.random.default_rng(6)
    n, n_tables, n_buckets, cap = 500, 3, 16, 8
    keys = rng.integers(0, n_buckets, (n, n_tables)).astype(np.int32)
    keys[:40, 0] = 5  # bucket 5 of table 0 overflows
    tables = np.full((n_tables, n_buckets, cap), -1, np.int32)
    counts = np.zeros((n_tables, n_buckets), np.int32)
    build_tables(keys, tables, counts, reservoir, 7)
    for t in range(n_tables):
        assert counts[t].sum() == n
        for b in range(n_buckets):
            size = min(counts[t, b], cap)
            members = tables[t, b, :size]
            assert np.all(keys[members, t] == b)
            assert len(set(members.tolist())) == size
    if reservoir:  # a uniform sample of the 40+ inserts, not just the last 8
        assert tables[0, 5].min() < 40 - cap
    else:  # FIFO ring keeps the last `cap` inserts
        last = [i for i in range(n) if keys[i, 0] == 5][-cap:]
        assert sorted(tables[0, 5].tolist()) == sorted(last)
    again = np.full_like(tables, -1)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    build_tables(keys, again, counts.copy(), reservoir, 7)
    assert np.array_equal(again, tables)  # deterministic whatever the thread count


def test_rebuild_schedules() -> None:
    fixed = RebuildSchedule("fixed", period=10)
    points = []
    for step in range(60):
        if fixed.due(step):
            points.append(step)
            fixed.done(step, rebuilt=True)
    assert points == [10, 20, 30, 40, 50]
    decay = RebuildSchedule("decay", period=10, growth=2.0, max_period=35)
    points = []
    for step in range(200):
        if decay.due(step):
            points.append(step)
            decay.done(step, rebuilt=True)
    assert np.diff(points).tolist()[:3] == [20, 35, 35]
    with pytest.raises(ValueError, match="rebuild schedule"):
        RebuildSchedule("weekly")


# ----------------------------------------------------------------------------- the layer


def _layer(n: int = 300, d: int = 16, **kw) -> SlideLinear:
    cfg = SlideConfig(**{"k": 4, "l": 8, "bucket_size": 16, "min_active": 40, **kw})
    torch.manual_seed(0)
    return SlideLinear(d, n, cfg, lr=1e-2)


def test_a_max_active_below_a_samples_labels_is_an_error_not_a_write_past_the_buffer() -> None:
    """The kernel writes every label into the active set: with max_active below a sample's
    label count it wrote past its buffer (numba checks no bounds: a segfault, or glibc's
    'free(): invalid size')."""
    layer = _layer(max_active=2)
    layer.rebuild()
    h = np.random.default_rng(8).standard_normal((4, 16)).astype(np.float32)
    labels = np.array([[3, 7, 11, -1]] * 4, np.int64)
    with pytest.raises(ValueError, match=r"max_active=2 holds fewer neurons than a sample's 3 "
                       "labels"):
        layer.select(h, labels, 40)
    layer.select(h, np.array([[3, 7, -1, -1]] * 4, np.int64), 40)  # padding is no label


def test_active_set_contains_labels_and_reaches_min_active() -> None:
    layer = _layer()
    layer.rebuild()
    h = np.random.default_rng(8).standard_normal((6, 16)).astype(np.float32)
    labels = np.array([[3, 299, -1]] * 6, np.int64)
    s = layer.select(h, labels, 40)
    for b in range(6):
        ids = s["ids"][b, : s["n_active"][b]]
        assert len(set(ids.tolist())) == len(ids) >= 40
        assert {3, 299} <= set(ids.tolist())
        assert s["is_label"][b, : len(ids)].sum() == 2


@pytest.mark.parametrize(("sampling", "limit"), [("topk", 25), ("threshold", None)])
def test_sampling_modes(sampling: str, limit: int | None) -> None:
    layer = _layer(sampling=sampling, topk=25, threshold=2, min_active=0)
    layer.rebuild()
    h = np.random.default_rng(9).standard_normal((4, 16)).astype(np.float32)
    s = layer.select(h, np.zeros((4, 0), np.int64), 0)
    union = _layer(min_active=0)
    union.rebuild()
    su = union.select(h, np.zeros((4, 0), np.int64), 0)
    for b in range(4):
        assert 0 < s["n_active"][b] <= su["n_active"][b]
        if limit:
            assert s["n_active"][b] == min(limit, su["n_active"][b])


def test_batch_topup_candidates_are_the_batch_labels_then_distinct_draws() -> None:
    layer = _layer(topup="batch")
    labels = np.array([[3, 299], [5, -1], [7, 3], [11, -1], [13, -1], [17, 19]], np.int64)
    shared, n_labels = layer.shared_candidates(labels, 40)
    assert shared[:n_labels].tolist() == [3, 5, 7, 11, 13, 17, 19, 299]
    assert len(set(shared.tolist())) == len(shared) == 40
    assert np.array_equal(np.sort(shared), np.arange(300)[np.isin(np.arange(300), shared)])
    many = layer.shared_candidates(np.arange(280).reshape(4, 70), 40)  # labels beyond 40
    assert many[1] == 280 and many[0].tolist() == list(range(280))
    assert len(layer.shared_candidates(labels, 1000)[0]) == 300  # capped at the width
    assert np.array_equal(shared, layer.shared_candidates(labels, 40)[0])  # seeded by step


@pytest.mark.parametrize("logq", [False, True])
def test_batch_topup_gradients_equal_autograd_over_retrieved_plus_shared(logq: bool) -> None:
    """Each sample's softmax runs over its retrieved neurons and the shared list; loss, input
    gradient and row gradients match a plain per-sample autograd reference."""
    layer = _layer(topup="batch", logq=logq, topk=10)
    layer.rebuild()
    rng = np.random.default_rng(10)
    h = rng.standard_normal((5, 16)).astype(np.float32)
    labels = np.array([[1, 7, -1], [2, -1, -1], [0, 5, 9], [4, -1, -1], [8, 3, -1]], np.int64)
    shared, n_lab = layer.shared_candidates(labels, 40)
    s = layer.select(h, labels, 0)
    own = [[int(j) for j in s["ids"][b, : s["n_active"][b]] if j not in shared] for b in range(5)]
    assert all(own) and len(shared) > n_lab  # something retrieved, something drawn
    captured = {}

    def capture(start):
        w, b = layer.grads.dense()
        captured.update(w=torch.from_numpy(w), b=torch.from_numpy(b),
                        rows=set(layer.grads.rows[:layer.grads.count].tolist()))

    layer.update = capture
    ht = torch.from_numpy(h).requires_grad_(True)
    loss = SlideLogits(layer, ht).loss_against(torch.from_numpy(labels))
    loss.backward()
    w = layer.weight.clone().requires_grad_(True)
    bias = layer.bias.clone().requires_grad_(True)
    hr = torch.from_numpy(h).requires_grad_(True)
    n, total = layer.out_features, 0.0
    for b in range(5):
        ids = torch.tensor(own[b] + shared.tolist())
        logits = w[ids] @ hr[b] + bias[ids]
        drawn = len(shared) - n_lab
        if logq:  # the drawn part stands for everything outside own retrieved + batch labels
            shift = np.log((n - len(own[b]) - n_lab) / drawn)
            logits = logits + torch.tensor([0.0] * (len(own[b]) + n_lab) + [shift] * drawn)
        target = torch.tensor([float(int(j) in labels[b]) for j in ids])
        total = total - (target / target.sum() * torch.log_softmax(logits, 0)).sum()
    (total / 5).backward()
    assert float(loss.detach()) == pytest.approx(float(total.detach()) / 5, rel=1e-5)
    np.testing.assert_allclose(ht.grad.numpy(), hr.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(captured["w"].numpy(), w.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(captured["b"].numpy(), bias.grad.numpy(), rtol=1e-4, atol=1e-6)
    assert captured["rows"] == set(shared.tolist()) | {j for o in own for j in o}


@pytest.mark.parametrize(("logq", "backward"), [(False, "rows"), (True, "rows"),
                                               (True, "hogwild")])
def test_gradients_on_active_set_equal_dense_autograd(logq: bool, backward: str) -> None:
    layer = _layer(logq=logq, topk=10, backward=backward)  # 10 retrieved + labels, up to 40
    layer.rebuild()
    rng = np.random.default_rng(10)
    h = rng.standard_normal((5, 16)).astype(np.float32)
    labels = np.array([[1, 7, -1], [2, -1, -1], [0, 5, 9], [4, -1, -1], [8, 3, -1]], np.int64)
    s = layer.select(h, labels, 40)
    kernels.forward_active(h, layer.weight.numpy(), layer.bias.numpy(), s["ids"], s["n_active"],
                           s["is_label"], s["n_fixed"], s["offset"], s["logits"], s["dz"], s["loss"])
    n = layer.out_features
    for b in range(5):  # the random top-up stands for the neurons outside the fixed part
        fixed, drawn = int(s["n_fixed"][b]), int(s["n_active"][b] - s["n_fixed"][b])
        assert drawn > 0
        expected = np.log((n - fixed) / drawn) if logq else 0.0
        assert s["offset"][b] == pytest.approx(expected, rel=1e-6)
    g = layer.grads
    n_rows = g.assign(s["ids"], s["n_active"])
    assert np.all(np.diff(g.rows[:n_rows]) > 0)  # distinct and sorted: Adam walks in order
    if not g.by_rows:  # the HOGWILD kernels find a row's packed gradient by its slot
        assert g.slot[g.rows[:n_rows]].tolist() == list(range(n_rows))
    dh = layer.own_rows_backward(h, s, np.float32(1.0 / 5))
    grad_w, grad_b = g.dense()
    w = layer.weight.clone().requires_grad_(True)
    bias = layer.bias.clone().requires_grad_(True)
    ht = torch.from_numpy(h).requires_grad_(True)
    total = 0.0
    for b in range(5):
        ids = torch.from_numpy(s["ids"][b, : s["n_active"][b]].astype(np.int64))
        logits = w[ids] @ ht[b] + bias[ids]
        logits = logits + torch.tensor(
            [float(s["offset"][b]) if i >= s["n_fixed"][b] else 0.0 for i in range(len(ids))])
        target = torch.tensor([float(int(j) in labels[b]) for j in ids])
        target /= target.sum()
        total = total - (target * torch.log_softmax(logits, 0)).sum()
    (total / 5).backward()
    np.testing.assert_allclose(s["loss"].mean(), float(total.detach()) / 5, rtol=1e-5)
    np.testing.assert_allclose(dh, ht.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad_w, w.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad_b, bias.grad.numpy(), rtol=1e-4, atol=1e-6)
    g.release()
    assert (g.slot == -1).all()


def _adam_rows(rng: np.random.Generator, n: int, d: int) -> tuple[np.ndarray, ...]:
    """Initial weights and the zeroed state arrays ``kernels.sparse_adam`` updates in place:
    (w0, w, m, v, g, b, mb, vb, gb, steps, dirty); g and gb are packed (row r of them is the
    gradient of the r-th row passed)."""
    w0 = rng.standard_normal((n, d)).astype(np.float32)
    w, m, v, g = w0.copy(), np.zeros_like(w0), np.zeros_like(w0), np.zeros_like(w0)
    b, mb, vb, gb = (np.zeros(n, np.float32) for _ in range(4))
    return w0, w, m, v, g, b, mb, vb, gb, np.zeros(n, np.int64), np.zeros(n, np.uint8)


def test_sparse_adam_matches_torch_adam_and_leaves_other_rows_alone() -> None:
    rng = np.random.default_rng(11)
    n, d = 6, 5
    w0, w, m, v, g, b, mb, vb, gb, steps, dirty = _adam_rows(rng, n, d)
    ref = torch.nn.Parameter(torch.from_numpy(w0[:3].copy()))
    opt = torch.optim.Adam([ref], lr=0.01)
    for _ in range(5):
        grad = rng.standard_normal((3, d)).astype(np.float32)
        g[:3] = grad
        rows = np.array([0, 1, 2], np.int32)
        kernels.sparse_adam(rows, 3, w, g, m, v, b, gb, mb, vb, steps, dirty, 0.01, 0.9, 0.999,
                            1e-8, 0)
        ref.grad = torch.from_numpy(grad)
        opt.step()
    np.testing.assert_allclose(w[:3], ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.array_equal(w[3:], w0[3:]) and not g.any()  # untouched rows, grads zeroed
    assert steps.tolist() == [5, 5, 5, 0, 0, 0] and dirty.tolist() == [1, 1, 1, 0, 0, 0]
    # lazy bias correction: a row updated for the first time uses t = 1 (a full-size step)
    g[0] = 1.0  # packed: the first (only) row passed
    kernels.sparse_adam(np.array([4], np.int32), 1, w, g, m, v, b, gb, mb, vb, steps, dirty,
                        0.01, 0.9, 0.999, 1e-8, 0)
    np.testing.assert_allclose(w[4], w0[4] - 0.01, rtol=1e-5)


def test_sparse_adam_global_correction_matches_torch_sparse_adam_on_intermittent_rows() -> None:
    """The default (global step count) is torch's SparseAdam, also for rows that sit idle for
    many steps: per-row counts (the old behaviour) shrink a rare row's steps ~3x and fail."""
    rng = np.random.default_rng(12)
    n, d = 8, 4
    w0, w, m, v, g, b, mb, vb, gb, steps, dirty = _adam_rows(rng, n, d)
    emb = torch.nn.Embedding(n, d, sparse=True)
    emb.weight.data.copy_(torch.from_numpy(w0))
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    for t in range(1, 41):
        rows = np.array([0, 1] + ([5] if t % 13 == 0 else []) + ([6] if t == 30 else []), np.int32)
        grad = rng.standard_normal((len(rows), d)).astype(np.float32)
        g[: len(rows)] = grad
        kernels.sparse_adam(rows, len(rows), w, g, m, v, b, gb, mb, vb, steps, dirty, 0.01, 0.9,
                            0.999, 1e-8, t)
        opt.zero_grad()
        emb(torch.from_numpy(rows.astype(np.int64))).mul(torch.from_numpy(grad)).sum().backward()
        opt.step()
    np.testing.assert_allclose(w, emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert steps[[0, 5, 6, 7]].tolist() == [40, 3, 1, 0]


def test_all_active_slide_trains_exactly_like_the_dense_baseline() -> None:
    """With every label active (min_active = width) SLIDE's network must follow dense
    training (EmbeddingBag + SparseAdam first layer, Linear + full softmax + Adam) step for
    step: the sampling is then the only thing that can make SLIDE learn less per step."""
    n_feat, n_lab, hidden, batch = 60, 40, 16, 8
    cfg = SlideConfig(k=3, l=4, bucket_size=8, min_active=n_lab, threads=1)
    torch.manual_seed(3)
    net = XCNet(n_feat, n_lab, hidden)
    emb = torch.nn.EmbeddingBag(n_feat, hidden, mode="sum", sparse=True)
    emb.weight.data.copy_(net.embed.weight.detach())
    bias = torch.nn.Parameter(net.embed.bias.detach().clone())
    out = torch.nn.Linear(hidden, n_lab)
    out.load_state_dict(net.out.state_dict())
    opts = [torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2),
            torch.optim.Adam([bias, *out.parameters()], lr=1e-2)]
    slide_out = SlideLinear.from_linear(net.out, cfg, lr=1e-2)
    slide_in = SlideSparseInput(net.embed.weight, net.embed.bias, cfg, lr=1e-2)
    slide_opt = torch.optim.Adam(slide_in.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        # each sample uses 3 of the first 30 features: the others stay idle, rows go in and out
        feats = torch.randint(0, 30, (batch, 3), generator=gen)
        vals = torch.rand(batch, 3, generator=gen)
        x = torch.stack([feats.float(), vals], 1)
        y = torch.randint(0, n_lab, (batch, 2), generator=gen)
        y[::3, 1] = -1
        logits = out(torch.relu(emb(feats, per_sample_weights=vals) + bias))
        loss = xc_softmax_loss(logits, y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        slide_loss = slide_out(torch.relu(slide_in(x))).loss_against(y)
        slide_opt.zero_grad()
        slide_loss.backward()
        slide_opt.step()
        np.testing.assert_allclose(float(slide_loss.detach()), float(loss.detach()), rtol=2e-5)
    # tolerance: torch's SparseAdam adds eps before the bias correction (dense Adam after), so
    # near-zero gradient entries move slightly differently (~1e-3 here); per-row bias
    # correction (the old default) drifts to ~4e-2 in these 30 steps
    for mine, ref in ((slide_in.weight, emb.weight), (slide_out.weight, out.weight),
                      (slide_out.bias, out.bias)):
        np.testing.assert_allclose(mine.numpy(), ref.detach().numpy(), atol=5e-3)


def test_nan_and_inf_inputs_are_rejected() -> None:
    layer = _layer()
    h = torch.zeros(3, 16)
    h[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf.*row 1"):
        layer(h)
    sparse = SlideSparseInput(torch.zeros(10, 4), torch.zeros(4), SlideConfig(), lr=1e-3)
    x = torch.zeros(2, 2, 3)
    x[0, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf.*row 0"):
        sparse(x)


@pytest.mark.parametrize("case", ["nan", "int", "width"])
@pytest.mark.parametrize("mode", ["train", "dense", "lsh"])
def test_bad_hidden_states_are_one_line_errors_in_every_mode(mode: str, case: str) -> None:
    """Checked before any kernel: an integer tensor or a wrong width would be read as
    float32 rows of the layer's width (garbage or out of bounds), a NaN would poison Adam."""
    layer = _layer(inference="dense" if mode == "train" else mode)
    layer.train(mode == "train")
    h = {"nan": torch.zeros(2, 3, 16), "int": torch.ones(4, 16, dtype=torch.int64),
         "width": torch.randn(4, 15)}[case]
    if case == "nan":
        h[1, 2, 5] = float("nan")
    needle = {"nan": "NaN or inf.*row 1", "int": "must be floating point.*int64",
              "width": r"shape \(4, 15\).*16 in_features"}[case]
    with pytest.raises(ValueError, match=needle) as info:
        out = layer(h)
        out.loss_against(torch.zeros(4, dtype=torch.int64)).backward()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("h_shape", "y", "needle"), [
    ((40, 16), torch.zeros(3, dtype=torch.int64), r"targets of shape \[3\].*\[40, 16\]"),
    ((4, 16), torch.zeros(6, dtype=torch.int64), r"targets of shape \[6\]"),
    ((2, 3, 16), torch.zeros(3, 2, dtype=torch.int64), "a sequence model's per-token logits"),
    ((4, 16), torch.zeros(4), "integer label ids, got torch.float32"),
    ((4, 16), torch.full((4,), 300), r"label ids must be in \[0, 300\)"),
])
def test_targets_that_do_not_line_up_with_the_rows_are_one_line_errors(h_shape, y, needle
                                                                        ) -> None:
    """The kernels read sample b's labels at row b: fewer target rows than hidden rows was
    a read past the end (a crash), more a silent misassignment; float ids were truncated."""
    layer = _layer()
    with pytest.raises(ValueError, match=needle) as info:
        layer(torch.randn(*h_shape)).loss_against(y)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="^slide: "):  # the cross-entropy path checks too
        torch.nn.functional.cross_entropy(layer(torch.randn(*h_shape)), y.reshape(-1)[:5])


def test_sequence_states_flatten_with_their_targets_and_other_dtypes_are_converted() -> None:
    """[B, T, d] states viewed as [B*T, V] logits with their flattened [B*T] targets are the
    B*T rows with their labels (the loss of the flattened batch, bit for bit); unflattened
    they are refused, as dense cross-entropy refuses per-token logits (test_slide_defects).
    A float64 input trains and gets a float64 gradient."""
    h = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(5))
    y = torch.randint(300, (2, 3), generator=torch.Generator().manual_seed(6))
    loss3 = F.cross_entropy(_layer()(h).view(-1, 300), y.view(-1))
    loss2 = _layer()(h.reshape(6, 16)).loss_against(y.reshape(6))
    assert float(loss3.detach()) == float(loss2.detach())
    h64 = h.reshape(6, 16).double().requires_grad_(True)
    _layer()(h64).loss_against(y.reshape(6)).backward()
    assert h64.grad is not None and h64.grad.dtype == torch.float64
    assert torch.isfinite(h64.grad).all()


def test_sparse_input_refuses_bad_shapes_and_negative_ids() -> None:
    sparse = SlideSparseInput(torch.zeros(10, 4), torch.zeros(4), SlideConfig(), lr=1e-3)
    with pytest.raises(ValueError, match=r"\[batch, 2, slots\].*\[2, 3\]"):
        sparse(torch.zeros(2, 3))
    x = torch.zeros(2, 2, 3)
    x[0, 0, 1] = -4
    with pytest.raises(ValueError, match="feature id -4 < 0"):
        sparse(x)


def _old_sparse_logits(layer: SlideLinear, h: torch.Tensor) -> torch.Tensor:
    """The per-row loop the vectorised scatter replaced (the reference for equality)."""
    hn = np.ascontiguousarray(h.detach().numpy(), dtype=np.float32)
    s = layer.select(hn, np.zeros((hn.shape[0], 0), np.int64), 0)
    kernels.forward_active(hn, layer.weight.numpy(), layer.bias.numpy(), s["ids"],
                           s["n_active"], s["is_label"], s["n_fixed"], s["offset"],
                           s["logits"], s["dz"], s["loss"])
    out = torch.full((hn.shape[0], layer.out_features), -math.inf)
    for b in range(hn.shape[0]):
        na = int(s["n_active"][b])
        out[b, torch.from_numpy(s["ids"][b, :na].astype(np.int64))] = torch.from_numpy(
            s["logits"][b, :na].copy())
    return out


def test_sparse_logits_equal_the_row_loop_and_topk_needs_no_dense_row() -> None:
    layer = _layer(inference="lsh", min_active=0, topk=12)
    layer.eval()
    h = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(7))
    out = layer(h)
    assert out.shape == (2, 5, 300)
    assert torch.equal(out.reshape(10, 300), _old_sparse_logits(layer, h.reshape(10, 16)))
    for k in (1, 5, 20):  # 20: more than the 12 retrieved, padded with -inf and id -1
        values, ids = layer.sparse_topk(h, k)
        assert values.shape == ids.shape == (2, 5, k)
        ref_values, ref_ids = out.topk(k, dim=-1)
        assert torch.equal(values, ref_values)
        finite = torch.isfinite(values)
        assert torch.equal(ids[finite], ref_ids[finite]) and (ids[~finite] == -1).all()
    assert int(torch.isfinite(values).sum(-1).max()) == 12


def test_lsh_inference_rebuilds_tables_that_miss_trained_rows() -> None:
    """Rows the sparse Adam moved since the last scheduled rebuild are rehashed before LSH
    inference scores them (the tables then match a full rebuild from the weights)."""
    layer = _layer(inference="lsh", rebuild_period=50)
    h = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    y = torch.randint(300, (8, 2), generator=torch.Generator().manual_seed(4))
    for _ in range(3):
        layer(h).loss_against(y).backward()
    assert layer.tables_stale() and layer.dirty.numpy().any()
    layer.eval()
    layer(h)
    assert not layer.tables_stale()
    assert np.array_equal(layer.keys.numpy(), layer._neuron_keys())


def test_lsh_inference_scores_only_retrieved_neurons() -> None:
    layer = _layer(inference="lsh", min_active=0)
    layer.eval()
    out = layer(torch.randn(4, 16))
    finite = torch.isfinite(out)
    assert 0 < int(finite.sum(1).min()) and int(finite.sum(1).max()) < layer.out_features
    layer.cfg.inference = "dense"
    assert torch.isfinite(layer(torch.randn(4, 16))).all()


# --------------------------------------------------------------------------------- data


def test_generator_shape_and_determinism() -> None:
    spec = XCSpec(n_labels=500, n_features=800, n_train=2000, n_test=300, seed=3)
    train, test = generate(spec)
    again, _ = generate(spec)
    assert np.array_equal(train.indices, again.indices) and np.array_equal(train.data, again.data)
    per_point = np.diff(train.label_ptr)
    assert 4.0 < per_point.mean() < 6.0 and per_point.min() >= 1
    freq = np.sort(np.bincount(train.labels, minlength=500))[::-1]
    assert freq[0] > 10 * np.median(freq)  # Zipf: a heavy head, a long tail
    norms = np.sqrt(np.add.reduceat(train.data.astype(np.float64) ** 2, train.indptr[:-1]))
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    assert test.n == 300 and test.n_labels == 500


def test_xc_format_round_trip(tmp_path) -> None:
    train, _ = generate(XCSpec(n_labels=50, n_features=80, n_train=40, n_test=5))
    path = tmp_path / "train.txt"
    write_xc(path, train)
    back = read_xc(path)
    for f in ("indptr", "indices", "label_ptr", "labels"):
        assert np.array_equal(getattr(back, f), getattr(train, f)), f
    np.testing.assert_allclose(back.data, train.data, rtol=1e-6)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("2 5 3\n0,1 0:1.0\n1 3:0.5 x\n", ":3: expected 'feature:value'"),
        ("2 5 3\n0 0:1.0\n7 1:1\n", ":3: expected label ids in [0, 3)"),
        ("2 5 3\n0 9:1.0\n1 1:1\n", ":2: expected 'feature:value' with feature in [0, 5)"),
        ("2 5 3\n0 1:nan\n1 1:1\n", ":2: expected 'feature:value'"),
        ("2 five 3\n", ":1: expected header 'N D L'"),
        ("3 5 3\n0 1:1\n", "header says 3 points but the file has 1"),
    ],
)
def test_malformed_xc_file_names_the_line(tmp_path, body: str, fragment: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(body)
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
        read_xc(path)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3, unique=True), min_size=1,
                max_size=6))
def test_xc_loss_equals_mean_of_per_label_cross_entropy(label_sets) -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(label_sets), 10)
    y = torch.full((len(label_sets), 3), -1)
    for i, labs in enumerate(label_sets):
        y[i, : len(labs)] = torch.tensor(labs, dtype=torch.long)
    expected = torch.stack([
        torch.stack([torch.nn.functional.cross_entropy(logits[i : i + 1], torch.tensor([j]))
                     for j in labs]).mean() if labs else torch.tensor(0.0)
        for i, labs in enumerate(label_sets)
    ]).mean()
    torch.testing.assert_close(xc_softmax_loss(logits, y), expected)


# ------------------------------------------------------------------------------ training


def _train_slide(steps: int, seed: int = 0, **kw):
    from accelopt_plugins.slide.xcdata import xc_2k

    ds = xc_2k(seed)
    cfg = SlideConfig(**{"k": 6, "l": 10, "bucket_size": 32, "min_active": 150, "threads": 1,
                         "rebuild_period": 25, **kw})
    torch.manual_seed(seed)
    model = XCNet(ds.vocab_size, ds.num_classes)
    model.out = SlideLinear.from_linear(model.out, cfg, lr=2e-3)
    model.embed = SlideSparseInput(model.embed.weight, model.embed.bias, cfg, lr=2e-3)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for i in range(steps):
        x, y = ds.batch(i, 128)
        loss = model(x).loss_against(y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, ds


@pytest.mark.parametrize("topup", ["sample", "batch"])
def test_an_output_layer_without_a_bias_trains_none(topup: str) -> None:
    """A replaced Linear(bias=False) (GPT-2's head) got a zero bias that SLIDE's Adam
    trained: the run's held-out score was that of a model the user's architecture cannot
    load (its weights had an extra lm_head.bias)."""
    from accelopt_plugins.slide.xcdata import xc_2k

    ds = xc_2k(0)
    cfg = SlideConfig(k=6, l=10, bucket_size=32, min_active=150, threads=1, topup=topup)
    torch.manual_seed(0)
    model = XCNet(ds.vocab_size, ds.num_classes)
    model.out = torch.nn.Linear(model.out.in_features, model.out.out_features, bias=False)
    model.out = SlideLinear.from_linear(model.out, cfg, lr=1e-2)
    before = model.out.weight.clone()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(5):
        x, y = ds.batch(i, 64)
        loss = model(x).loss_against(y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(model.out.weight, before)  # it trained
    assert torch.count_nonzero(model.out.bias) == 0 and not model.out.has_bias
    assert model.out.grads.b[:model.out.grads.b.shape[0]].any() == 0  # nothing left over
    with_bias = SlideLinear.from_linear(torch.nn.Linear(8, 300), cfg, lr=1e-2)
    assert with_bias.has_bias


@pytest.mark.parametrize("topup", ["sample", "batch"])
def test_small_xc_problem_learns_far_above_chance(topup: str) -> None:
    model, ds = _train_slide(120, topup=topup)
    p1, p5 = precision_at_k(model, ds, (1, 5), limit=1000)
    top_label = np.bincount(ds.train.labels).argmax()
    majority = np.mean([top_label in s for s in ds.test.label_sets()[:1000]])
    assert p1 > max(0.3, 2.5 * majority), (p1, majority)  # majority label: ~0.13
    assert p5 > 0.05
    # batch: every sample also scores all the batch's labels (~450 of these 2,000)
    assert 0 < model.out.summary()["active_fraction"] < (0.2 if topup == "sample" else 0.35)


@pytest.mark.parametrize("topup", ["sample", "batch"])
def test_single_thread_training_is_bit_for_bit_reproducible(topup: str) -> None:
    a, _ = _train_slide(12, topup=topup)
    b, _ = _train_slide(12, topup=topup)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), name


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
@pytest.mark.parametrize("topup", ["sample", "batch"])
def test_two_thread_training_with_the_row_backward_is_reproducible(topup: str) -> None:
    """``backward=rows`` sums every gradient row in one thread and the input gradient in fixed
    per-thread parts, so a 2-thread run repeats bit for bit too (HOGWILD's would not)."""
    before = numba.get_num_threads()
    try:
        a, _ = _train_slide(12, topup=topup, threads=2)
        b, _ = _train_slide(12, topup=topup, threads=2)
    finally:
        numba.set_num_threads(before)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), name


# -------------------------------------------------------------------------------- plugin


def test_config_validation_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"plugins\.slide\.hash='md5'"):
        validate(SlideConfig(hash="md5"))
    with pytest.raises(ConfigError, match=r"plugins\.slide\.bin_size"):
        validate(SlideConfig(bin_size=3))
    with pytest.raises(ConfigError, match=r"plugins\.slide\.adam_correction='step'"):
        validate(SlideConfig(adam_correction="step"))
    with pytest.raises(ConfigError, match=r"plugins\.slide\.topup='shared'.*sample, batch"):
        validate(SlideConfig(topup="shared"))


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("rebuild_growth", math.nan, "rebuild_growth must be a finite number >= 1"),
    ("rebuild_growth", math.inf, "rebuild_growth must be a finite number >= 1"),
    ("seed", -1, "seed must be >= 0"),
    ("seed", 2**40, "seed must be < 2"),
    ("rebuild_max_period", 0, "rebuild_max_period must be >= 1"),
])
def test_settings_that_failed_mid_run_are_refused_at_configure(key: str, value: object,
                                                               needle: str) -> None:
    """nan passed ``growth < 1.0`` and inf failed at the first rebuild (OverflowError /
    ValueError); seed=-1 raised numpy's 'expected non-negative integer' in the layer build."""
    with pytest.raises(ConfigError, match=needle) as info:
        validate(SlideConfig(**{key: value}))
    assert "\n" not in str(info.value)


def test_a_huge_rebuild_growth_caps_at_max_period_instead_of_overflowing() -> None:
    """``period * growth**r`` overflowed for growth=1e308 (and for 1.5 after ~1750 rebuilds)."""
    sched = RebuildSchedule("decay", period=50, growth=1e308, max_period=2000)
    sched.done(50, rebuilt=True)
    assert sched.next_at == 2050
    sched = RebuildSchedule("decay", period=50, growth=1.5, max_period=2000, rebuilds=5000)
    sched.done(0, rebuilt=True)
    assert sched.next_at == 2000
    sched = RebuildSchedule("decay", period=50, growth=1.5, max_period=2000)
    sched.done(50, rebuilt=True)
    assert sched.next_at == 50 + 75  # below the cap: the geometric gap as before


def test_hash_settings_the_tables_cannot_hold_are_refused() -> None:
    """k=200 with simhash was reported as K=200, but a key keeps the last 64 bits of code
    only; range_pow=30 passed validation and failed in the layer's build asking the
    allocator for terabytes."""
    with pytest.raises(ConfigError, match=r"plugins\.slide\.k=200: a table key holds 64 "
                                          r"bits .* k must be <= 64"):
        validate(SlideConfig(k=200))
    with pytest.raises(ConfigError, match=r"k must be <= 21"):  # dwta: 3 bits per hash
        validate(SlideConfig(hash="dwta", bin_size=8, k=22))
    validate(SlideConfig(k=64))
    with pytest.raises(ConfigError, match=r"plugins\.slide\.range_pow=30: .* need [\d,]+ GiB, "
                                          r"more than this machine's") as info:
        validate(SlideConfig(range_pow=30, l=50))
    assert "\n" not in str(info.value)
    validate(SlideConfig(range_pow=12, l=50))


XC_SMALL = [
    "workload=xc", "workload.jobs.0.dataset=accelopt_plugins.slide.xcdata:xc_2k",
    "workload.jobs.0.iterations=6", "workload.jobs.0.batch_size=64", "run.profile=false",
]


def test_workload_xc_runs_with_and_without_the_plugin(run_tiny) -> None:
    dense = run_tiny(overrides=XC_SMALL, workload="xc")
    slide = run_tiny(PLUGIN, overrides=[*XC_SMALL, "plugins.slide.min_width=1000",
                                        "plugins.slide.l=8", "plugins.slide.threads=1"],
                     workload="xc")
    assert dense.jobs[0].status == slide.jobs[0].status == "done"
    row = next(r for r in slide.plugin_rows if r.plugin == "slide")
    assert "LSH-sampled softmax" in row.summary and row.metrics["union_rows_per_batch"] > 0
    # the loss column is the sampled loss (3.5x below dense while P@1 was worse): said
    assert "the loss column is the sampled softmax's over each active set" in row.summary


def test_lsh_inference_is_scored_on_the_held_out_set(run_tiny) -> None:
    """LSH inference marks the neurons it did not retrieve -inf; the scorer refused such
    logits ('not finite') and the job was never scored."""
    record = run_tiny(PLUGIN, overrides=[*XC_SMALL, "plugins.slide.min_width=1000",
                                         "plugins.slide.l=8", "plugins.slide.threads=1",
                                         "plugins.slide.inference=lsh"], workload="xc")
    (job,) = record.jobs
    assert job.status == "done" and job.quality is not None, job.quality_note
    assert job.quality.metric == "p_at_1" and 0.0 <= job.quality.value <= 1.0


def test_plugin_reports_nothing_to_do_on_narrow_outputs(run_tiny) -> None:
    record = run_tiny(PLUGIN, overrides=["run.profile=false"])
    row = next(r for r in record.plugin_rows if r.plugin == "slide")
    assert row.summary.startswith("nothing to do on this workload")


def test_sgd_job_without_slide_lr_is_a_one_line_config_error(run_tiny) -> None:
    with pytest.raises(ConfigError, match=r"plugins\.slide\.lr: job 'xc-20k' uses optimizer 'sgd'"):
        run_tiny(PLUGIN, overrides=[*XC_SMALL, "workload.jobs.0.optimizer=sgd",
                                    "plugins.slide.min_width=1000"], workload="xc")


def test_wide_hidden_layers_stay_dense(run_tiny) -> None:
    """Only the output layer may return deferred logits: a wide hidden Linear is left alone."""
    record = run_tiny(PLUGIN, overrides=["run.profile=false", "plugins.slide.min_width=20"])
    assert all(j.status == "done" for j in record.jobs)
    row = next(r for r in record.plugin_rows if r.plugin == "slide")
    assert "not the output layer" in row.summary and "tiny-mlp:net.1" in row.summary


class _OutputFirst(torch.nn.Module):
    """Registers its output layer before its wide hidden layer."""

    def __init__(self, wide: int = 300) -> None:
        super().__init__()
        self.out = torch.nn.Linear(wide, 5)
        self.inp = torch.nn.Linear(16, wide)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


class _SlicedHead(torch.nn.Module):
    """Returns a slice of its wide output layer's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 300)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))[:, :290]


def _offer(plugin, model: torch.nn.Module) -> None:
    from types import SimpleNamespace

    from accelopt import LayerOffer

    plugin.accelopt_layer_build(LayerOffer(
        job=SimpleNamespace(name="j", kind="train"), path="", index=0, module=model,
        module_type=type(model).__name__, in_features=None, out_features=None))


@pytest.mark.parametrize("model", [_OutputFirst, _SlicedHead])
def test_the_output_layer_is_the_one_the_forward_returns(model: type) -> None:
    """The last module registered was taken for the output layer: a model defining
    ``self.out`` before ``self.inp`` had its wide hidden layer replaced ('inp 5000 outputs
    replaced') and failed on a TypeError about relu on the sampled logits. A head whose
    logits the model slices is not returned unchanged either: it stays dense."""
    from accelopt_plugins.slide.plugin import SlidePlugin

    net = model()
    plugin = SlidePlugin(SlideConfig(min_width=256, lr=1e-2, l=4, bucket_size=16))
    _offer(plugin, net)
    assert not any(isinstance(m, SlideLinear) for m in net.modules())
    (row,) = plugin.accelopt_report_rows(None)
    wide = "inp" if model is _OutputFirst else "out"
    assert f"j:{wide} (300 outputs, not the output layer" in row.summary
    assert net(torch.randn(4, 16)).shape[0] == 4
    if model is _OutputFirst:
        net = _OutputFirst()
        net.out = torch.nn.Linear(300, 400)  # now the output layer is wide
        _offer(plugin, net)
        assert isinstance(net.out, SlideLinear) and isinstance(net.inp, torch.nn.Linear)


def test_indexing_sampled_logits_is_refused_naming_eval_mode() -> None:
    """``self.out(h)[:, :nc]`` raised "'SlideLogits' object is not subscriptable", which the
    run blamed on the model's inputs; it is refused as every other operation is."""
    from accelopt.errors import UserError

    layer = _layer()
    out = layer(torch.randn(4, 16))
    with pytest.raises(TypeError, match=r"slide: indexing .* compute other metrics in eval "
                                        r"mode") as info:
        out[:, :10]
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


@pytest.mark.parametrize(("threshold", "expect_rebuild"), [(0.0, True), (1.0, False)])
def test_change_triggered_rebuild(threshold: float, expect_rebuild: bool) -> None:
    layer = _layer(rebuild="changed", rebuild_period=2, change_threshold=threshold)
    h = torch.randn(8, 16)
    y = torch.randint(300, (8, 2))
    for _ in range(4):
        layer(h).loss_against(y).backward()
    assert layer.stats["checks"] >= 1
    assert (layer.stats["rebuilds"] > 0) == expect_rebuild
    if expect_rebuild:  # Adam moved weights between checks, so every check rebuilt
        assert layer.stats["rebuilds"] == layer.stats["checks"]


# ------------------------------------------------------------------- tied output layer


def _tied_gpt2(**slide):
    """A tiny GPT-2 (tied lm_head) whose output layer the plugin replaced, and the plugin."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from accelopt_plugins.slide.plugin import SlidePlugin

    from accelopt import LayerOffer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=16, bos_token_id=None,
        eos_token_id=None, loss_type="ForCausalLM"))
    plugin = SlidePlugin(SlideConfig(**{"min_width": 256, "k": 4, "l": 8, "bucket_size": 16,
                                        "min_active": 20, "lr": 1e-2, "rebuild_period": 2,
                                        "threads": 1, **slide}))
    job = SimpleNamespace(name="gpt2", kind="train")
    plugin.accelopt_layer_build(LayerOffer(job=job, path="", index=0, module=model,
                                           module_type="GPT2LMHeadModel", in_features=None,
                                           out_features=None))
    return model, plugin


def test_tied_embedding_stays_one_tensor_trained_from_both_sides() -> None:
    """GPT-2's lm_head is its input embedding: the SLIDE layer's weight is that Parameter's
    storage, its sparse Adam moves the sampled rows (in backward), the job's Adam the rows of
    the input tokens (in step), both in the one tensor; every rebuild rehashes all rows."""
    model, plugin = _tied_gpt2()
    layer, wte = model.lm_head, model.transformer.wte.weight
    assert isinstance(layer, SlideLinear) and layer.tied_to == "transformer.wte.weight"
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randint(0, 60, (4, 12), generator=gen)
        before = wte.detach().clone()
        steps_before = layer.steps.clone()
        opt.zero_grad()
        model(x, labels=x).loss.backward()
        after_slide = wte.detach().clone()
        opt.step()
        if i == 0:  # Adam's first step moves exactly the rows with a gradient: the inputs
            # (but those only at the last position, whose output has no target)
            slide_rows = torch.nonzero(layer.steps > steps_before).flatten()
            assert len(slide_rows) > 0
            assert (after_slide[slide_rows] != before[slide_rows]).any(1).all()
            untouched = layer.steps == steps_before
            assert torch.equal(after_slide[untouched], before[untouched])
            job_rows = (wte.detach() != after_slide).any(1)
            moved = set(torch.nonzero(job_rows).flatten().tolist())
            assert set(x[:, :-1].flatten().tolist()) <= moved <= set(x.flatten().tolist())
    assert wte.data_ptr() == layer.weight.data_ptr() and torch.equal(wte, layer.weight)
    # the one rebuild rehashed every row (tied: the job's optimizer moves it outside the
    # layer); the first build is no rebuild and counts nothing
    assert layer.stats["rebuilds"] == 1 and layer.stats["rehashed"] == 300
    (row,) = plugin.accelopt_report_rows(None)
    assert "kept tied to transformer.wte.weight" in row.summary


def test_tied_checkpoint_and_copy_keep_the_tie_and_an_untied_one_is_refused(tmp_path) -> None:
    import copy
    import io

    from accelopt.errors import UserError

    model, _ = _tied_gpt2()
    x = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
    model(x, labels=x).loss.backward()  # SLIDE's rows move: the saved weights are trained
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded, _ = _tied_gpt2()
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    wte = loaded.transformer.wte.weight
    assert wte.data_ptr() == loaded.lm_head.weight.data_ptr()
    assert torch.equal(wte, model.transformer.wte.weight)
    copied = copy.deepcopy(model)  # the memory profile steps a deep copy of the job's model
    assert copied.transformer.wte.weight.data_ptr() == copied.lm_head.weight.data_ptr()
    assert copied.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()
    untied = {k: v.clone() for k, v in model.state_dict().items()}
    untied["lm_head.weight"] += 1.0
    with pytest.raises(UserError, match="lm_head.weight differs from its transformer.wte") as e:
        loaded.load_state_dict(untied)
    assert "\n" not in str(e.value)


def test_a_tie_slide_cannot_share_is_undone_and_the_row_says_why() -> None:
    """A float64 embedding cannot be SLIDE's float32 rows: the layer trains its own copy and
    says so (never silently)."""
    from types import SimpleNamespace

    from accelopt_plugins.slide.plugin import SlidePlugin

    from accelopt import LayerOffer

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(300, 16)
            self.head = torch.nn.Linear(16, 300, bias=False)
            self.head.weight = self.emb.weight

    model = Tied().double()
    plugin = SlidePlugin(SlideConfig(min_width=256, lr=1e-2))
    plugin.accelopt_layer_build(LayerOffer(
        job=SimpleNamespace(name="j", kind="train"), path="", index=0, module=model,
        module_type="Tied", in_features=None, out_features=None))
    assert isinstance(model.head, SlideLinear) and model.head.tied_to is None
    assert model.head.weight.data_ptr() != model.emb.weight.data_ptr()
    (row,) = plugin.accelopt_report_rows(None)
    assert "untied from emb.weight" in row.summary and "float64" in row.summary


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_cluster_modes_are_refused_at_configure(mode: str) -> None:
    """SLIDE's weights are buffers: a parameter server never exchanges them, DDP overwrites
    them from rank 0; either would train wrongly without a word, so both are refused."""
    from accelopt_plugins.slide.plugin import SlidePlugin
    from omegaconf import OmegaConf

    plugin = SlidePlugin(SlideConfig())
    run_config = OmegaConf.create({"cluster": {"mode": mode}, "workload": {"jobs": []}})
    with pytest.raises(ConfigError, match=rf"plugins\.slide: cluster\.mode={mode} .*buffers.*"
                                          r"use cluster\.mode=none") as info:
        plugin.accelopt_configure(SlideConfig(), run_config)
    assert "\n" not in str(info.value)
    plugin.accelopt_configure(SlideConfig(), OmegaConf.create({"cluster": {"mode": "none"}}))


@pytest.mark.parametrize("device,cuda,refused", [
    ("cpu", True, False), ("auto", False, False), ("auto", True, True), ("cuda", False, True),
    ("cuda:1", True, True),
])
def test_a_gpu_run_is_refused_at_configure(monkeypatch, device: str, cuda: bool,
                                           refused: bool) -> None:
    """On a GPU machine ``run.device=auto`` means CUDA, where SLIDE's CPU kernels would fail
    the job after profiling; refused before anything runs, naming the fix."""
    import torch
    from accelopt_plugins.slide.plugin import SlidePlugin
    from omegaconf import OmegaConf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    run_config = OmegaConf.create({"cluster": {"mode": "none"}, "run": {"device": device}})
    plugin = SlidePlugin(SlideConfig())
    if not refused:
        plugin.accelopt_configure(SlideConfig(), run_config)
        return
    with pytest.raises(ConfigError, match=rf"run\.device={device}.*add run\.device=cpu") as info:
        plugin.accelopt_configure(SlideConfig(), run_config)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_slide_in_ps_mode_in_one_line(tmp_path, capsys) -> None:
    """``accelopt run '+plugins=[slide]' cluster.mode=ps``: exit 2, one line, no traceback,
    no run directory (refused at configure, before any rank starts)."""
    from accelopt.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["run", "+plugins=[slide]", "cluster.mode=ps", "run.progress=false",
              f"hydra.run.dir={out}"])
    assert info.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: plugins.slide: cluster.mode=ps")
    assert "use cluster.mode=none" in lines[0] and not out.exists()


# ----------------------------------------------------------------- rebuild (rehash dirty)


@pytest.mark.parametrize("hash_", ["simhash", "dwta"])
def test_neuron_keys_equal_the_query_path(hash_: str) -> None:
    """The rebuild's batched rehash (a GEMM + a packing kernel for SimHash) gives the keys
    the per-vector query path gives (random weights: no projection within rounding of 0)."""
    layer = _layer(hash=hash_, k=5 if hash_ == "simhash" else 2)
    keys = layer._neuron_keys()
    kind, idx, sgn, k, l, bits, rp = layer.family()  # noqa: E741
    ref = make_family(hash_, 16, k, l, seed=0, range_pow=rp,
                      density=layer.cfg.simhash_density).keys_dense(layer.weight.numpy())
    assert np.array_equal(keys, ref)


@pytest.mark.parametrize("rebuild", ["fixed", "changed"])
def test_rebuild_rehashes_only_updated_rows_and_matches_a_full_rebuild(rebuild: str) -> None:
    layer = _layer(rebuild=rebuild, rebuild_period=3, change_threshold=0.0)
    h = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    y = torch.randint(300, (8, 2), generator=torch.Generator().manual_seed(4))
    layer(h).loss_against(y).backward()  # the first build: no rebuild, nothing counted
    assert layer.stats["rehashed"] == 0 and layer.summary()["rehashed_per_rebuild"] == 0.0
    for _ in range(6):  # rebuilds at steps 3 and 6
        layer(h).loss_against(y).backward()
    s = layer.stats
    assert s["rebuilds"] == 2
    assert 0 < s["rehashed"] < 2 * layer.out_features  # not all, each time
    assert layer.summary()["rehashed_per_rebuild"] == s["rehashed"] / 2
    assert layer.keys.stride() == (1, layer.out_features)  # column-major: tables read columns
    layer.rebuild()  # brings the keys up to date with the weights
    assert np.array_equal(layer.keys.numpy(), layer._neuron_keys())
    tables, counts = layer.tables.numpy().copy(), layer.counts.numpy().copy()
    fresh = _layer(rebuild=rebuild)
    fresh.load_state_dict(layer.state_dict())
    fresh.sched[3] = 0  # force a rebuild from scratch: every neuron rehashed
    fresh.sched[2] = layer.sched[2]
    fresh.rebuild()
    assert np.array_equal(fresh.keys.numpy(), layer.keys.numpy())
    assert np.array_equal(fresh.counts.numpy(), counts)
    assert np.array_equal(fresh.tables.numpy(), tables)


def test_benchmark_variants_set_each_methods_own_lr_and_reject_unknown_settings() -> None:
    """benchmarks/slide_common.py: ``name:lr=...`` reaches the optimizer of every method (a
    SLIDE variant's lr was once silently replaced by the run's), and a setting a baseline
    does not take is an error, not ignored."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "slide_common.py"
    spec = importlib.util.spec_from_file_location("slide_common_under_test", path)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)

    def trainer(variant: str):
        name, kw = common.parse_variant(variant)
        return common.make_trainer(name, kw, 50, 4096, 1e-3, common.init_net(50, 4096), 40)

    dense = trainer("dense")
    assert dense.opt.defaults["fused"] is True  # the fair baseline: fused Adam
    assert trainer("slide:lr=0.003").model.out.lr == pytest.approx(3e-3)
    assert trainer("slide").model.out.lr == pytest.approx(1e-3)
    assert trainer("dense-lr3:lr=0.003").opt.param_groups[0]["lr"] == pytest.approx(3e-3)
    assert trainer("sampled:lr=0.003").sparse_opt.param_groups[0]["lr"] == pytest.approx(3e-3)
    from accelopt.errors import UserError

    with pytest.raises(UserError, match="dense takes no setting"):
        trainer("dense:logq=true")
    # a SLIDE variant's settings are checked when the variant is read, before any data: an
    # unknown key, a wrong type, a value out of range (each once a traceback, or a run that
    # trained before failing)
    with pytest.raises(UserError, match="Key 'foo' not in 'SlideConfig'"):
        common.parse_variant("slide:foo=1")
    with pytest.raises(UserError, match="setting k: .*'abc'"):
        common.parse_variant("slide:k=abc")
    with pytest.raises(UserError, match="plugins.slide.k must be >= 1"):
        common.parse_variant("slide:k=0")
    with pytest.raises(UserError, match="expected key=value"):
        common.parse_variant("slide:k")


def test_benchmarks_turn_huge_pages_on_for_every_method_only_when_asked(monkeypatch) -> None:
    """benchmarks/slide_common.py: importing it leaves the environment alone; a benchmark's
    main turns torch's huge pages on unless the user set the variable (e.g. to 0 for a
    comparison), and the machine line says which."""
    import importlib.util
    from pathlib import Path

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "slide_common.py"
    spec = importlib.util.spec_from_file_location("slide_common_env_test", path)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ
    assert "huge pages for torch tensors >= 2 MB off" in common.machine()
    common.use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    assert "huge pages for torch tensors >= 2 MB on" in common.machine()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    common.use_huge_pages()
    assert "huge pages for torch tensors >= 2 MB off" in common.machine()


def test_time_to_target_smoothed_ignores_a_single_lucky_evaluation() -> None:
    """benchmarks/slide_tta.py: the plain time to target is the first evaluation at or above
    it; the smoothed one needs the median of an evaluation and its neighbours there, so one
    noisy evaluation above the target does not count."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "slide_tta.py"
    spec = importlib.util.spec_from_file_location("slide_tta_under_test", path)
    tta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tta)
    p1 = [0.1, 0.5, 0.71, 0.6, 0.65, 0.72, 0.73, 0.70, 0.74]
    curve = [(10.0 * i, 100 * i, p, 0.0) for i, p in enumerate(p1)]
    assert tta.time_to(curve, 0.7) == 20.0
    assert tta.time_to_smoothed(curve, 0.7) == 50.0
    assert tta.time_to_smoothed(curve, 0.75) is None
    assert tta.time_to_smoothed(curve[:2], 0.0) is None  # no evaluation has two neighbours


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_thread_scaling_benchmark_interleaves_the_two_thread_counts() -> None:
    """benchmarks/slide_step.py: one ratio per block pair, and a per-phase breakdown of each
    thread count's timed steps (tiny sizes: this checks the bookkeeping, not the speed)."""
    import importlib.util
    from pathlib import Path

    from accelopt_plugins.slide.xcdata import synthetic

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "slide_step.py"
    spec = importlib.util.spec_from_file_location("slide_step_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ds = synthetic("2k")
    batches = [ds.batch(i, 32) for i in range(4)]
    cfg = SlideConfig(k=4, l=6, bucket_size=16, min_active=60, rebuild_period=3)
    torch_threads = torch.get_num_threads()
    calls: list[int] = []
    set_threads = bench.set_threads

    def recording(n: int) -> None:
        calls.append(n)
        set_threads(n)

    bench.set_threads = recording
    try:
        t1, t2, ratios, phases = bench.thread_scaling(ds.vocab_size, ds.num_classes, batches,
                                                      cfg, 3, 2)
    finally:
        torch.set_num_threads(torch_threads)
    assert len(ratios) == 3 and all(r > 0 for r in ratios) and t1 > 0 and t2 > 0
    # two warm-up blocks, then pairs whose order alternates (neither count always first)
    assert calls[:2] == [1, 2] and calls[2:8] == [1, 2, 2, 1, 1, 2]
    for t in (1, 2):
        assert {"hash", "forward", "backward", "optimizer", "rebuild"} <= set(phases[t])
        assert phases[t]["backward"] > 0


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_row_index_benchmark_times_a_captured_training_batch(monkeypatch, capsys) -> None:
    """benchmarks/slide_row_index.py at 2K labels: the batch it captures is a real training
    batch (active lists, gradients, hidden input of matching shapes) and it reports both parts
    for both thread counts (bookkeeping, not speed)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # main() sets it; undone after
    spec = importlib.util.spec_from_file_location("slide_row_index_under_test",
                                                  bench_dir / "slide_row_index.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch_threads = torch.get_num_threads()
    try:
        ids, n_active, dz, h, w = bench.capture_batch("2k", 3)
        assert ids.shape == dz.shape and h.shape == (128, w.shape[1]) and w.shape[0] == 2000
        assert (n_active > 0).all() and np.isfinite(dz).all()
        monkeypatch.setattr(sys, "argv", ["slide_row_index", "--width", "2k", "--steps", "3",
                                          "--reps", "1"])
        bench.main()
    finally:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    out = capsys.readouterr().out
    assert "2,000 labels" in out and out.count("speed-up") == 2


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_machine_scaling_probe_reports_each_kind_of_work_and_restores_threads() -> None:
    """benchmarks/machine_scaling.py at tiny sizes: one positive median per probe, printed
    by name, and numba's thread count as it was (bookkeeping, not speed)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from machine_scaling import describe, machine_scaling
    finally:
        sys.path.pop(0)
    numba.set_num_threads(1)
    try:
        got = machine_scaling(pairs=2, n=500, updated=100, stream=4096, iters=1000)
        assert numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert list(got) == ["compute", "random rows", "stream"] and all(r > 0 for r in got.values())
    assert "random rows" in describe(got) and describe(got).count("x,") == 2


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [50, 5000])
def test_row_index_is_the_transpose_of_the_active_lists(parts: int, n: int) -> None:
    """index_rows: sorted distinct rows, the slot map, each row's entries in (b, i) order
    and entry counts in ``start``, whatever the number of parts and radix passes (n = 5000:
    two passes, the result in the second buffer pair; n = 50: one pass)."""
    rng = np.random.default_rng(13)
    batch, width = 6, 9
    ids = rng.integers(-1, n, (batch, width)).astype(np.int32)
    ids[2, :4] = ids[1, 5]  # one row several times in a sample and across samples
    counts = rng.integers(0, width + 1, batch).astype(np.int32)
    counts[1:3] = width
    passes, bits = kernels.radix_passes(n)
    assert passes == (1 if n == 50 else 2) and 2**(passes * bits) >= n
    slot, rows = np.full(n, -1, np.int32), np.zeros(n, np.int32)
    start = np.zeros(n + 1, np.int64)
    buffers = [np.zeros(ids.size, np.int32) for _ in range(4)]
    shift = kernels.entry_shift(width)
    k = kernels.index_rows(ids, counts, parts, shift, passes, bits, *buffers, slot, rows, start,
                           True)
    expected: dict[int, list[int]] = {}
    for b in range(batch):
        for i in range(counts[b]):
            if ids[b, i] >= 0:
                expected.setdefault(int(ids[b, i]), []).append(b * width + i)
    assert rows[:k].tolist() == sorted(expected)
    ent = buffers[1 if passes % 2 == 0 else 3]
    got = [[(int(e) >> shift) * width + (int(e) & ((1 << shift) - 1))
            for e in ent[start[r]:start[r + 1]]] for r in range(k)]
    assert got == [expected[j] for j in sorted(expected)]
    assert slot[rows[:k]].tolist() == list(range(k))
    assert (np.delete(slot, rows[:k]) == -1).all()
    g = RowGradients(n, 4, with_bias=False)  # the wrapper: one part per numba thread
    assert g.assign(ids, counts) == k
    assert [g.entries(r).tolist() for r in range(k)] == got
    assert (g.slot == -1).all()  # backward=rows needs no slots
    hog = RowGradients(n, 4, with_bias=False, by_rows=False)
    assert hog.assign(ids, counts) == k and hog.slot[rows[:k]].tolist() == list(range(k))
    hog.release()
    assert (hog.slot == -1).all()


def test_radix_passes_cover_every_key() -> None:
    for n in (1, 2, 3, 2048, 2049, 670_091, 2**31 - 1):
        passes, bits = kernels.radix_passes(n)
        assert bits <= kernels.RADIX_BITS and 2**(passes * bits) >= n
        assert passes == max(1, -(-(max(n, 2) - 1).bit_length() // kernels.RADIX_BITS))
    assert [kernels.entry_shift(w) for w in (1, 2, 3, 4, 5, 1000)] == [1, 1, 2, 2, 3, 10]


def test_row_parallel_gradients_equal_hogwild_and_do_not_depend_on_thread_count() -> None:
    rng = np.random.default_rng(14)
    n, batch, dim, width = 40, 8, 6, 12
    ids = np.stack([rng.choice(n, width, replace=False) for _ in range(batch)]).astype(np.int32)
    counts = rng.integers(1, width + 1, batch).astype(np.int32)
    dz = rng.standard_normal((batch, width)).astype(np.float32)
    h = rng.standard_normal((batch, dim)).astype(np.float32)
    w = rng.standard_normal((n, dim)).astype(np.float32)
    ref = RowGradients(n, dim, with_bias=True, by_rows=False)  # HOGWILD: by slots
    ref.assign(ids, counts)
    dh_ref = np.zeros_like(h)
    kernels.backward_active(h, w, ids, counts, dz, np.float32(0.5), dh_ref, ref.slot, ref.w,
                            ref.b, 1)
    results = []
    for parts in (1, 2, 3):
        g = RowGradients(n, dim, with_bias=True)
        k = g.assign(ids, counts)
        dh_parts = np.zeros((parts, batch, dim), np.float32)
        kernels.accumulate_rows(g.rows, k, g.start, g.ent, g.shift, dz, np.float32(0.5), h, w,
                                dh_parts, g.w, g.b)
        results.append((g.dense(), dh_parts.sum(0)))
        np.testing.assert_allclose(g.dense()[0], ref.dense()[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g.dense()[1], ref.dense()[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dh_parts.sum(0), dh_ref, rtol=1e-5, atol=1e-6)
    for (gw, gb), _ in results[1:]:  # each row summed by one thread in the same order
        assert np.array_equal(gw, results[0][0][0]) and np.array_equal(gb, results[0][0][1])


def test_inference_benchmark_names_its_paths_and_scores_agreement(capsys) -> None:
    """benchmarks/slide_inference.py at tiny sizes: P@k / accuracy@k by hand, and a report
    that names the four timed paths, the FLOP bound and the agreement (bookkeeping, not
    speed)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from slide_inference import Head, hits_at, report
    finally:
        sys.path.pop(0)
    top = torch.tensor([[3, 1, -1], [0, 2, 4]])
    labels = torch.tensor([[1, -1], [5, -1]])
    assert hits_at(top, labels, 1) == (0.0, 0.0)
    assert hits_at(top, labels, 2) == (0.25, 0.5)  # row 0: label 1 in its top 2
    layer = _layer(min_active=0)
    h = torch.randn(16, 16, generator=torch.Generator().manual_seed(9))
    report(Head("tiny", layer, h, torch.randint(300, (16, 1)), "untrained"), [1, 4], 2)
    out = capsys.readouterr().out
    for needle in ("FLOP bound", "N / active", "top-1 same", "acc@5 dense",
                   "| 4 | lsh top-5 (sparse_topk) |", "dense logits (F.linear)",
                   "lsh logits (sparse_logits"):
        assert needle in out, needle
    paired = [ln for ln in out.splitlines() if ln.startswith("| ") and "x (" in ln]
    assert len(paired) == 4  # a paired speed-up for each LSH path at each size


def test_a_layer_no_batch_ran_through_says_so_not_zero_percent_active() -> None:
    """A job that failed before its first batch (a log_softmax after the wide head) used to
    get a row reading '0.00% active per sample, 0 rows updated', as if it had trained."""
    plugin = PLUGIN.instantiate(SlideConfig())
    plugin.layers.append(("xc", "head", _layer()))
    (row,) = plugin.accelopt_report_rows(run=None)
    assert row.summary.startswith("xc:head 300 outputs replaced for LSH-sampled softmax")
    assert row.summary.endswith("but no batch ran through it (the job failed or did not run: "
                                "see its status)")  # no tie to name here
    assert row.metrics == {"samples": 0}


def test_an_adamw_job_trains_its_slide_layer_with_adam_and_the_row_says_so() -> None:
    """workload=lm (AdamW) was listed by `accelopt matrix` and then refused at build time;
    AdamW is Adam's update but for the decoupled decay, which the row names."""
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig, JobConfig

    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [JobConfig(name="lm", optimizer="adamw", lr=6e-4),
                         JobConfig(name="sgd", optimizer="sgd", lr=0.1)]
    plugin = PLUGIN.instantiate(SlideConfig())
    plugin.accelopt_configure(SlideConfig(), cfg)
    assert plugin._lr("lm") == pytest.approx(6e-4)
    plugin.layers.append(("lm", "head", _layer()))
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "job 'lm' uses adamw: its SLIDE layer trains with SLIDE's sparse Adam at the job's " \
           "lr 0.0006, without the decoupled weight decay" in row.summary
    with pytest.raises(ConfigError, match="uses optimizer 'sgd'"):
        plugin._lr("sgd")


# ------------------------------------------------------------- the job's loss and schedule

_OWN_LOSSES = {
    "softmax": lambda o, y: F.nll_loss(torch.log(torch.softmax(o, -1) + 1e-9), y),
    "label_smoothing": lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1),
    "class_weights": lambda o, y: torch.nn.CrossEntropyLoss(weight=torch.ones(300))(o, y),
    "temperature": lambda o, y: F.cross_entropy(o / 2.0, y),
    "argmax": lambda o, y: F.cross_entropy(o, y) + 0 * (o.argmax(-1) == y).float().mean(),
}


@pytest.mark.parametrize("kind", sorted(_OWN_LOSSES))
def test_a_datasets_own_loss_the_sampled_output_cannot_compute_is_refused(kind: str) -> None:
    """The core asked SLIDE's output for its sampled loss (``loss_against``) before the
    dataset's own ``loss_fn``: five different losses (smoothing, class weights, a softmax of
    its own, a temperature) all trained as the same sampled cross-entropy, and the run
    reported success. Now the dataset's loss gets the sampled logits and is refused."""
    from types import SimpleNamespace

    from accelopt.errors import UserError
    from accelopt.job.job import job_loss

    layer = _layer()
    torch.manual_seed(1)
    h, y = torch.randn(6, 16), torch.randint(300, (6,))
    loss = job_loss(SimpleNamespace(loss_fn=_OWN_LOSSES[kind]))
    with pytest.raises(UserError, match=r"^slide: .*plugins\.slide\.min_width") as info:
        loss(layer(h), y)
    assert "\n" not in str(info.value)
    assert layer.stats["steps"] == 0  # nothing trained on a loss it could not compute


def test_plain_cross_entropy_and_the_xc_loss_still_take_the_sampled_softmax() -> None:
    """A dataset loss that is the sampled softmax's own (cross-entropy, or the XC loss that
    says so with ``same_as_loss_against``) keeps SLIDE's sampled path."""
    from types import SimpleNamespace

    from accelopt.job.job import job_loss

    layer = _layer()
    torch.manual_seed(1)
    h, y = torch.randn(6, 16), torch.randint(300, (6,))
    expected = layer(h).loss_against(y)  # no backward: the layer does not step
    for fn in (F.cross_entropy, torch.nn.CrossEntropyLoss(), xc_softmax_loss, None):
        got = job_loss(SimpleNamespace(loss_fn=fn))(layer(h), y)
        torch.testing.assert_close(got, expected)


def _schedule_plugin(**job):
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig, JobConfig

    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [JobConfig(name="lm", optimizer="adam", lr=0.1, **job)]
    plugin = PLUGIN.instantiate(SlideConfig())
    plugin.accelopt_configure(SlideConfig(), cfg)
    layer = _layer()
    layer.lr = plugin._lr("lm")
    plugin.layers.append(("lm", "head", layer))
    return plugin, layer


def _start(plugin, iteration: int) -> None:
    from types import SimpleNamespace

    from accelopt import IterationContext

    plugin.accelopt_iteration_start(IterationContext(
        job=SimpleNamespace(name="lm"), lane="l0", iteration=iteration, now_s=0.0))


def test_the_slide_layer_follows_the_jobs_warmup_and_schedule() -> None:
    """The layer's rate was fixed at build: under a 1000-step warm-up (the other layers'
    rate ~0) the output layer moved as much as at full rate. Its sparse Adam now steps at
    the core's factor of the same iteration; grad_clip, which its rows never get, is said."""
    from accelopt.job.optim import lr_factor

    plugin, layer = _schedule_plugin(iterations=2000, warmup_iterations=1000,
                                     lr_schedule="cosine", grad_clip=1.0)
    _start(plugin, 0)
    assert layer.lr * layer.lr_scale == pytest.approx(0.1 / 1000)
    before = layer.weight.clone()
    torch.manual_seed(2)
    h = torch.randn(8, 16, requires_grad=True)
    layer(h).loss_against(torch.randint(300, (8,))).backward()
    moved = float((layer.weight - before).abs().max())
    assert 0 < moved < 2e-4  # Adam's first step moves a row by about its rate (0.1 at full)
    spec = plugin.schedules["lm"]
    _start(plugin, 1500)
    assert layer.lr_scale == pytest.approx(lr_factor(spec, 1500)) and layer.lr_scale < 1
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "follows the job's lr_schedule=cosine (warmup_iterations=1000)" in row.summary
    assert "grad_clip=1 clips the job's other parameters only" in row.summary


def test_a_constant_rate_job_leaves_the_slide_layer_at_its_rate() -> None:
    plugin, layer = _schedule_plugin(iterations=10)
    _start(plugin, 3)
    assert layer.lr_scale == 1.0 and "lr_schedule" not in str(plugin._step_notes("lm"))


class _WideBoth(torch.nn.Module):
    """A wide hidden layer and a wide output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 300)
        self.out = torch.nn.Linear(300, 400)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def test_an_inference_job_row_counts_the_rows_it_scored() -> None:
    """A kind=infer job ran all its batches, and the row said 'no batch ran through it (the
    job failed or did not run)': only training batches were counted."""
    from types import SimpleNamespace

    from accelopt_plugins.slide.plugin import SlidePlugin

    from accelopt import LayerOffer

    net = _WideBoth()
    plugin = SlidePlugin(SlideConfig(min_width=350, l=4, bucket_size=16))
    plugin.accelopt_layer_build(LayerOffer(
        job=SimpleNamespace(name="j", kind="infer"), path="", index=0, module=net,
        module_type="_WideBoth", in_features=None, out_features=None))
    assert isinstance(net.out, SlideLinear)
    (row,) = plugin.accelopt_report_rows(None)
    assert "no batch ran through it" in row.summary  # before any batch: still said
    net.eval()
    with torch.inference_mode():
        for _ in range(3):
            net(torch.randn(5, 16))
    (row,) = plugin.accelopt_report_rows(None)
    assert row.summary.startswith("j:out 400 outputs, inference job: 15 rows scored with dense")
    assert row.metrics == {"inferred_rows": 15}


def test_wide_layers_left_dense_are_reported_beside_a_replaced_one() -> None:
    """The row named wide hidden layers left dense only when no layer was replaced."""
    from accelopt_plugins.slide.plugin import SlidePlugin

    net = _WideBoth()
    plugin = SlidePlugin(SlideConfig(min_width=256, lr=1e-2, l=4, bucket_size=16))
    _offer(plugin, net)
    assert isinstance(net.out, SlideLinear) and isinstance(net.inp, torch.nn.Linear)
    rows = plugin.accelopt_report_rows(None)
    assert len(rows) == 2 and rows[0].summary.startswith("j:out 400 outputs replaced")
    assert rows[1].summary == ("wide layers left dense: j:inp (300 outputs, not the output "
                               "layer: the model does not return its output unchanged)")


def test_a_max_active_below_min_active_is_refused_naming_both() -> None:
    """max_active=5 with min_active=1000 capped every active set at 5, silently."""
    with pytest.raises(ConfigError, match=r"plugins\.slide\.max_active=5 is below "
                                          r"plugins\.slide\.min_active=1000") as info:
        validate(SlideConfig(max_active=5, min_active=1000))
    assert "\n" not in str(info.value)
    validate(SlideConfig(max_active=0, min_active=1000))  # automatic
    validate(SlideConfig(max_active=50, min_active=1000, topup="batch"))  # shared list apart


def test_a_frozen_layer_is_left_dense_and_the_row_says_why() -> None:
    """SLIDE trains its layers itself (sparse Adam in backward): a head the user froze
    (``requires_grad_(False)``) was swapped in, reported "trained", and changed. A frozen
    output layer, and a frozen sparse input layer, stay dense, named in the row."""
    from types import SimpleNamespace

    from accelopt_plugins.slide.plugin import SlidePlugin
    from accelopt_plugins.slide.xcmodel import SparseInput

    from accelopt import LayerOffer

    net = _WideBoth()
    net.out.requires_grad_(False)
    plugin = SlidePlugin(SlideConfig(min_width=256, lr=1e-2, l=4, bucket_size=16,
                                     sparse_input=True))
    embed = SparseInput(50, 8)
    embed.weight.requires_grad_(False)
    kept = plugin.accelopt_layer_build(LayerOffer(
        job=SimpleNamespace(name="j", kind="train"), path="embed", index=0, module=embed,
        module_type="SparseInput", in_features=None, out_features=None))
    _offer(plugin, net)
    assert kept is None and isinstance(net.out, torch.nn.Linear)
    (row,) = plugin.accelopt_report_rows(None)
    assert "j:out (400 outputs, frozen: weight, bias requires_grad=False" in row.summary
    assert "j:embed (sparse input, frozen: weight requires_grad=False" in row.summary
    assert "no output Linear layer has" not in row.summary


class _WideRows(torch.utils.data.TensorDataset):
    num_classes = 300


def wide_rows(*, seed: int) -> _WideRows:
    """64 rows of 12 features, 300 classes: softmax regression's data."""
    g = torch.Generator().manual_seed(seed)
    return _WideRows(torch.randn(64, 12, generator=g), torch.randint(300, (64,), generator=g))


def softmax_regression(*, input_shape, num_classes) -> torch.nn.Module:
    """One wide Linear: SLIDE's natural case, its only trainable layer."""
    return torch.nn.Linear(input_shape[0], num_classes)


def test_a_model_whose_only_layer_slide_takes_still_trains(run_tiny) -> None:
    """With its one Linear swapped for SLIDE's (buffers trained by its own sparse Adam) the
    model had no parameters left, and the job was refused: "the model has nothing to
    train: it has no parameters", though without slide it trained."""
    record = run_tiny(PLUGIN, workload="single", overrides=[
        "run.profile=false", "workload.jobs.0.model=test_slide:softmax_regression",
        "workload.jobs.0.dataset=test_slide:wide_rows", "workload.jobs.0.optimizer=adam",
        "workload.jobs.0.iterations=2", "workload.jobs.0.batch_size=8",
        "plugins.slide.min_width=256", "plugins.slide.l=4", "plugins.slide.threads=1"])
    (job,) = record.jobs
    assert job.status == "done" and job.iterations_done == 2, job.error
    (row,) = [r for r in record.plugin_rows if r.plugin == "slide"]
    assert row.summary.startswith("mlp:(the model) 300 outputs trained with ")
    assert row.metrics["union_rows_per_batch"] > 0
