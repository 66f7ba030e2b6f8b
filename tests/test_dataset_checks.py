"""A dataset's labels and held-out set are checked when its job is built, in one line naming
the first bad label's row and value and the fix, not found by training: a label -5 (or 7 of
a dataset that says it has 5 classes) trained until a batch held it, then failed in torch's
words ("Target -5 is out of bounds"), in a cluster run after its ranks had started; int32
labels failed the first step ("expected target dtype to be Long"); a held-out set with
other inputs was found after training ("not scored ... mat1 and mat2"), and held-out labels
above the classes were scored. Streamed data (an iterable of batches, a map-style set that
says its classes) is checked batch by batch as it is read.

The factories are module-level: jobs import them by reference (``test_dataset_checks:...``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelopt.config import JobConfig
from accelopt.errors import ConfigError
from accelopt.job import Job
from accelopt.workloads.data import build_dataset

HERE = "test_dataset_checks"
CPU = torch.device("cpu")


def _xy(n: int = 256, features: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, features, generator=g), torch.randint(5, (n,), generator=g)


def net(*, input_shape, num_classes) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(20, num_classes))


def negative():
    x, y = _xy()
    y[3] = -5
    return TensorDataset(x, y)


def ignored():
    x, y = _xy()
    y[3] = -100  # left out of the loss: a class label's one allowed negative
    return TensorDataset(x, y)


class FiveClasses(TensorDataset):
    num_classes = 5


def above_classes():
    x, y = _xy()
    y[5] = 7
    return FiveClasses(x, y)


def int32_labels():
    x, y = _xy()
    return TensorDataset(x, y.int())


class Samples:
    """A map-style dataset that is not a TensorDataset and says its classes: its labels
    are not read up front (they may be behind a transform), so each batch's are checked."""

    classes = ("a", "b", "c", "d", "e")

    def __init__(self) -> None:
        self.x, self.y = _xy()
        self.y[7] = 9

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, j: int):
        return self.x[j], self.y[j]


def samples():
    return Samples()


def streamed_negative():
    x, y = _xy()
    y[100] = -3
    return DataLoader(TensorDataset(x, y), batch_size=32)


def streamed_above():
    x, y = _xy()
    y[100] = 6
    loader = DataLoader(FiveClasses(x, y), batch_size=32)
    return loader


def held_out_wider():
    x, y = _xy()
    hx, hy = _xy(64, features=30)
    return TensorDataset(x, y), TensorDataset(hx, hy)


def held_out_float_labels():
    x, y = _xy()
    hx, hy = _xy(64)
    return TensorDataset(x, y), TensorDataset(hx, hy.float())


def held_out_above():
    x, y = _xy()
    hx, hy = _xy(64)
    hy[10] = 8
    return TensorDataset(x, y), TensorDataset(hx, hy)


def held_out_loader_above():
    x, y = _xy()
    hx, hy = _xy(64)
    hy[40] = 8
    return TensorDataset(x, y), DataLoader(TensorDataset(hx, hy), batch_size=32)


def _spec(dataset: str) -> JobConfig:
    return JobConfig(name="j", model=f"{HERE}:net", dataset=f"{HERE}:{dataset}",
                     iterations=10, batch_size=32)


def _refusal(dataset: str) -> str:
    with pytest.raises(ConfigError) as info:
        Job(_spec(dataset), job_id="00-j", device=CPU)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_a_negative_label_is_refused_when_the_job_is_built():
    said = _refusal("negative")
    assert said.startswith("job 'j': dataset ")
    assert "label -5 at row 3 is not a class index" in said and "-100" in said


def test_a_label_above_the_datasets_own_classes_is_refused_naming_the_fix():
    said = _refusal("above_classes")
    assert "label 7 at row 5 is not a class index; the dataset has 5 classes" in said
    assert "num_classes=8" in said


def test_minus_100_is_accepted_and_int32_labels_train_as_int64():
    assert build_dataset(f"{HERE}:ignored", seed=0).num_classes == 5
    job = Job(_spec("int32_labels"), job_id="00-j", device=CPU)
    assert job.dataset.batch(0, 32)[1].dtype == torch.int64
    assert job.step().samples == 32  # cross-entropy took them (int32 failed here)


def test_a_map_style_set_that_says_its_classes_is_checked_per_batch():
    data = build_dataset(f"{HERE}:samples", seed=0)
    assert data.num_classes == 5  # its labels were not all read up front
    with pytest.raises(ValueError, match=r"training set: label 9 at row 7 is not a class"):
        for i in range(256 // 32):
            data.batch(i, 32)


def test_streamed_labels_are_checked_up_front_or_per_batch():
    said = _refusal("streamed_negative")  # read to count its classes: checked then
    assert "batch 3: label -3 at row 4 is not a class index" in said
    data = build_dataset(f"{HERE}:streamed_above", seed=0)  # says its classes: per batch
    data.batch(0, 32)
    with pytest.raises(ValueError, match=r"batch 3: label 6 at row 4 .* has 5 classes"):
        data.batch(3, 32)


@pytest.mark.parametrize(("dataset", "said"), [
    ("held_out_wider", r"held-out set: its inputs are \(30,\) torch.float32 per sample but the "
                       r"training set's are \(20,\)"),
    ("held_out_float_labels", r"held-out set: item 0: its label is torch.float32; class "
                              r"labels must be integers"),
    ("held_out_above", r"held-out set: label 8 at row 10 is not a class index; the dataset "
                       r"has 5 classes"),
])
def test_a_held_out_set_unlike_the_training_set_is_refused_before_training(dataset, said):
    assert _refusal(dataset)  # one line, a ConfigError naming the job
    with pytest.raises(ValueError, match=said):
        build_dataset(f"{HERE}:{dataset}", seed=0)


def test_streamed_held_out_labels_are_checked_as_they_are_scored():
    data = build_dataset(f"{HERE}:held_out_loader_above", seed=0)
    batches = data.eval_batches()
    next(batches)
    with pytest.raises(ValueError, match=r"held-out batch 1: label 8 at row 8 is not a class"):
        next(batches)


def test_a_cluster_launcher_refuses_bad_labels_before_its_ranks_start():
    """What the launcher calls with the settings' checks: the ranks build the jobs, so a
    dataset refused only there trained (or started every rank) first."""
    from accelopt.job.specs import check_datasets

    with pytest.raises(ConfigError, match=r"^job 'j': dataset .* label -5 at row 3 "):
        check_datasets([_spec("negative")])
    check_datasets([_spec("ignored"), _spec("int32_labels")])


class Unsaid(Samples):
    """Samples without ``classes``: every label is read to count them, and checked then."""

    classes = None  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.y[7], self.y[12] = 4, -2


def unsaid():
    return Unsaid()


def test_a_map_style_set_read_to_count_its_classes_is_checked_when_built():
    with pytest.raises(ValueError, match=r"training set: label -2 at row 12 is not a class"):
        build_dataset(f"{HERE}:unsaid", seed=0)
