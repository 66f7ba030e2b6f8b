"""Bringing a model and data (``docs/your-model.md``): factory keywords, library-style
constructors, map-style torch datasets, tuple / ModelOutput outputs, model-computed losses,
a real transformers model, and one-line errors for data a job cannot train on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from accelopt.config import JobConfig
from accelopt.errors import ConfigError, UserError
from accelopt.job import Job

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


def spec(**kw) -> JobConfig:
    base = dict(name="byo", model="mlp", batch_size=16, iterations=4, seed=0)
    return JobConfig(**{**base, **kw})


def train(job: Job) -> list[float]:
    return [job.step().loss for _ in range(job.info.iterations)]


def test_model_kwargs_reach_the_factory_with_the_standard_keywords_it_names():
    job = Job(spec(model="byo_models:kw_mlp", dataset="digits",
                   model_kwargs={"hidden": 12, "depth": 2}), job_id="kw", device=CPU)
    widths = [m.out_features for m in job.model.modules() if isinstance(m, torch.nn.Linear)]
    assert widths == [12, 12, 10]  # hidden, hidden, the dataset's num_classes
    assert all(v == v for v in train(job))


def test_a_library_style_constructor_gets_only_the_users_keywords():
    # like torchvision.models.resnet18(**kwargs): names none of the standard keywords
    job = Job(spec(model="byo_models:library_style", dataset="synthetic_vectors",
                   model_kwargs={"num_classes": 10, "in_features": 64}), job_id="lib", device=CPU)
    losses = train(job)  # its forward returns (logits, aux): the logits are used
    assert job.model.fc.out_features == 10 and losses[-1] < losses[0]
    assert job.dataset.input_shape == (64,)


def test_a_map_style_torch_dataset_trains_deterministically_and_is_scored():
    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    s = spec(model="mlp", dataset="byo_models:blobs", dataset_kwargs={"n": 128, "dim": 16},
             iterations=20, lr=0.1)
    a, b = Job(s, job_id="a", device=CPU), Job(s, job_id="b", device=CPU)
    xa, ya = a.dataset.batch(3, 16)
    xb, yb = b.dataset.batch(3, 16)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)  # a pure function of (seed, index)
    assert a.dataset.num_classes == 4 and a.dataset.input_shape == (16,)
    train(a)
    result = JobResult(a.info, status="done")
    score_result(result, s, a.model, a.dataset)
    assert result.quality.samples == 64 and result.quality.value > 0.5, result


def test_a_model_that_computes_its_loss_from_labels():
    s = spec(model="byo_models:own_loss", dataset="synthetic_vectors", loss="model")
    job = Job(s, job_id="own", device=CPU)
    x, y = job.dataset.batch(0, s.batch_size)
    expected = job.model(x, labels=y).loss.item()  # label-smoothed: not plain cross-entropy
    assert job.step().loss == pytest.approx(expected)
    plain = Job(spec(model="byo_models:own_loss", dataset="synthetic_vectors"), job_id="plain",
                device=CPU)
    assert plain.step().loss != pytest.approx(expected)  # loss=auto: the logits' CE


def test_a_transformers_encoder_trains_with_its_own_output_and_loss():
    pytest.importorskip("transformers")
    for loss in ("auto", "model"):
        s = spec(model="byo_models:hf_bert", dataset="synthetic_sequences", loss=loss,
                 optimizer="adamw", lr=1e-3, iterations=6, batch_size=8)
        job = Job(s, job_id=f"bert-{loss}", device=CPU)
        losses = train(job)
        assert all(v == v for v in losses) and losses[-1] < losses[0] + 0.5, losses


def test_a_transformers_vit_trains_on_images_and_is_scored():
    pytest.importorskip("transformers")
    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    s = spec(model="byo_models:hf_vit", dataset="synthetic_images", optimizer="adamw",
             lr=1e-3, iterations=5, batch_size=8)
    job = Job(s, job_id="vit", device=CPU)
    losses = train(job)
    assert all(v == v for v in losses)
    result = JobResult(job.info, status="done")
    score_result(result, s, job.model, job.dataset)  # its ImageClassifierOutput's logits
    assert result.quality is not None and 0.0 <= result.quality.value <= 1.0, result


@pytest.mark.parametrize("options, error, words", [
    (dict(dataset="byo_models:misaligned", model="byo_models:kw_mlp"), ConfigError,
     "16 inputs but 15 labels; labels must be row-aligned"),
    (dict(dataset="byo_models:float_labels", model="byo_models:kw_mlp"), ConfigError,
     "class labels must be integers"),
    (dict(model_kwargs={"hidden": 4}), ConfigError, "model_kwargs are for 'module:factory'"),
    (dict(model_kwargs="hidden=4"), ConfigError, "model_kwargs must be a mapping"),
    (dict(model="byo_models:kw_mlp", dataset="digits", model_kwargs={"nope": 1}), ConfigError,
     "cannot be called with"),
    (dict(loss="mine"), ConfigError, "loss must be one of auto, model"),
])
def test_data_and_models_a_job_cannot_use_are_one_line(options, error, words):
    with pytest.raises(error, match=words) as info:
        Job(spec(**options), job_id="bad", device=CPU)
    assert "\n" not in str(info.value) and "job 'byo'" in str(info.value)


def test_loss_model_needs_a_model_that_takes_labels_and_returns_a_loss():
    with pytest.raises(ConfigError, match="takes no labels") as info:
        Job(spec(model="byo_models:kw_mlp", dataset="digits", loss="model"), job_id="nolabels",
            device=CPU)
    assert "\n" not in str(info.value)
    job = Job(spec(model="byo_models:ignores_labels", dataset="synthetic_vectors", loss="model"),
              job_id="noloss", device=CPU)
    with pytest.raises(UserError, match="has no loss tensor") as info:
        job.step()
    assert "\n" not in str(info.value)
