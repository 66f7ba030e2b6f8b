"""Bringing a model and data (``docs/your-model.md``): factory keywords, library-style
constructors, map-style torch datasets, tuple / ModelOutput outputs, model-computed losses,
a real transformers model, and one-line errors for data a job cannot train on."""

from __future__ import annotations

import os
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
     "class labels must be integers .* or give the dataset a loss_fn"),
    (dict(model_kwargs={"hidden": 4}), ConfigError, "model_kwargs are for 'module:factory'"),
    (dict(model="byo_models:sparse_embedding", dataset="synthetic_sequences"), ConfigError,
     "0 is an embedding with sparse=True; sparse gradients are not supported: build it with "
     "sparse=False"),
    (dict(model_kwargs="hidden=4"), ConfigError, "model_kwargs must be a mapping"),
    (dict(model="byo_models:kw_mlp", dataset="digits", model_kwargs={"nope": 1}), ConfigError,
     "cannot be called with"),
    # its own code's TypeError was "cannot be called with input_shape, num_classes: ...;
    # set model_kwargs to what it takes", sending the user to the wrong place
    (dict(model="byo_models:typo_inside", dataset="digits"), ConfigError,
     r"model 'byo_models:typo_inside' raised TypeError: Linear.__init__\(\) got an "
     "unexpected keyword argument 'bais'$"),
    (dict(loss="mine"), ConfigError, "loss must be one of auto, model"),
    (dict(dataset="byo_models:token_dicts", model="byo_models:kw_mlp"), ConfigError,
     r"inputs by name \(input_ids, attention_mask\) but Sequential.forward\(input\) takes no"),
    (dict(dataset="byo_models:pairs_of_inputs", model="byo_models:kw_mlp"), ConfigError,
     r"give 2 positional inputs but Sequential.forward\(input\) takes 1"),
])
def test_data_and_models_a_job_cannot_use_are_one_line(options, error, words):
    with pytest.raises(error, match=words) as info:
        Job(spec(**options), job_id="bad", device=CPU)
    assert "\n" not in str(info.value) and "job 'byo'" in str(info.value)


@pytest.mark.parametrize("dataset", ["byo_models:regression", "byo_models:regression_loader"])
def test_a_datasets_own_loss_fn_is_the_loss_and_admits_float_targets(dataset):
    """A map-style dataset's (or a DataLoader's dataset's) loss_fn was silently dropped by
    the adapter (cross-entropy trained instead), and float targets were refused."""
    from byo_models import Regression

    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    Regression.loss_calls = 0
    s = spec(model="byo_models:kw_mlp", dataset=dataset, iterations=30, lr=0.05)
    job = Job(s, job_id="reg", device=CPU)
    assert job.dataset.num_classes == 1  # the target's width: one output
    losses = train(job)
    assert Regression.loss_calls >= s.iterations and losses[-1] < losses[0] / 2
    result = JobResult(job.info, status="done", losses=losses)
    score_result(result, s, job.model, job.dataset)
    assert result.quality is None and "not class ids" in result.quality_note


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


def test_dict_samples_reach_the_model_as_keyword_arguments():
    """HF-style samples ({input_ids, attention_mask, labels}): the model is called with the
    inputs by name, and the mask really reaches it (the same batch without it scores
    differently)."""
    pytest.importorskip("transformers")
    s = spec(model="byo_models:hf_bert", dataset="byo_models:token_dicts", loss="model",
             optimizer="adamw", lr=1e-3, iterations=3, batch_size=8)
    job = Job(s, job_id="dicts", device=CPU)
    x, y = job.batch(0)
    assert sorted(x) == ["attention_mask", "input_ids"] and x["input_ids"].shape == (8, 12)
    assert job.dataset.input_shape == (12,) and job.dataset.num_classes == 2
    job.model.eval()  # no dropout: the two calls below are comparable
    with torch.no_grad():
        masked = job.model(**x, labels=y).loss.item()
        unmasked = job.model(input_ids=x["input_ids"], labels=y).loss.item()
    assert masked != pytest.approx(unmasked)
    job.model.train()
    state = job.random.state_dict()
    with job.random.active(), torch.no_grad():
        expected = job.model(**x, labels=y).loss.item()  # the step's own dropout masks
    job.random.load_state_dict(state)
    assert job.step().loss == pytest.approx(expected, rel=1e-6)
    assert all(v == v for v in train(job)[:2])


