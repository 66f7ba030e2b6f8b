"""XC-format data (``accelopt_plugins.slide.xcdata.from_files``) with points that have no
label: a training file where none has one is refused when it is read (it "trained" to
losses of 0.0 on nothing); held-out points without labels are not scored (they counted as
misses), and a held-out set where none has one is not scored, with a note."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelopt_plugins.slide.xcdata import from_files
from accelopt_plugins.slide.xcmodel import xc_model

from accelopt.config import JobConfig
from accelopt.errors import ConfigError
from accelopt.job import Job
from accelopt.job.job import job_info
from accelopt.job.quality import NONE_LABELLED, evaluate, score_result
from accelopt.records import JobResult

FEATURES, LABELS = 6, 4


def xc_file(path: Path, lines: list[str]) -> Path:
    """An XC-format file: header ``N D L``, then ``l1,l2 f:v f:v`` per point."""
    path.write_text(f"{len(lines)} {FEATURES} {LABELS}\n" + "".join(f"{x}\n" for x in lines))
    return path


TRAIN = ["0,1 0:1.0 2:0.5", "2 1:1.0", "3 4:0.7 5:0.2", "1,3 3:1.0"]
UNLABELLED = [" 0:1.0 2:0.5", " 1:1.0", " 4:0.7 5:0.2", " 3:1.0"]
TEST = ["0 0:1.0", " 1:1.0", "2,3 4:1.0", " 3:0.5", "1 2:1.0 5:1.0", "3 5:1.0"]


def test_a_training_file_with_no_labelled_point_is_refused(tmp_path):
    train = xc_file(tmp_path / "train.txt", UNLABELLED)
    test = xc_file(tmp_path / "test.txt", TEST)
    with pytest.raises(ValueError) as err:
        from_files(train, test)
    line = str(err.value)
    assert "\n" not in line and str(train) in line and "'l1,l2 f:v f:v'" in line
    assert "none of its 4 points has a label" in line
    spec = JobConfig(name="xc", model="accelopt_plugins.slide.xcmodel:xc_model",
                     dataset="accelopt_plugins.slide.xcdata:from_files",
                     dataset_kwargs={"train_path": str(train), "test_path": str(test)},
                     batch_size=2, iterations=2)
    with pytest.raises(ConfigError, match="nothing to train on"):
        Job(spec, job_id="xc", device=torch.device("cpu"))


def model_for(data) -> torch.nn.Module:
    torch.manual_seed(0)
    return xc_model(input_shape=data.input_shape, num_classes=data.num_classes,
                    vocab_size=data.vocab_size)


def test_held_out_points_without_labels_are_not_scored(tmp_path):
    data = from_files(xc_file(tmp_path / "train.txt", TRAIN), xc_file(tmp_path / "test.txt", TEST))
    model = model_for(data)
    q = evaluate(model, data)
    x, y = data.eval_set()
    keep = (y >= 0).any(dim=1)
    with torch.no_grad():
        best = model(x[keep]).argmax(1)
    by_hand = (y[keep] == best[:, None]).any(dim=1).double().mean()
    assert q.metric == "p_at_1" and q.samples == 4
    assert q.value == pytest.approx(float(by_hand))


def test_a_held_out_set_with_no_labelled_point_is_not_scored(tmp_path):
    data = from_files(xc_file(tmp_path / "train.txt", TRAIN),
                      xc_file(tmp_path / "test.txt", UNLABELLED))
    spec = JobConfig(name="xc", model="accelopt_plugins.slide.xcmodel:xc_model")
    result = JobResult(job_info(spec, "xc"), status="done")
    score_result(result, spec, model_for(data), data)
    assert result.quality is None and result.quality_note == NONE_LABELLED
