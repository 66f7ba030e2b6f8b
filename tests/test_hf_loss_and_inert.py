"""Two things a run's figures read wrongly without:

* gpu_kernels' row for a model it left as it was ("node pruning: no prunable layer", a
  tiled Linear that ran ``F.linear``, channels_last off) carried no ``INERT``, so
  ``run.compare=each`` credited it with the run-to-run noise ("avg JCT 0.263 -> 0.388").
* An HF seq2seq model (T5, BART, ... ``ForConditionalGeneration``) computing its own loss
  averages over its labels that are not -100, but accelopt did not know it, so a cluster
  combined its workers by rows and trained another objective than one process where the
  padding was uneven; and the line saying so reached only the log.

The spawned ranks import this file's model and dataset (``PYTHONPATH``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig
from accelopt_plugins.gpu_kernels.plugin import GpuKernelsPlugin
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accelopt.config import AccelConfig, JobConfig
from accelopt.job import Job
from accelopt.job.job import loss_convention
from accelopt.types import INERT

TESTS = str(Path(__file__).parent)
SEQ, VOCAB, BATCH, ITERATIONS = 8, 40, 8, 2

# --------------------------------------------------------------------------------------------
# gpu_kernels: a row saying nothing changed is inert


def _row(config: GpuKernelsConfig, model: nn.Module, x: torch.Tensor | None = None):
    plugin = GpuKernelsPlugin(config)
    offer = SimpleNamespace(path="", module=model, job=SimpleNamespace(job_id="j"))
    built = plugin.accelopt_layer_build(offer)
    if x is not None:
        built(x)
    (row,) = plugin.accelopt_report_rows(run=None)
    return row


def test_a_model_with_no_prunable_layer_is_an_inert_row() -> None:
    torch.manual_seed(0)
    row = _row(GpuKernelsConfig(prune_amount=0.5), nn.Sequential(nn.Linear(6, 3)))
    assert "no prunable layer" in row.summary
    assert row.metrics["layers_pruned"] == 0 and row.metrics[INERT] == 1


def test_a_pruned_model_is_not_an_inert_row() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    row = _row(GpuKernelsConfig(prune_amount=0.5), model, torch.randn(4, 6))
    assert row.metrics["layers_pruned"] > 0 and INERT not in row.metrics


def test_a_tiled_linear_that_ran_torchs_linear_is_inert_too() -> None:
    """Off the GPU the tiled Linear is exactly ``F.linear``: nothing changed either."""
    torch.manual_seed(0)
    row = _row(GpuKernelsConfig(prune_amount=0.5, tiled_linear="tiled"),
               nn.Sequential(nn.Linear(6, 3)), torch.randn(4, 6))
    assert "ran torch's F.linear" in row.summary and row.metrics[INERT] == 1


# --------------------------------------------------------------------------------------------
# HF seq2seq models: their own loss is a mean over labelled positions


def t5() -> nn.Module:
    """A tiny T5 of random weights, no dropout (one process and the workers draw nothing)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


class Uneven(Dataset):
    """Source rows of SEQ tokens; target labels of 1 to SEQ tokens, -100 after: rows 0-3 of
    every batch (worker 0's half) keep 1 label, rows 4-7 keep up to SEQ."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
        keep = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
        keep[(torch.arange(n) % BATCH) < BATCH // 2] = 1
        labels = torch.randint(2, VOCAB, (n, SEQ), generator=g)
        self.labels = labels.masked_fill(torch.arange(SEQ)[None] >= keep[:, None], -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def uneven(*, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Batches in order (a map-style set's batches are drawn from a permutation)."""
    return (DataLoader(Uneven(BATCH * ITERATIONS, seed), batch_size=BATCH),
            DataLoader(Uneven(BATCH, seed + 1), batch_size=BATCH))


