"""Real model libraries through the core and each plugin that acts in one process: a BERT
encoder on HF-style dict samples, a ViT on images and GPT-2 on text (``workload=lm``), all
from ``transformers`` configs (random weights, no download). Each run finishes, each plugin
reports a row (what it did, or why it did nothing), the job is scored, and a plugin that
leaves the numerics alone leaves the losses bitwise equal to no plugin."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from accelopt import Registry

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)
LM_DATA = "{max_files: 40, vocab: 800, seq_len: 16, eval_chunks: 32}"
MODELS = {
    "bert": ["workload=tiny", "workload.jobs=[{name:bert,model:'byo_models:hf_bert',"
             "dataset:'byo_models:token_dicts',loss:model,optimizer:adamw,lr:0.001,"
             "iterations:3,batch_size:8}]"],
    "vit": ["workload=tiny", "workload.jobs=[{name:vit,model:'byo_models:hf_vit',"
            "dataset:synthetic_images,optimizer:adamw,lr:0.001,iterations:3,batch_size:8}]"],
    "gpt2": ["workload=lm", "workload.jobs.0.iterations=3", "workload.jobs.0.batch_size=8",
             "workload.jobs.0.warmup_iterations=1", f"workload.jobs.0.dataset_kwargs={LM_DATA}"],
}
PLUGINS = {
    "offload": [],
    "gpu_kernels": ["plugins.gpu_kernels.prune_amount=0.5"],
    "slide": ["plugins.slide.lr=0.003", "plugins.slide.min_width=256"],
    "salus": [],
}
SAME_NUMERICS = {"offload"}
"""Plugins that change no arithmetic of the step (offload moves saved tensors and back)."""
SAME_BUT_THREADS = {"salus"}
"""Plugins that change nothing but the thread count a job's kernels run on (a salus lane):
the same arithmetic in another summation order, equal to float rounding."""


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    import accelopt

    out = {}
    for name, overrides in MODELS.items():
        record = accelopt.run([*overrides, "run.compare=none", "run.progress=false"],
                              run_dir=tmp_path_factory.mktemp(f"{name}-none"))
        (job,) = record.jobs
        assert job.status == "done", (name, job.error)
        out[name] = job
    return out


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_plugin_on_each_real_model_finishes_and_says_what_it_did(
        model, plugin, baselines, tmp_path):
    import accelopt

    record = accelopt.run([*MODELS[model], f"+plugins=[{plugin}]", *PLUGINS[plugin],
                           "run.compare=none", "run.progress=false"],
                          run_dir=tmp_path / "run", registry=Registry.discover())
    (job,) = record.jobs
    assert job.status == "done", job.error
    rows = [r for r in record.plugin_rows if r.plugin == plugin]
    assert rows and all(r.summary for r in rows)
    assert job.quality is not None, job.quality_note
    if plugin in SAME_NUMERICS:
        assert job.losses == baselines[model].losses
        assert job.quality.value == baselines[model].quality.value
    if plugin in SAME_BUT_THREADS:
        assert job.losses == pytest.approx(baselines[model].losses, rel=1e-5)
    if plugin == "slide":
        replaced = "outputs trained with LSH-sampled softmax" in rows[0].summary
        assert replaced == (model == "gpt2"), rows[0].summary  # the only wide output layer


CLUSTER = {
    "gradcomm": ["cluster.mode=allreduce", "cluster.workers=2", "+plugins=[gradcomm]",
                 "plugins.gradcomm.dtype=bf16"],
    "tictac": ["cluster.mode=ps", "cluster.workers=2", "+plugins=[tictac]"],
    "gpu_kernels": ["cluster.mode=ps", "cluster.workers=2", "+plugins=[gpu_kernels]",
                    "plugins.gpu_kernels.prune_amount=0.5"],
}
"""The plugins that act on transfers between ranks, each in the mode it acts in, and
gpu_kernels' build-time pruning, which every rank (the server too) must do alike."""


@pytest.mark.parametrize("plugin", sorted(CLUSTER))
def test_the_transfer_plugins_on_a_real_model_finish_and_say_what_they_did(
        plugin, tmp_path, monkeypatch):
    """BERT on dict samples in a cluster: gradcomm compresses its gradient buckets; tictac
    plans on the graph torch.export reads from the real inputs (torch.fx cannot trace HF
    models) and says so in its row; gpu_kernels prunes its feed-forward blocks and heads at
    build time on the server and both workers alike (a shape that differed between ranks
    would fail the parameter exchange)."""
    import os

    import accelopt

    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    record = accelopt.run([*MODELS["bert"], *CLUSTER[plugin], "run.compare=none",
                           "run.progress=false"], run_dir=tmp_path / "run")
    (job,) = record.jobs
    assert job.status == "done", job.error
    assert job.quality is not None, job.quality_note
    rows = [r.summary for r in record.plugin_rows if r.plugin == plugin]
    assert rows, record.plugin_rows
    if plugin == "tictac":
        assert any("traced by torch.export" in r for r in rows), rows
    elif plugin == "gpu_kernels":  # BERT's feed-forward blocks and heads, on every rank
        assert any("node-pruned" in r for r in rows), rows
    else:
        assert any("bf16" in r for r in rows), rows


def _hf_models():
    """(name, model, the inputs its job's step gives it) for each model of the extra."""
    import torch
    from byo_models import hf_bert, hf_vit

    from accelopt.workloads.lm import gpt2

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (4, 12), generator=g)
    return [
        ("bert", hf_bert(num_classes=2, vocab_size=32, input_shape=(12,)),
         {"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
        ("vit", hf_vit(num_classes=3, input_shape=(3, 16, 16)),
         torch.randn(4, 3, 16, 16, generator=g)),
        ("gpt2", gpt2(vocab_size=32, input_shape=(12,)), ids),
    ]


@pytest.mark.parametrize("index", range(3), ids=["bert", "vit", "gpt2"])
def test_tictac_plans_every_model_of_the_extra(index):
    """torch.fx cannot trace HF models ("co_varnames is too small"); tictac's planner reads
    them through torch.export on the real inputs: every parameter is a recv that an op
    reads (GPT-2's tied embedding once, read by the embedding and the head), and a training
    DAG adds one backward op per forward op."""
    from accelopt_plugins.tictac.plan import plan_measured

    name, model, inputs = _hf_models()[index]
    plan = plan_measured(model, inputs, name=name, kind="train", bytes_per_s=1e6, runs=1)
    assert plan.traced_by == "torch.export"
    assert sorted(plan.dag.recv_names) == sorted(n for n, _ in model.named_parameters())
    users = plan.dag.users()
    assert all(users[r] for r in plan.dag.recvs)
    if name == "gpt2":
        wte = plan.dag.recvs[plan.dag.recv_names.index("transformer.wte.weight")]
        assert len(users[wte]) >= 2  # the input embedding and the tied head
    forward = len(plan.dag.program) // 2
    assert len(plan.dag.backward_of) == forward > 0
    plan.predict(("named", "tac"), samples=1)
    assert set(plan.predicted) == {"named", "tac"}
