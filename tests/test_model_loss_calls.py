"""A job under ``loss: model`` calls its model as ``model(x, labels=y)``: tictac's trace and
the held-out scoring call it the same way. Both called it without the labels, so an
encoder-decoder (T5, BART: its decoder's inputs are made from the labels) could be trained
but neither traced ("not applied: cannot trace model ... You must specify exactly one of
input_ids or inputs_embeds") nor scored ("cannot score: ValueError: You must specify ...")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")
T5 = transformers.T5ForConditionalGeneration  # its import (seconds) paid once, when collected

TESTS = str(Path(__file__).parent)
HERE = Path(__file__).stem
VOCAB, LENGTH = 32, 6


class NeedsLabels(nn.Module):
    """The simplest model computing its own loss: ``forward(x, labels)``, no default."""

    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x.flatten(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def needs_labels(*, input_shape, num_classes) -> nn.Module:
    return NeedsLabels(input_shape, num_classes)


def tiny_t5() -> nn.Module:
    """An encoder-decoder from a config (no download): one layer each, width 16."""
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    return T5(cfg)


class Reversed(Dataset):
    """HF-style seq2seq rows: the target is the input reversed, its last position -100."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.labels = self.ids.flip(1).clone()
        self.labels[:, -1] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                "labels": self.labels[i]}


def reversed_ids(*, seed: int) -> tuple[Dataset, Dataset]:
    return Reversed(16, seed), Reversed(8, seed + 1)


def _t5_job_entry() -> str:
    return (f"workload.jobs=[{{name: s2s, model: '{HERE}:tiny_t5', dataset: '{HERE}:reversed_ids'"
            ", loss: model, batch_size: 4, iterations: 1}]")


# -- tictac: the call the job makes, traced and timed ---------------------------------------


def test_tictac_order_traces_an_encoder_decoder_with_its_labels(monkeypatch):
    """``accelopt tictac order`` on a T5 under ``loss: model``: traced as the job calls it
    (with ``labels=``), every parameter a recv, its own loss timed in the backward."""
    from accelopt_plugins.tictac.cli import make_plan, parse

    monkeypatch.syspath_prepend(TESTS)
    torch.manual_seed(0)
    plan = make_plan(*parse(["workload=single", _t5_job_entry(), "tictac.oracle_runs=1"]))
    assert plan.traced_by == "torch.export"
    assert len(plan.dag.recvs) == len(list(tiny_t5().parameters()))
    assert plan.compute.backward_s > 0


def test_the_plugin_traces_a_model_that_needs_its_labels_with_them(tmp_path, monkeypatch):
    """``forward(x, labels)``: fx made ``labels`` an input the graph was then run without
    ("does not run on the job's inputs to be timed"), so a server kept the default order.
    Now the graph is of ``model(x, labels=y)``, by fx, and holds the model's loss."""
    from test_tictac_cluster import server_plugin

    monkeypatch.syspath_prepend(TESTS)
    plugin, _records = server_plugin(tmp_path, monkeypatch, job_settings={
        "model": f"{HERE}:needs_labels", "loss": "model", "width": None,
        "dataset": "synthetic_vectors"})
    assert plugin.unplanned == "" and plugin.plan is not None
    assert plugin.plan.traced_by == "torch.fx"
    assert plugin.plan.dag.recv_names == ["fc.weight", "fc.bias"]
    assert any("cross_entropy" in name for name in plugin.plan.dag.names)  # its loss, traced


def test_a_model_given_no_labels_is_traced_as_before():
    """Where the job computes the loss (``loss: auto``), the model is called with its one
    input, and ``forward(x, labels=None)`` is traced with ``labels`` held at None."""
    import sys

    from accelopt_plugins.tictac.dag import trace_inputs

    sys.path.insert(0, TESTS)
    from byo_models import own_loss

    traced = trace_inputs(own_loss(input_shape=(8,), num_classes=3), torch.randn(4, 8))
    assert traced.how == "torch.fx" and len(traced.example) == 1 and traced.prefix == ""
    assert not any("cross_entropy" in str(n.target) for n in traced.gm.graph.nodes)


# -- held-out scoring: the call the job makes, scored from its logits ------------------------


def _scored(spec, job):
    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    result = JobResult(job.info, status="done")
    score_result(result, spec, job.model, job.dataset)
    return result


def test_held_out_scoring_calls_the_model_with_its_labels(monkeypatch):
    """A ``loss: model`` job's model that needs its labels was reported "cannot score:
    TypeError: ... missing 1 required positional argument: 'labels'"; scored now, from its
    output's logits, as top-1 against the held-out labels."""
    from accelopt.config import JobConfig
    from accelopt.job import Job

    monkeypatch.syspath_prepend(TESTS)
    spec = JobConfig(name="q", model=f"{HERE}:needs_labels", dataset="digits", loss="model",
                     batch_size=32, iterations=20, seed=1)
    job = Job(spec, job_id="q", device=torch.device("cpu"))
    for _ in range(spec.iterations):
        job.step()
    result = _scored(spec, job)
    assert result.quality is not None, result.quality_note
    x, y = job.dataset.eval_set()
    with torch.no_grad():
        by_hand = float((job.model(x, labels=y)["logits"].argmax(1) == y).double().mean())
    assert result.quality.metric == "accuracy" and result.quality.samples == len(y)
    assert result.quality.value == pytest.approx(by_hand) and result.quality.value > 0.5


