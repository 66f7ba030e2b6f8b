"""gradcomm's model-wide top-k budget (``topk_scope=model``) where many entries tie with the
model's k-th largest magnitude: the shares add up to k. Counting every entry ``>=`` the k-th
value gave an all-zero bucket (an embedding's unused rows) its whole size, so top-k at
density 0.01 sent 90% of the gradient. In one process, driving the codec directly."""

from __future__ import annotations

import math

import pytest
import torch
from accelopt_plugins.gradcomm.codec import BucketCodec, model_budgets, share_ties

pytestmark = pytest.mark.timeout(60)


def encode_steps(codec: BucketCodec, grads: dict[str, list[torch.Tensor]]) -> list[dict[str, int]]:
    """Encode every bucket at every step, in the dict's order; the entries sent per step."""
    steps = len(next(iter(grads.values())))
    sent = []
    for it in range(steps):
        sent.append({b: codec.encode(b, g[it], iteration=it)[0].numel()
                     for b, g in grads.items()})
    return sent


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_all_zero_bucket_beside_a_nonzero_one_sends_the_density(momentum):
    """``nn.Embedding(400_000, 16)`` with unused rows beside ``Linear(16, nc)``: the
    embedding's gradient is 0, the k-th largest magnitude of the model is 0. Every zero
    counted into the budget (sent 90% at density 0.01); the budgets add up to k."""
    gen = torch.Generator().manual_seed(0)
    sizes = {"head": 170, "emb": 40_000}
    k_model = math.ceil(0.01 * sum(sizes.values()))
    codec = BucketCodec(sparsify="topk", density=0.01, scope="model", momentum=momentum)
    grads = {"head": [torch.randn(170, generator=gen) for _ in range(5)],
             "emb": [torch.zeros(40_000) for _ in range(5)]}
    sent = encode_steps(codec, grads)
    for counts in sent[1:]:  # from the second step on, the model's k is shared
        assert counts["head"] == 170  # every nonzero entry is in the model's top k
        assert sum(counts.values()) == k_model
    assert codec.stats.sent_elements / codec.stats.elements == pytest.approx(0.01, abs=1e-4)


def test_ties_at_the_kth_value_are_shared_so_the_total_is_k():
    """Bucket 'a' holds 100 entries of 1, 'b' 50 of 2 and 50 of 1; density 0.3 gives
    k = 60: the 50 twos, then 10 of the 150 tied ones, 100:50 between a and b (6.67 and
    3.33: a gets the extra one). ``>=`` counted 100 + 100 = 200. Later steps share among
    the candidates each bucket kept (at most k of its own), still k in all."""
    codec = BucketCodec(sparsify="topk", density=0.3, scope="model", error_feedback=False)
    a = torch.ones(100)
    b = torch.cat([torch.full((50,), 2.0), torch.ones(50)])
    sent = encode_steps(codec, {"a": [a, a, a], "b": [b, b, b]})
    assert sent[1] == {"a": 7, "b": 53}
    for counts in sent[1:]:
        assert sum(counts.values()) == 60 and counts["b"] >= 50  # every 2 is in the top k


def test_the_shares_of_tied_entries_are_deterministic():
    """Integer shares from the counts alone: the same for any order the buckets were seen
    in, on every rank and every run, never more than a bucket's tied entries."""
    tied = {"bucket2": 7, "bucket0": 3, "bucket1": 5, "bucket3": 0}
    for slots in range(16):
        share = share_ties(tied, slots)
        assert sum(share.values()) == slots
        assert all(0 <= share[b] <= tied[b] for b in tied)
        assert share == share_ties(dict(reversed(list(tied.items()))), slots)
    assert share_ties({"x": 1, "y": 1}, 1) == {"x": 1, "y": 0}  # equal remainders: by name
    assert share_ties({"x": 0}, 3) == {"x": 0}  # nothing tied (a NaN k-th value)
    cands = {"a": torch.tensor([3.0, 1.0, 1.0, 0.0]), "b": torch.tensor([1.0, 1.0, 0.5])}
    first = model_budgets(cands, 3)
    assert first == model_budgets(dict(reversed(list(cands.items()))), 3)
    assert first == {"a": 2, "b": 1} and sum(first.values()) == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_ties_the_budgets_are_the_counts_at_or_above_the_kth_value(seed):
    """Random gradients (no ties): each bucket's budget is its count of the candidates
    ``>=`` the model's k-th largest, as it always was; the selection is unchanged."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {"b0": 300, "b1": 1700, "b2": 40}
    codec = BucketCodec(sparsify="topk", density=0.02, scope="model", momentum=0.9)
    k_model = math.ceil(0.02 * sum(sizes.values()))
    for it in range(6):
        if it:
            mags = torch.cat(list(codec.candidates.values()))
            kth = torch.topk(mags, min(k_model, mags.numel())).values.min()
            expected = {b: max(1, int((c >= kth).sum())) for b, c in codec.candidates.items()}
        for b, n in sizes.items():
            g = torch.randn(n, generator=gen) * (4.0 if b == "b2" else 1.0)
            idx, _ = codec.encode(b, g, iteration=it)
            if it:
                assert codec.budget == expected
                assert idx.numel() == expected[b]