def test_tuple_inputs_are_the_models_positional_arguments_and_are_scored():
    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    s = spec(model="byo_models:two_inputs", dataset="byo_models:pairs_of_inputs", lr=0.1,
             iterations=20)
    job = Job(s, job_id="pairs", device=CPU)
    (features, extra), y = job.batch(0)
    assert features.shape == (16, 8) and extra.shape == (16, 3) and y.shape == (16,)
    losses = train(job)
    assert losses[-1] < losses[0]
    result = JobResult(job.info, status="done")
    score_result(result, s, job.model, job.dataset)  # no held-out set: none, and said so
    assert result.quality is None and result.quality_note


def test_a_dataloader_is_read_in_order_pass_after_pass():
    from byo_models import blobs
    from torch.utils.data import DataLoader

    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    s = spec(model="mlp", dataset="byo_models:loader", dataset_kwargs={"n": 88}, lr=0.1,
             iterations=12)
    job = Job(s, job_id="loader", device=CPU)
    train_set, _ = blobs(seed=0, n=88, dim=16, classes=4)
    expected = list(DataLoader(train_set, batch_size=16, shuffle=False))
    assert len(expected) == 6 and len(expected[-1][1]) == 8  # the short last batch
    for i in (0, 4, 5, 6, 1):  # 5 full batches a pass; the short one is not trained on
        x, y = job.dataset.batch(i, 16)
        assert torch.equal(x, expected[i % 5][0]) and torch.equal(y, expected[i % 5][1]), i
    assert job.dataset.num_classes == 4
    losses = train(job)
    again = Job(s, job_id="loader", device=CPU)
    assert train(again) == losses  # a rebuilt job (a resume, another rank) reads the same
    result = JobResult(job.info, status="done")
    score_result(result, s, job.model, job.dataset)  # the held-out loader, concatenated
    assert result.quality.samples == 44 and result.quality.value > 0.5


@pytest.mark.parametrize("options, words", [
    (dict(dataset="byo_models:loader", batch_size=8),
     "yields batches of 16 rows but the job's batch_size is 8; set batch_size=16"),
    (dict(dataset="byo_models:one_pass"), "one-pass iterator"),
    # each pass a new order, seeded or not: a later pass mixed the batches kept from the
    # previous one with the new order's, and a resumed job read other rows than it had
    (dict(dataset="byo_models:loader", dataset_kwargs={"shuffle": True}),
     "in a different order on each pass .* shuffle=False"),
    (dict(dataset="byo_models:loader", dataset_kwargs={"shuffle": True, "generator_seed": 3}),
     "in a different order on each pass"),
])
def test_iterables_a_job_cannot_read_twice_or_whose_batches_do_not_fit_are_one_line(
        options, words):
    with pytest.raises(ConfigError, match=words) as info:
        Job(spec(**options), job_id="bad", device=CPU)
    assert "\n" not in str(info.value) and "job 'byo'" in str(info.value)


def test_dict_inputs_train_in_an_allreduce_cluster(tmp_path, monkeypatch):
    """Each worker takes its rows of every input tensor; DDP passes the mapping through to
    the model by keyword."""
    pytest.importorskip("transformers")
    import os

    import accelopt

    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = ('{name:bert,model:"byo_models:hf_bert",dataset:"byo_models:token_dicts",'
           'loss:model,optimizer:adamw,lr:0.001,iterations:3,batch_size:8}')
    record = accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "cluster.mode=allreduce",
                           "cluster.workers=2", "run.compare=none", "run.progress=false"],
                          run_dir=tmp_path / "run")
    (result,) = record.jobs
    assert result.status == "done" and len(result.losses) == 3
    assert all(v == v for v in result.losses) and result.quality is not None


def _weights_of(model: str, mode: str, tmp_path: Path, monkeypatch) -> dict:
    import os

    import accelopt

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    job = (f'{{name:m,model:"byo_models:{model}",dataset:digits,optimizer:adamw,'
           'weight_decay:0.5,lr:0.01,iterations:4,batch_size:16}')
    run_dir = tmp_path / mode
    record = accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", f"cluster.mode={mode}",
                           "cluster.timeout_s=30", "run.compare=none", "run.progress=false"],
                          run_dir=run_dir)
    (result,) = record.jobs
    assert result.status == "done", result.error
    (path,) = (run_dir / "weights").glob("*.pt")
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(180)
def test_parameters_without_gradients_stay_put_in_a_parameter_server_run(tmp_path, monkeypatch):
    """A frozen layer crashed a PS worker ("cannot register a hook on a tensor that doesn't
    require gradient"), and a parameter the loss never reached got a zero gradient on the
    server, so AdamW's decay moved it where one process leaves it alone."""
    from byo_models import frozen_and_spare

    torch.manual_seed(0)
    initial = frozen_and_spare(input_shape=(64,), num_classes=10)
    alone = _weights_of("frozen_and_spare", "none", tmp_path, monkeypatch)
    ps = _weights_of("frozen_and_spare", "ps", tmp_path, monkeypatch)
    for name in ("embed.weight", "spare.weight", "spare.bias"):
        assert torch.equal(ps[name], alone[name]), name  # neither moved, in either mode
    assert not torch.equal(ps["head.weight"], alone["embed.weight"][:10, :16])  # trained
    assert initial.spare.weight.shape == ps["spare.weight"].shape


