"""Data and models as an outside user brought them, and what a job makes of them: an
``IterableDataset`` with ``__len__``, iterables of samples, models with nothing to train,
non-numeric fields, tensors returned as a dataset, batch-protocol objects without the
optional attributes, batches larger than the data, empty sets, and float settings that
are not numbers. Each is read as documented (``docs/your-model.md``) or refused in one line
naming the problem and the fix, never a traceback or a silently wrong run.

The factories are module level here, referenced as ``test_user_data_errors:<name>``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from accelopt.config import JobConfig
from accelopt.errors import ConfigError
from accelopt.job import Job
from accelopt.job.specs import validate_spec

pytestmark = pytest.mark.timeout(120)
HERE = "test_user_data_errors"
CPU = torch.device("cpu")


def spec(**kw) -> JobConfig:
    base = dict(name="u", model="mlp", batch_size=16, iterations=3, seed=0)
    return JobConfig(**{**base, **kw})


def xy(n: int = 64, dim: int = 8, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randint(classes, (n,), generator=g)


# -- datasets -----------------------------------------------------------------------------


class SizedBatches(IterableDataset):
    """An iterable of batches that also says how many it yields (``__len__``)."""

    def __init__(self, seed: int) -> None:
        self.x, self.y = xy(seed=seed)

    def __iter__(self):
        for lo in range(0, len(self.y), 16):
            yield self.x[lo:lo + 16], self.y[lo:lo + 16]

    def __len__(self) -> int:
        return len(self.y) // 16


def sized_batches(*, seed: int) -> SizedBatches:
    return SizedBatches(seed)


class Samples(SizedBatches):
    """Yields one sample at a time, as a map-style dataset's items are."""

    def __iter__(self):
        for i in range(len(self.y)):
            yield self.x[i], self.y[i]


def samples(*, seed: int) -> Samples:
    return Samples(seed)


def text_rows(*, seed: int) -> list[dict]:
    """HF-datasets style rows with the raw text column left in."""
    x, y = xy(seed=seed)
    tokens = (x.abs() * 4).long()
    return [{"input_ids": tokens[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "label": int(y[i]), "text": "some words"} for i in range(len(y))]


def text_loader(*, seed: int) -> DataLoader:
    return DataLoader(text_rows(seed=seed), batch_size=16)


def str_labels(*, seed: int) -> list[tuple]:
    x, _ = xy(seed=seed)
    return [(x[i], "cat") for i in range(len(x))]


def bool_labels(*, seed: int) -> TensorDataset:
    """A binary task's labels as a mask: ``y > 0``."""
    x, y = xy(seed=seed)
    return TensorDataset(x, y > 0)


def column_labels(*, seed: int) -> TensorDataset:
    """Class indices as a column ``[N, 1]``: a batch's labels are ``[B, 1]``."""
    x, y = xy(seed=seed)
    return TensorDataset(x, y[:, None])


def tensor_pair(*, seed: int):
    return xy(seed=seed)


def rows(*, seed: int, n: int = 64) -> TensorDataset:
    return TensorDataset(*xy(n=n, seed=seed))


def empty_train(*, seed: int) -> TensorDataset:
    x, y = xy(seed=seed)
    return TensorDataset(x[:0], y[:0])


def empty_loader(*, seed: int) -> DataLoader:
    return DataLoader(empty_train(seed=seed), batch_size=16)


def empty_held_out(*, seed: int, loaders: bool = False):
    x, y = xy(seed=seed)
    train, held_out = TensorDataset(x, y), TensorDataset(x[:0], y[:0])
    if loaders:
        return DataLoader(train, batch_size=16), DataLoader(held_out, batch_size=16)
    return train, held_out


def mixed(*, seed: int, loader_train: bool):
    """A training set of one kind and a held-out set of the other."""
    x, y = xy(seed=seed)
    train, held_out = TensorDataset(x, y), TensorDataset(*xy(n=40, seed=seed + 1))
    if loader_train:
        return DataLoader(train, batch_size=16), held_out
    return train, DataLoader(held_out, batch_size=16)


class Proto:
    """The batch protocol's three required attributes only (no ``vocab_size``,
    ``input_kind``, ``n_train``)."""

    input_shape = (8,)
    num_classes = 3

    def __init__(self, held_out: int | None = None) -> None:
        if held_out is not None:  # (and a vocab_size: only the held-out set is tested then)
            self.eval_set = lambda: xy(n=held_out, seed=9)
            self.vocab_size = None

    def batch(self, index: int, batch_size: int):
        return xy(n=batch_size, seed=index)


def proto(*, held_out: int | None = None) -> Proto:
    return Proto(held_out)


# -- models -------------------------------------------------------------------------------


def no_parameters(**_: object) -> nn.Module:
    return nn.Flatten()


def all_frozen(*, input_shape, num_classes) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes)).requires_grad_(False)


