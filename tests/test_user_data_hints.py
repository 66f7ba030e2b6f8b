"""The hints in the one-line refusals of a user's data: each must be one the user can follow
in one go (the largest label, the longest ``seq_len`` that fits), say the reason a library
put on its next line, and leave ``--debug`` the chain that shows where the data raised.

The factories are module level here, referenced as ``test_user_data_hints:<name>``."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

from accelopt import errors
from accelopt.config import JobConfig
from accelopt.errors import ConfigError, error_text, first_line
from accelopt.job import Job
from accelopt.job.quality import EMPTY_HELD_OUT, EmptyHeldOut, evaluate
from accelopt.job.specs import check_datasets
from accelopt.workloads.adapters import check_labels
from accelopt.workloads.lm import _corpus, gpt2, stdlib_text

pytestmark = pytest.mark.timeout(120)
HERE = "test_user_data_hints"
CPU = torch.device("cpu")
LM = "accelopt.workloads.lm:stdlib_text"
FEW = {"max_files": 10, "vocab": 64}
"""The fewest files stdlib_text takes: a held-out text of one file."""


def spec(**kw) -> JobConfig:
    base = dict(name="u", model="mlp", batch_size=4, iterations=2, seed=0)
    return JobConfig(**{**base, **kw})


def training_tokens() -> int:
    """The training text's length in tokens for :data:`FEW`: the longest ``seq_len`` that
    makes one training sequence."""
    return _corpus(FEW["max_files"], FEW["vocab"], 1)[0].numel()  # chunks of one token


# -- factories ----------------------------------------------------------------------------


def raising_factory(*, seed: int):
    raise RuntimeError("the user's factory broke")


class RaisingBatches:
    """The batch protocol, whose batch 0 raises as a broken reader does."""

    input_shape = (4,)
    num_classes = 3

    def batch(self, index: int, batch_size: int):
        raise ZeroDivisionError("no rows to pick from")


def raising_batches(*, seed: int) -> RaisingBatches:
    return RaisingBatches()


# -- 1. the label hint --------------------------------------------------------------------


def test_the_num_classes_hint_is_the_largest_label_plus_one_not_the_first_bad_ones():
    """It said num_classes=8 (the first bad label, 7): followed, the job failed again at 9."""
    y = torch.tensor([0, 2, 7, 1, 9, 3])
    with pytest.raises(ValueError, match=r"label 7 at row 2 is not a class index; the dataset "
                       r"has 3 classes: fix that label, or give the dataset num_classes=10 "):
        check_labels(y, 3, "training set")
    check_labels(y, 10, "training set")  # the hint, followed, passes


# -- 2. and 3. stdlib_text's seq_len ------------------------------------------------------


def test_a_seq_len_leaving_an_empty_held_out_set_is_not_scored_with_the_documented_note():
    """It divided by zero tokens: "cannot score: ZeroDivisionError"."""
    train, held_out = _corpus(FEW["max_files"], FEW["vocab"], 2)[:2]
    seq_len = held_out.numel() + 2  # longer than the held-out text (at most numel + 1)
    if seq_len > train.numel():
        pytest.skip("this Python's first held-out file is longer than its training text")
    data = stdlib_text(seed=0, seq_len=seq_len, **FEW)
    assert data.n_train >= 1
    with pytest.raises(EmptyHeldOut, match=f"^{EMPTY_HELD_OUT}$"):
        evaluate(nn.Identity(), data)


def test_a_seq_len_leaving_no_training_sequence_names_the_longest_that_fits():
    """Batch 0 divided by zero rows (torch's "RuntimeError: ZeroDivisionError")."""
    fits = training_tokens()
    with pytest.raises(ValueError, match=rf"^stdlib_text: seq_len={fits + 1} is longer than "
                       rf"the training text .*; set seq_len={fits} or less"):
        stdlib_text(seed=0, seq_len=fits + 1, **FEW)
    assert stdlib_text(seed=0, seq_len=fits, **FEW).n_train == 1  # the hint, followed


def test_a_cluster_launcher_refuses_that_seq_len_before_any_rank_starts():
    """docs/your-model.md: the launcher refuses any dataset its factory refuses; this one
    was refused only by a rank, reading its batch 0."""
    fits = training_tokens()
    s = spec(dataset=LM, dataset_kwargs={**FEW, "seq_len": fits + 1})
    with pytest.raises(ConfigError, match=rf"job 'u': dataset '{LM}' raised ValueError: "
                       rf"stdlib_text: seq_len={fits + 1} .* set seq_len={fits} or less"):
        check_datasets([s])


@pytest.mark.parametrize("factory, frame", [("raising_factory", "raising_factory"),
                                            ("raising_batches", "batch")])
def test_debug_shows_where_the_users_data_raised_and_the_message_stays_one_line(factory,
                                                                               frame):
    """The job re-raised its refusal ``from None``: "--debug shows where it raised" showed
    only accelopt's own frames."""
    with pytest.raises(ConfigError) as info:
        Job(spec(dataset=f"{HERE}:{factory}"), job_id="debug", device=CPU)
    assert "\n" not in str(info.value)
    shown = "".join(traceback.format_exception(info.value))
    assert f"{__file__}" in shown and f"in {frame}\n" in shown, shown


# -- 4. gpt2 without a vocab_size, and a cut first line -----------------------------------


def test_gpt2_without_a_vocab_size_says_how_to_give_one():
    """transformers said "Validation error for field 'vocab_size':", and no more."""
    with pytest.raises(ValueError, match=r"^gpt2 embeds token ids and needs the vocabulary "
                       r"size, got None: give the dataset a vocab_size attribute .*, or the "
                       r"model vocab_size=N in the job's model_kwargs$"):
        gpt2(vocab_size=None, input_shape=(8,))


class ValidationError(ValueError):
    pass


def test_a_first_line_that_ends_cut_takes_the_lines_that_finish_it():
    exc = ValidationError("Validation error for field 'vocab_size':\n"
                          "    TypeError: Field 'vocab_size' expected int, got NoneType\n"
                          "  (value: None)")
    assert error_text(exc) == ("ValidationError: Validation error for field 'vocab_size': "
                               "TypeError: Field 'vocab_size' expected int, got NoneType")
    assert first_line(ValueError("\n whole line \nnext")) == "whole line"  # as before
    assert first_line(ValueError("")) == ""
    assert errors.one_line(" a\n\n  b \n") == "a b"  # the helper job.py's misfit uses too
