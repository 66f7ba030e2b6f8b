"""``"module:factory"`` references for models and datasets, and dataset/output-provided losses
(the core's extension point for workloads defined outside the zoo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.errors import ConfigError
from accelopt.job import Job, job_loss
from accelopt.workloads import build_dataset, build_model, check_compatible, default_dataset_for
from accelopt.workloads.refs import is_ref, resolve_ref

HERE = "test_workload_refs"
CALLS: list[dict] = []


class HalfLossData:
    """A foreign dataset: zoo-shaped batches, its own loss (half of cross-entropy)."""

    input_kind = "vector"
    num_classes = 3
    vocab_size = None
    input_shape = (4,)
    name = "half"

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1000 + index)
        return torch.randn(batch_size, 4, generator=g), torch.randint(3, (batch_size,), generator=g)

    @staticmethod
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * nn.functional.cross_entropy(out, y)


def half_data(*, seed: int, n_train: int | None) -> HalfLossData:
    CALLS.append({"seed": seed, "n_train": n_train})
    return HalfLossData(seed)


def linear_model(*, input_shape, num_classes, vocab_size, width) -> nn.Module:
    CALLS.append({"input_shape": input_shape, "num_classes": num_classes, "width": width})
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))


NOT_CALLABLE = 3


def test_is_ref() -> None:
    assert is_ref("pkg.mod:factory") and not is_ref("mlp") and not is_ref(None)


@pytest.mark.parametrize(
    ("ref", "fragment"),
    [
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        (f"{HERE}:missing", "has no callable 'missing'"),
        (f"{HERE}:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
        (":f", "must look like 'package.module:factory'"),
        ("a.b:", "must look like"),
    ],
)
def test_bad_reference_is_one_line_error(ref: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        resolve_ref(ref, "model")
    assert "\n" not in str(info.value)


def test_builders_call_factories_with_zoo_arguments() -> None:
    CALLS.clear()
    ds = build_dataset(f"{HERE}:half_data", seed=7, n_train=None)
    model = build_model(f"{HERE}:linear_model", input_shape=(4,), num_classes=3, width=9)
    assert CALLS == [{"seed": 7, "n_train": None},
                     {"input_shape": (4,), "num_classes": 3, "width": 9}]
    assert isinstance(ds, HalfLossData) and isinstance(model, nn.Sequential)
    check_compatible(f"{HERE}:linear_model", ds)  # referenced models are not checked
    with pytest.raises(ValueError, match="set the job's dataset explicitly"):
        default_dataset_for(f"{HERE}:linear_model")


def sized_data(*, seed: int, n_train: int = 24) -> HalfLossData:
    CALLS.append({"seed": seed, "n_train": n_train})
    return HalfLossData(seed)


def test_a_factorys_own_default_is_kept_where_the_core_has_no_value() -> None:
    """n_train=None overrode a factory's own default (n_train=24): its data were built
    from None."""
    CALLS.clear()
    build_dataset(f"{HERE}:sized_data", seed=3, n_train=None)
    build_dataset(f"{HERE}:sized_data", seed=3, n_train=8)
    assert CALLS == [{"seed": 3, "n_train": 24}, {"seed": 3, "n_train": 8}]


def test_zoo_names_unchanged() -> None:
    assert build_dataset("synthetic_vectors", seed=0, n_train=8).n_train == 8
    with pytest.raises(ValueError, match="unknown model"):
        build_model("nope", input_shape=(4,), num_classes=3)


def test_job_uses_reference_and_dataset_loss() -> None:
    spec = JobConfig(name="r", model=f"{HERE}:linear_model", dataset=f"{HERE}:half_data",
                     iterations=2, batch_size=8, seed=3)
    job = Job(spec, job_id="00-r", device=torch.device("cpu"))
    x, y = job.dataset.batch(0, 8)
    expected = 0.5 * nn.functional.cross_entropy(job.model(x), y)
    torch.testing.assert_close(job.loss_fn(job.model(x), y), expected)
    result = job.step()
    assert result.samples == 8
    assert result.loss == pytest.approx(float(expected.detach()), rel=1e-5)


def test_bad_reference_in_job_is_config_error() -> None:
    spec = JobConfig(name="bad", model="mlp", dataset="no_such_module_xyz:data")
    with pytest.raises(ConfigError, match="job 'bad': dataset reference"):
        Job(spec, job_id="00-bad", device=torch.device("cpu"))


def test_output_with_loss_against_computes_its_own_loss() -> None:
    class Own:
        def loss_against(self, y: torch.Tensor) -> torch.Tensor:
            return y.float().sum()

    loss = job_loss(object())
    assert float(loss(Own(), torch.tensor([1, 2]))) == 3.0
    out, y = torch.zeros(2, 3), torch.tensor([0, 1])
    torch.testing.assert_close(loss(out, y), nn.functional.cross_entropy(out, y))


def test_cli_run_with_references(run_tiny) -> None:
    record = run_tiny(overrides=[
        f"workload.jobs.0.model={HERE}:linear_model", f"workload.jobs.0.dataset={HERE}:half_data",
        "workload.jobs.1.iterations=1",
    ])
    assert all(r.status == "done" for r in record.jobs)


@pytest.mark.parametrize(("source", "words"), [
    ("def f(:\n    pass\n", r"importing 'broken_mod' raised .*broken_mod\.py:1: SyntaxError: "),
    ("import math\n\nraise RuntimeError('boom')\n",
     r"importing 'broken_mod' raised RuntimeError: boom at .*broken_mod\.py:3$"),
])
def test_a_module_that_does_not_import_is_one_line_naming_where(tmp_path, monkeypatch, source,
                                                                 words) -> None:
    """Only ImportError was caught: a SyntaxError or an error at the module's top level
    went out as itself (a Hydra traceback from the CLI, exit 1; not a UserError from
    ``accelopt.run``)."""
    import accelopt
    from accelopt.errors import UserError

    (tmp_path / "broken_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=words) as info:
        resolve_ref("broken_mod:make", "model")
    assert "\n" not in str(info.value) and "model reference 'broken_mod:make'" in str(info.value)
    job = '{name:m,model:"broken_mod:make",dataset:digits,iterations:1,batch_size:8}'
    with pytest.raises(UserError, match=words.removesuffix("$")) as info:
        accelopt.run(["workload=tiny", f"workload.jobs=[{job}]", "run.compare=none",
                      "run.progress=false"], run_dir=tmp_path / "run")
    assert "\n" not in str(info.value) and str(info.value).startswith("job 'm': ")


def test_the_cli_refuses_a_module_with_a_syntax_error_with_exit_2(tmp_path) -> None:
    from clirun import accelopt

    (tmp_path / "broken_cli_mod.py").write_text("x = (\n")
    done = accelopt("run", "workload=single", "workload.jobs.0.model=broken_cli_mod:make",
                    "workload.jobs.0.dataset=digits", f"hydra.run.dir={tmp_path / 'run'}",
                    cwd=tmp_path, PYTHONPATH=str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "importing 'broken_cli_mod' raised" in done.stderr and "SyntaxError" in done.stderr