def one_linear(*, input_shape, num_classes) -> nn.Module:
    """Two parameter tensors: fewer than three parameter servers."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()),
                                                 num_classes))


# -- tests --------------------------------------------------------------------------------


def test_an_iterable_dataset_with_len_is_read_as_its_batches():
    """torch's Dataset base class has a ``__getitem__`` (raising NotImplementedError), so an
    IterableDataset defining ``__len__`` passed the map-style check and failed at item 0."""
    job = Job(spec(dataset=f"{HERE}:sized_batches"), job_id="sized", device=CPU)
    expected = list(SizedBatches(0))
    for i in (0, 3, 4):  # 4 batches a pass, then the next pass
        x, y = job.dataset.batch(i, 16)
        assert torch.equal(x, expected[i % 4][0]) and torch.equal(y, expected[i % 4][1]), i
    losses = [job.step().loss for _ in range(3)]
    assert all(v == v for v in losses), losses


@pytest.mark.parametrize("options, words", [
    (dict(dataset=f"{HERE}:samples"),
     r"yields single samples .*; an iterable must yield batches: wrap it in "
     r"torch.utils.data.DataLoader\(dataset, batch_size=...\)"),
    (dict(model=f"{HERE}:no_parameters", dataset=f"{HERE}:rows"),
     r"the model has nothing to train: it has no parameters; use kind=infer to only run it"),
    (dict(model=f"{HERE}:all_frozen", dataset=f"{HERE}:rows"),
     r"the model has nothing to train: all 2 of its parameter tensors are frozen "
     r"\(requires_grad=False\); use kind=infer to only run it, or unfreeze"),
    (dict(dataset=f"{HERE}:text_rows", model=f"{HERE}:one_linear"),
     r"item 0: its field 'text' is text \('some words'\), not numbers a model can take; drop "
     r"it \(HF datasets: dataset.remove_columns\(\['text'\]\)\) or convert it to numbers"),
    (dict(dataset=f"{HERE}:text_loader", model=f"{HERE}:one_linear"),
     r"batch 0: its field 'text' is text .* dataset.remove_columns\(\['text'\]\)"),
    (dict(dataset=f"{HERE}:str_labels"),
     r"item 0: its label is text \('cat'\), not a number; labels must be numbers"),
    (dict(dataset=f"{HERE}:bool_labels"),  # used to fail at the first step, in torch's words
     r"labels are torch.bool but cross-entropy needs class indices \(int64\); return "
     r"y.long\(\) \(False/True as classes 0/1\), or give the dataset a loss_fn"),
    (dict(dataset=f"{HERE}:column_labels"),
     r"labels have shape \(16, 1\) but cross-entropy needs one class index per row "
     r"\(shape \(16,\)\); return y.squeeze\(1\), or give the dataset a loss_fn"),
    (dict(dataset=f"{HERE}:tensor_pair"),
     r"returned a pair of tensors \(\(64, 8\), \(64,\)\), which reads as \(train, held_out\) "
     r"datasets; wrap them: return torch.utils.data.TensorDataset\(x, y\)"),
    (dict(dataset=f"{HERE}:rows", dataset_kwargs={"n": 512}, batch_size=4096),
     r"batch_size=4096 is larger than the training set of dataset 'test_user_data_errors:rows' "
     r"\(512 samples\): every batch would repeat each sample ~8 times; set batch_size=512"),
    (dict(dataset=f"{HERE}:rows", dataset_kwargs={"n": 5}),  # smaller than one batch
     r"batch_size=16 is larger than the training set .* \(5 samples\)"),
    (dict(dataset=f"{HERE}:empty_train"), r"its training set is empty \(len 0\)"),
    (dict(dataset=f"{HERE}:empty_loader"),
     r"its training iterable yields no batch \(an empty DataLoader\?\)"),
])
def test_data_and_models_a_training_job_cannot_use_are_one_line(options, words):
    with pytest.raises(ConfigError, match=words) as info:
        Job(spec(**options), job_id="bad", device=CPU)
    assert "\n" not in str(info.value) and str(info.value).startswith("job 'u': ")


def test_a_frozen_model_still_runs_as_an_inference_job_and_may_take_any_batch():
    job = Job(spec(model=f"{HERE}:all_frozen", dataset=f"{HERE}:rows", kind="infer",
                   batch_size=100), job_id="infer", device=CPU)
    assert job.step().samples == 100


def test_a_batch_protocol_object_needs_no_vocab_size_or_input_kind():
    """``vocab_size`` was read unconditionally (AttributeError); the docs call it optional."""
    job = Job(spec(dataset=f"{HERE}:proto"), job_id="proto", device=CPU)
    losses = [job.step().loss for _ in range(3)]
    assert all(v == v for v in losses)


@pytest.mark.parametrize("dataset, kwargs", [
    (f"{HERE}:empty_held_out", {}),
    (f"{HERE}:empty_held_out", {"loaders": True}),
    (f"{HERE}:proto", {"held_out": 0}),  # an eval_set of no rows: scored nan over 0 points
])
def test_an_empty_held_out_set_is_not_scored_and_the_note_says_why(dataset, kwargs):
    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    s = spec(dataset=dataset, dataset_kwargs=kwargs)
    job = Job(s, job_id="held", device=CPU)
    losses = [job.step().loss for _ in range(s.iterations)]
    result = JobResult(job.info, status="done", losses=losses)
    score_result(result, s, job.model, job.dataset)
    assert result.quality is None and result.quality_note == "its held-out set is empty"


@pytest.mark.parametrize("loader_train", [False, True])
def test_a_held_out_set_of_the_other_kind_than_the_training_set_is_scored(loader_train):
    """A DataLoader held out beside a map-style training set was indexed ("'DataLoader'
    object is not subscriptable"); a map-style one beside a DataLoader was read as batches
    (its samples' 0-d labels could not be joined): either way, not scored."""
    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    s = spec(dataset=f"{HERE}:mixed", dataset_kwargs={"loader_train": loader_train})
    job = Job(s, job_id="mixed", device=CPU)
    losses = [job.step().loss for _ in range(s.iterations)]
    result = JobResult(job.info, status="done", losses=losses)
    score_result(result, s, job.model, job.dataset)
    assert result.quality is not None and result.quality.samples == 40, result.quality_note


@pytest.mark.parametrize("key, value", [
    ("lr", float("nan")), ("lr", float("inf")), ("momentum", float("nan")),
    ("momentum", -0.5), ("weight_decay", float("inf")), ("min_lr", float("nan")),
    ("grad_clip", float("nan")), ("grad_clip", float("inf")), ("arrival_s", float("inf")),
    ("arrival_s", float("nan")),
])
def test_float_settings_that_are_not_finite_numbers_are_refused_by_name(key, value):
    """``lr=nan`` was refused as a bad min_lr and ``lr=inf`` trained into nan: nan and inf
    pass comparisons written for numbers."""
    with pytest.raises(ConfigError, match=rf"^job 'u': {key} must be .*, got {value}$"):
        validate_spec(spec(**{key: value}))


def test_lr_nan_names_lr_not_min_lr():
    with pytest.raises(ConfigError, match=r"^job 'u': lr must be a finite number > 0, got nan$"):
        validate_spec(spec(lr=float("nan")))


@pytest.mark.timeout(180)
def test_a_parameter_server_holding_no_tensor_lets_the_run_train(tmp_path, monkeypatch):
    """Three servers for a model of two tensors: the third's shard is empty, and its
    optimizer over no parameters raised "optimizer got an empty parameter list", stopping
    the run."""
    import accelopt

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    job = f'{{name:m,model:"{HERE}:one_linear",dataset:digits,iterations:2,batch_size:16}}'
    record = accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "cluster.mode=ps",
                           "cluster.servers=3", "cluster.timeout_s=30", "run.compare=none",
                           "run.progress=false"], run_dir=tmp_path / "ps3")
    (result,) = record.jobs
    assert result.status == "done", result.error
    assert len(result.losses) == 2 and all(v == v for v in result.losses)
    # it trains, and the run says a server stood idle
    assert record.warnings == ["job 'm': server rank(s) 2 held none of its 2 parameter "
                               "tensors (3 servers): they ran idle; cluster.servers at most "
                               "the model's tensors uses them all"]


def test_a_token_model_on_data_without_a_vocab_size_says_to_give_the_dataset_one():
    """It said "needs vocab_size >= 1; got None: pass it", and there is no job key to pass."""
    from accelopt.workloads.models import build_model

    with pytest.raises(ValueError, match=r"model 'lstm' embeds token ids and needs the "
                       r"dataset's vocab_size \(>= 1\), got None: give the dataset a "
                       r"vocab_size attribute"):
        build_model("lstm", input_shape=(12,), num_classes=3, vocab_size=None)
