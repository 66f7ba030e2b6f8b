"""``workload=lm``: a small GPT-2 (transformers config, random weights) on the standard
library's source text, word-level tokens; its held-out perplexity in every run."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from accelopt.workloads.lm import gpt2, stdlib_text

pytestmark = pytest.mark.timeout(180)
SMALL = {"max_files": 40, "vocab": 800, "seq_len": 16, "eval_chunks": 32}


def test_the_corpus_is_real_text_batched_deterministically():
    data = stdlib_text(seed=0, **SMALL)
    again = stdlib_text(seed=0, **SMALL)
    x, y = data.batch(5, 8)
    assert x.shape == (8, 16) and torch.equal(x, y)  # labels are the inputs (shifted by GPT-2)
    assert torch.equal(x, again.batch(5, 8)[0])
    assert not torch.equal(x, stdlib_text(seed=1, **SMALL).batch(5, 8)[0])
    assert 100 < data.vocab_size <= 800 and int(x.max()) < data.vocab_size
    assert (x == 0).float().mean() < 0.5, "mostly known words, not <unk>"
    assert "python" in data.name and "vocab" in data.name


def test_workload_lm_trains_and_reports_held_out_perplexity(run_tiny):
    pytest.importorskip("transformers")
    kwargs = "{" + ", ".join(f"{k}: {v}" for k, v in SMALL.items()) + "}"
    record = run_tiny(workload="lm", overrides=[
        "run.compare=none", "workload.jobs.0.iterations=12", "workload.jobs.0.batch_size=8",
        "workload.jobs.0.warmup_iterations=2", f"workload.jobs.0.dataset_kwargs={kwargs}"])
    (job,) = record.jobs
    assert job.status == "done", job.error
    assert job.quality is not None and job.quality.metric == "perplexity", job.quality_note
    vocab = stdlib_text(seed=0, **SMALL).vocab_size
    assert math.isfinite(job.quality.value) and job.quality.value < vocab  # beats uniform
    assert record.summary["avg_perplexity"] == pytest.approx(job.quality.value)
    assert job.losses[-1] < job.losses[0]


def test_slide_trains_gpt2s_output_layer_through_its_own_causal_lm_loss(run_tiny):
    """HF's loss path (float(), view(-1, V), cross-entropy with ignore_index on the shifted
    labels) runs on SLIDE's sampled output; the tied embedding is reported as kept tied; the
    held-out perplexity is scored with dense logits."""
    pytest.importorskip("transformers")
    kwargs = "{" + ", ".join(f"{k}: {v}" for k, v in SMALL.items()) + "}"
    from accelopt import Registry

    record = run_tiny(Registry.discover().get("slide"), workload="lm", overrides=[
        "run.compare=none", "workload.jobs.0.iterations=6", "workload.jobs.0.batch_size=8",
        "plugins.slide.lr=0.003", "plugins.slide.min_width=256",
        f"workload.jobs.0.dataset_kwargs={kwargs}"])
    (job,) = record.jobs
    assert job.status == "done", job.error
    (row,) = [r for r in record.plugin_rows if r.plugin == "slide"]
    assert "lm_head" in row.summary and "kept tied to transformer.wte.weight" in row.summary
    assert row.metrics["active_fraction"] > 0
    vocab = stdlib_text(seed=0, **SMALL).vocab_size
    assert job.quality.metric == "perplexity" and math.isfinite(job.quality.value)
    assert job.quality.value < 2 * vocab


def test_without_transformers_the_model_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match="pip install transformers") as info:
        gpt2(vocab_size=100, input_shape=(16,))
    assert "\n" not in str(info.value)


def test_the_model_names_its_loss_so_transformers_does_not_warn_on_every_run():
    """transformers 5 looks the loss up by the model's ``loss_type`` attribute (from the class
    name, not the config); unset, each run's first forward logged "loss_type=None ... was
    set in the config but it is unrecognized" before using the same causal-LM loss."""
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import LOSS_MAPPING

    model = gpt2(vocab_size=100, input_shape=(16,))
    assert model.loss_type in LOSS_MAPPING
    assert model.loss_function is LOSS_MAPPING["ForCausalLM"]


def test_bad_sizes_are_one_line():
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        stdlib_text(seed=0, seq_len=1)