@pytest.mark.timeout(180)
def test_a_tied_weight_trains_and_is_saved_as_one_process_has_it_in_every_mode(
        tmp_path, monkeypatch):
    """A PS run saved the tied weight's other name from a worker's one-step-stale copy
    (``out.weight`` != ``emb.weight`` in the weights, the job scored with it), and a worker
    never waited for a tied weight whose listed owner (``emb``) is never called, so the
    parameter receive wrote into it during forward (a wrong loss, or autograd's in-place
    error)."""
    alone = _weights_of("tied_output", "none", tmp_path, monkeypatch)
    assert torch.equal(alone["out.weight"], alone["emb.weight"])
    for mode in ("ps", "allreduce"):
        weights = _weights_of("tied_output", mode, tmp_path, monkeypatch)
        assert torch.equal(weights["out.weight"], weights["emb.weight"]), mode
        for name, value in alone.items():
            assert torch.allclose(weights[name], value, atol=1e-5), (mode, name)


@pytest.mark.timeout(120)
def test_a_parameter_the_loss_never_reaches_is_one_line_in_allreduce(tmp_path, monkeypatch):
    """DDP never hands over a bucket holding it: the iteration waited for the transport's
    timeout and failed naming a transfer, not the parameter."""
    import os
    import time

    import accelopt
    from accelopt.errors import AccelOptError

    assert _weights_of("frozen", "allreduce", tmp_path, monkeypatch)  # frozen alone: fine
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    job = '{name:m,model:"byo_models:frozen_and_spare",dataset:digits,iterations:3,batch_size:16}'
    start = time.monotonic()
    with pytest.raises(AccelOptError, match=r"spare\.(weight|bias), spare\.(weight|bias) got no gradient in "
                       r"iteration 0 .* freeze them \(requires_grad_\(False\)\) or use "
                       "cluster.mode=ps") as info:
        accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "cluster.mode=allreduce",
                      "cluster.timeout_s=60", "run.compare=none", "run.progress=false"],
                     run_dir=tmp_path / "spare")
    # the job's failure exits as a job's failure does in one process (3), and reads as a
    # user error: the problem first
    assert info.value.exit_code == 3 and time.monotonic() - start < 40
    assert str(info.value).startswith("job 'm': ")


@pytest.mark.timeout(120)
def test_a_workers_first_step_failing_names_the_rows_it_was_given(tmp_path, monkeypatch):
    """Batch 2 over two workers gives each one row, which BatchNorm refuses in training: the
    line said "Expected more than 1 value per channel" and nothing of the split (a one-process
    run's first step names its batch)."""
    import os

    import accelopt
    from accelopt.errors import AccelOptError

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    job = '{name:m,model:"byo_models:batchnorm_mlp",dataset:digits,iterations:3,batch_size:2}'
    with pytest.raises(AccelOptError) as info:
        accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "cluster.mode=allreduce",
                      "cluster.timeout_s=30", "run.compare=none", "run.progress=false"],
                     run_dir=tmp_path / "bn")
    line = str(info.value)
    assert "ValueError: Expected more than 1 value per channel" in line, line
    assert ("; this worker's rows of the batch: inputs (1, 1, 8, 8) float32, labels (1,) "
            "(batch_size 2 over 2 workers; check that the model takes") in line, line
    assert "at iteration 0 of job 'm'" in line and "\n" not in line


