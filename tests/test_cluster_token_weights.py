"""A model computing its own loss (``loss: model``) averages over its labelled positions
(labels -100 elsewhere, as HF transformers pad), not over the rows: a cluster of workers,
each training on some rows of the batch, combines their gradients and losses by those
positions, so it trains the same objective as one process and reports the same loss, and a
worker whose rows hold no labelled position (a nan loss of its own) spoils nothing.

The model and the datasets are defined here; the spawned ranks import them from this file
(``PYTHONPATH``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.job import Job

pytestmark = pytest.mark.timeout(180)
TESTS = str(Path(__file__).parent)
SEQ, VOCAB, BATCH, ITERATIONS = 8, 50, 8, 3


def gpt2() -> torch.nn.Module:
    """A one-layer GPT-2 of random weights (no dropout: one process and the workers draw
    no random numbers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None, pad_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


class Padded(Dataset):
    """Rows of 2 to SEQ tokens, padded with 0 (labels -100 there). Rows 4-7 of every second
    batch of 8 (worker 1's half) hold no labelled position at all."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            length = int(torch.randint(2, SEQ + 1, (1,), generator=g))
            ids = torch.zeros(SEQ, dtype=torch.long)
            ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
            mask = (torch.arange(SEQ) < length).long()
            labels = ids.masked_fill(mask == 0, -100)
            if (i // BATCH) % 2 == 1 and i % BATCH >= BATCH // 2:
                labels[:] = -100
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def padded(*, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Batches in order (a map-style set's batches are drawn from a permutation)."""
    return (DataLoader(Padded(BATCH * ITERATIONS, seed), batch_size=BATCH),
            DataLoader(Padded(BATCH, seed + 1), batch_size=BATCH))


def make_cfg(mode: str):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="lm", model="test_cluster_token_weights:gpt2",
        dataset="test_cluster_token_weights:padded", loss="model", batch_size=BATCH,
        iterations=ITERATIONS, optimizer="sgd", lr=0.5, seed=0))]
    cfg.cluster.mode = mode
    cfg.cluster.workers = 2
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 30
    return cfg


def single_process(cfg) -> tuple[Job, list[float]]:
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               cfg.workload.jobs[0]))
    job = Job(spec, job_id="single", device=torch.device("cpu"))
    return job, [job.step().loss for _ in range(ITERATIONS)]


@pytest.fixture
def importable(monkeypatch):
    """Let this process and the spawned ranks import this file's model and datasets."""
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(TESTS)


def test_the_data_pads_the_workers_unevenly():
    """The case the cluster tests below need: in batch 0 the two halves hold different
    numbers of labelled positions (by rows they would weigh alike), in batch 1 worker 1's
    half holds none."""
    train, _ = padded()
    labels = torch.stack([batch["labels"] for batch in train])
    counted = (labels[:, :, 1:] != -100).sum(dim=2)
    halves = counted[:, : BATCH // 2].sum(dim=1), counted[:, BATCH // 2:].sum(dim=1)
    assert halves[0][0] != halves[1][0]
    assert halves[1][1] == 0 and halves[0][1] > 0


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_the_cluster_trains_and_reports_one_processs_token_mean(tmp_path, importable, mode):
    pytest.importorskip("transformers")
    cfg = make_cfg(mode)
    out = run_cluster(cfg, run_dir=tmp_path)
    (result,) = out.results
    job, losses = single_process(cfg)
    assert all(math.isfinite(loss) for loss in losses)
    assert result.status == "done", result.error
    assert result.diverged_at is None, result.losses  # worker 1's nan loss of batch 1 is not
    assert result.losses == pytest.approx(losses, abs=1e-5)  # the batch's
    for name, param in job.model.named_parameters():
        torch.testing.assert_close(out.state[name], param.detach(), atol=1e-5, rtol=1e-4)


def test_the_loss_convention_is_read_from_the_model(importable):
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    from accelopt.job.job import loss_convention

    assert loss_convention(gpt2()) == "causal"
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=SEQ))
    assert loss_convention(bert) == "labels"
    assert loss_convention(torch.nn.Linear(2, 2)) is None


def test_a_worker_splits_the_loss_by_labelled_positions(importable, caplog):
    """A worker's share of the batch's loss from its rows' labelled positions (a causal LM's
    shifted labels); a model of unknown convention keeps the rows' shares and says so once."""
    pytest.importorskip("transformers")
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               make_cfg("ps").workload.jobs[0]))
    job = Job(spec, job_id="j", device=torch.device("cpu"))
    labels = torch.tensor([[1, 2, 3, -100], [4, -100, -100, -100], [-100] * 4, [5, 6, 7, 8]])
    # shifted: row 0 counts 2, row 1 none, row 2 none, row 3 three
    assert job._share_of_loss(labels, 0, 2) == pytest.approx(2 / 5)
    assert job._share_of_loss(labels, 2, 4) == pytest.approx(3 / 5)
    assert job._share_of_loss(labels[:, :1], 0, 2) is None  # nothing labelled: as one process
    assert job._share_of_loss(torch.ones(4, 4, dtype=torch.long), 0, 2) is None  # no padding
    job._convention = None
    with caplog.at_level("WARNING", logger="accelopt.job.job"):
        assert job._share_of_loss(labels, 0, 2) is None
        assert job._share_of_loss(labels, 0, 2) is None
    lines = [r.getMessage() for r in caplog.records if "combined by their rows" in r.getMessage()]
    assert len(lines) == 1 and "GPT2LMHeadModel" in lines[0]