def test_hf_seq2seq_models_average_over_their_labels() -> None:
    pytest.importorskip("transformers")
    from transformers import BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel

    small = dict(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=1, decoder_attention_heads=1, encoder_ffn_dim=8,
                 decoder_ffn_dim=8, max_position_embeddings=SEQ)
    assert loss_convention(t5()) == "labels"
    assert loss_convention(BartForConditionalGeneration(BartConfig(**small))) == "labels"
    marian = MarianConfig(**small, pad_token_id=0, decoder_start_token_id=0)
    assert loss_convention(MarianMTModel(marian)) == "labels"


def test_the_tiny_t5s_own_loss_is_the_mean_over_its_labels() -> None:
    """What ``"labels"`` claims, checked on the model the cluster test trains."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = t5().eval()
    batch = next(iter(uneven()[0]))
    out = model(**batch)
    mean = nn.functional.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten())
    torch.testing.assert_close(out.loss, mean)


@pytest.fixture
def importable(monkeypatch):
    """Let this process and the spawned ranks import this file's model and dataset."""
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(TESTS)


def _cfg(mode: str):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="s2s", model="test_hf_loss_and_inert:t5", dataset="test_hf_loss_and_inert:uneven",
        loss="model", batch_size=BATCH, iterations=ITERATIONS, optimizer="sgd", lr=0.5,
        seed=0))]
    cfg.cluster.mode = mode
    cfg.cluster.workers = 2
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 30
    return cfg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_a_t5_cluster_trains_one_processs_token_mean(tmp_path, importable, mode) -> None:
    pytest.importorskip("transformers")
    from accelopt.drivers.cluster import run_cluster

    cfg = _cfg(mode)
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               cfg.workload.jobs[0]))
    job = Job(spec, job_id="single", device=torch.device("cpu"))
    losses = [job.step().loss for _ in range(ITERATIONS)]
    out = run_cluster(cfg, run_dir=tmp_path)
    (result,) = out.results
    assert all(math.isfinite(loss) for loss in losses)
    assert result.status == "done", result.error
    assert result.losses == pytest.approx(losses, abs=1e-5)
    for name, param in job.model.named_parameters():
        torch.testing.assert_close(out.state[name], param.detach(), atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# a loss of unknown convention: the line is kept, not only logged


class OwnLoss(nn.Module):
    """A model computing its own loss that accelopt knows nothing of."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):  # noqa: ARG002
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def own_loss() -> nn.Module:
    return OwnLoss()


def test_a_loss_of_unknown_convention_combined_by_rows_is_kept_as_the_jobs_warning(
        importable) -> None:
    cfg = _cfg("none")
    cfg.workload.jobs[0].model = "test_hf_loss_and_inert:own_loss"
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               cfg.workload.jobs[0]))
    job = Job(spec, job_id="j", device=torch.device("cpu"))
    assert job.warnings == []
    _x, y = job.dataset.batch(0, BATCH)
    assert job._share_of_loss(y, BATCH // 2, BATCH) is None
    assert job.warnings == []  # only the first worker says it, for all of them
    for _ in range(2):
        assert job._share_of_loss(y, 0, BATCH // 2) is None
    (line,) = job.warnings  # said once
    assert "does not know over what OwnLoss's own loss is a mean" in line
    assert "combined by their rows" in line


HERE = "test_hf_loss_and_inert"


@pytest.mark.timeout(180)
def test_the_unknown_convention_line_is_in_metrics_json(tmp_path, monkeypatch):
    import accelopt

    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(tests)
    job = (f'{{name:s2s,model:"{HERE}:own_loss",dataset:"{HERE}:uneven",loss:model,'
           'iterations:2,batch_size:8}')
    record = accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "cluster.mode=allreduce",
                           "cluster.workers=2", "cluster.timeout_s=30", "run.compare=none",
                           "run.progress=false"], run_dir=tmp_path / "r")
    (result,) = record.jobs
    assert result.status == "done", result.error
    run = json.loads((tmp_path / "r" / "metrics.json").read_text())["run"]
    (line,) = [w for w in run["warnings"] if "own loss is a mean" in w]
    assert "does not know over what OwnLoss's own loss is a mean" in line