def test_the_documented_dataloader_factory_trains_and_is_scored(monkeypatch):
    import types

    from accelopt.job.quality import score_result
    from accelopt.records import JobResult

    doc = (Path(__file__).resolve().parents[1] / "docs" / "your-model.md").read_text()
    code = next(block.split("```", 1)[0] for block in doc.split("```python")[1:]
                if "def loaders" in block)
    module = types.ModuleType("doc_loaders")
    exec(compile(code, "docs/your-model.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "doc_loaders", module)
    s = spec(dataset="doc_loaders:loaders", batch_size=32, iterations=30, lr=0.1)
    job = Job(s, job_id="doc", device=CPU)
    assert job.dataset.input_shape == (20,) and job.dataset.num_classes == 5
    train(job)
    result = JobResult(job.info, status="done")
    score_result(result, s, job.model, job.dataset)
    assert result.quality.samples == 128


def doc_commands(doc: str) -> list[list[str]]:
    """The `accelopt run` commands of the doc's bash blocks, as argument lists."""
    import shlex

    commands = []
    for block in doc.split("```bash")[1:]:
        text = block.split("```", 1)[0].replace("\\\n", " ")
        commands += [shlex.split(line)[2:] for line in text.splitlines()
                     if line.startswith("accelopt run")]
    return commands


def test_the_documented_cli_examples_run_with_the_documented_modules(tmp_path, monkeypatch):
    """mypkg/nets.py and mypkg/data.py as the doc shows them, and its commands' overrides as
    typed (fewer iterations; torchvision is not installed here), run as `accelopt run` runs
    them (``accelopt.run``, in this process: the CLI's parsing is tested elsewhere); the
    model factory in the default parameter-server mode, where every rank imports it."""
    import json

    from clirun import run_in_process

    doc = (Path(__file__).resolve().parents[1] / "docs" / "your-model.md").read_text()
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for module, marker in (("nets", "def make_net"), ("data", "def loaders")):
        code = next(b.split("```", 1)[0] for b in doc.split("```python")[1:] if marker in b)
        (pkg / f"{module}.py").write_text(code)
    commands = [c for c in doc_commands(doc) if "torchvision" not in " ".join(c)]
    assert any("mypkg.nets:make_net" in " ".join(c) for c in commands)
    commands.append(["workload=single", "workload.jobs.0.dataset=mypkg.data:loaders",
                     "workload.jobs.0.batch_size=32", "cluster.mode=none"])
    short = ["run.compare=none", "run.progress=false", "workload.jobs.0.iterations=4"]
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for n, args in enumerate(commands):
        out = tmp_path / f"run{n}"
        run_in_process(*args, *short, run_dir=out)
        (job,) = json.loads((out / "metrics.json").read_text())["jobs"]
        assert job["status"] == "done" and job["quality"] is not None, (args, job)


def test_a_model_output_the_default_loss_cannot_take_is_one_line_with_the_fix():
    """A mapping without logits, or a sequence model's per-token logits, met the default
    cross-entropy as a raw torch error ("argument 'input' must be Tensor, not dict",
    "Expected target size [4, 7], got [4, 5]") naming neither the output nor the fix."""
    from accelopt.errors import UserError
    from accelopt.job.job import job_loss

    loss = job_loss(None)
    y = torch.randint(7, (4,))
    assert loss(torch.randn(4, 7), y).dim() == 0  # logits [batch, classes]: as before
    with pytest.raises(UserError, match=r"the model's output \(a dict with keys scores\) has "
                                        "no logits the default loss can use: return the logits"):
        loss({"scores": torch.randn(4, 7)}, y)
    with pytest.raises(UserError, match=r"cross-entropy of logits \(4, 5, 7\) float32 against "
                                        r"labels \(4, 5\) int64: a sequence model's per-token "
                                        r"logits; let the model compute its loss \(loss=model"):
        loss(torch.randn(4, 5, 7), torch.randint(7, (4, 5)))


def test_a_model_that_does_not_take_the_datasets_batches_says_which_batch(tmp_path, monkeypatch):
    """It failed "while profiling: RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    naming neither the batch nor where to look."""
    import os

    import accelopt

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    job = '{name:m,model:"byo_models:too_wide",dataset:digits,iterations:2,batch_size:8}'
    record = accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "cluster.mode=none",
                           "run.compare=none", "run.progress=false"], run_dir=tmp_path / "run")
    (result,) = record.jobs
    assert result.status == "failed"
    assert result.error.startswith("a step measuring its memory, before training, raised "
                                   "RuntimeError: mat1 and mat2 shapes "), \
        result.error
    assert "its batch: inputs (8, 1, 8, 8) float32, labels (8,) (check that the model " \
        "takes the dataset's inputs: docs/your-model.md)" in result.error