def test_a_model_scored_with_its_labels_scores_as_without_them():
    """Labels that do not change the logits (an HF classifier's, ``OwnLoss``'s) give the
    figure scored without them: only the call changed."""
    import sys

    from accelopt.config import JobConfig
    from accelopt.job import Job
    from accelopt.job.quality import evaluate

    sys.path.insert(0, TESTS)
    spec = JobConfig(name="q", model="byo_models:own_loss", dataset="digits", loss="model",
                     batch_size=32, iterations=3, seed=1)
    job = Job(spec, job_id="q", device=torch.device("cpu"))
    for _ in range(spec.iterations):
        job.step()
    plain = evaluate(job.model, job.dataset)
    given = _scored(spec, job).quality
    assert given is not None and plain is not None
    assert (given.value, given.samples) == (plain.value, plain.samples)


def test_an_encoder_decoder_is_scored_by_its_own_held_out_loss(monkeypatch):
    """T5 under ``loss: model`` runs when called with its labels; its logits are per token
    ``[batch, positions, vocabulary]``, which top-1 does not score. It was reported "cannot
    score: ... not [batch, classes]"; it is scored by its own held-out loss, as perplexity:
    ``exp(model(x, labels=y).loss)`` over its held-out set (one batch)."""
    from accelopt.config import JobConfig
    from accelopt.job import Job

    monkeypatch.syspath_prepend(TESTS)
    spec = JobConfig(name="s2s", model=f"{HERE}:tiny_t5", dataset=f"{HERE}:reversed_ids",
                     loss="model", batch_size=4, iterations=1, seed=0)
    job = Job(spec, job_id="s2s", device=torch.device("cpu"))
    job.step()
    result = _scored(spec, job)
    assert result.quality is not None, result.quality_note
    assert job.model.training  # the job's train mode is restored
    held_out = Reversed(8, 1)
    job.model.eval()
    with torch.no_grad():
        loss = job.model(input_ids=held_out.ids, attention_mask=torch.ones_like(held_out.ids),
                         labels=held_out.labels).loss
    assert result.quality.metric == "perplexity" and result.quality.samples == 8
    assert result.quality.value == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert "own held-out loss" in result.quality_note, result.quality_note


def tiny_gpt2() -> nn.Module:
    """A causal LM from a config (no download): one layer, width 16."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1,
                                  n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def test_a_causal_lm_is_weighted_by_the_positions_it_predicts_across_batches():
    """Over several held-out batches the per-batch mean losses are weighted by the positions
    each is a mean over (a causal LM predicts all but each row's first labelled token), so
    the figure is the loss over the whole held-out set, not a mean of batch means."""
    from accelopt.job.quality import own_loss_perplexity

    torch.manual_seed(0)
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (6, LENGTH))
    labels = ids.clone()
    labels[:2, 3:] = -100  # the first batch has fewer positions to predict
    batches = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    quality = own_loss_perplexity(model, batches)
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].reshape(-1, VOCAB)
        whole = nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
    assert quality.metric == "perplexity" and quality.samples == 6
    assert quality.value == pytest.approx(math.exp(float(whole)), rel=1e-5)


class OwnTokenLoss(nn.Module):
    """A sequence model of one's own computing its loss (no transformers ``loss_type``):
    cross-entropy over its labels, -100 left out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.out(self.emb(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                      labels.reshape(-1))
        return out


def test_a_model_of_ones_own_is_weighted_by_its_labelled_positions_and_says_so():
    """A model naming no loss convention was weighted by the rows holding a label: with
    batches of unequal labelled positions its perplexity came out a third of the true one.
    It is weighted by the labelled positions, as cross-entropy averages, and the note says
    the convention was not known."""
    from accelopt.job.quality import own_loss_perplexity

    torch.manual_seed(0)
    model = OwnTokenLoss()
    ids = torch.randint(0, VOCAB, (6, LENGTH))
    labels = ids.clone()
    labels[:3, 1:] = -100  # the first batch: one labelled position a row
    quality = own_loss_perplexity(model, [(ids[:3], labels[:3]), (ids[3:], labels[3:])])
    with torch.no_grad():
        whole = model(ids, labels=labels)["loss"]
    assert quality.value == pytest.approx(math.exp(float(whole)), rel=1e-5)
    assert "no loss convention" in quality.note, quality.note
