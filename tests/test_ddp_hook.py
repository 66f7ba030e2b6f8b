"""accelopt's DDP communication hook in a user's own DDP script (two gloo processes): with
no plugin it is DDP's all-reduce, bit for bit, through every bucket layout DDP uses; with
gradcomm's codecs it compresses and still trains the same model."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_pair import two_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accelopt.errors import ConfigError, UserError

ITERATIONS = 4
MOMENTUM = 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 4), nn.Linear(4, 4))
    net[0].weight.requires_grad_(False)  # a frozen parameter: DDP never sees it
    return net


def _train(rank: int, how: str) -> dict[str, object]:
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from accelopt.ddp import comm_hook

    net = _model()
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.004)
    state = None
    if how == "accelopt":
        state, hook = comm_hook(net, bucket_mb=0.004)  # ~4 KB: 3 logical buckets
    elif how == "ddp_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif how not in ("ddp", "ddp_momentum"):
        options = {"fp16": {"dtype": "fp16"},
                   "fp16_plain": {"dtype": "fp16", "error_feedback": False},
                   "topk": {"sparsify": "topk", "density": 0.1},
                   "threshold": {"sparsify": "threshold", "threshold": 0.01},
                   "dgc_dense": {"sparsify": "topk", "density": 1.0, "factor_masking": False,
                                 "optimizer": "sgd", "momentum": MOMENTUM}}[how]
        state, hook = gradcomm_hook(net, bucket_mb=0.004, **options)
    if state is not None:
        ddp.register_comm_hook(state, hook)
    handed, restore = _count_gathers()
    momentum = MOMENTUM if how in ("ddp_momentum", "dgc_dense") else 0.0
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1,
                          momentum=momentum)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(ITERATIONS):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), x[:, :4].argmax(dim=1)).backward()
        opt.step()
    restore()
    out: dict[str, object] = {"params": {n: p.detach().clone() for n, p in net.named_parameters()}}
    out["gathered"] = sum(handed)
    if state is not None:
        out["rows"] = [r.summary for r in state.report()]
        out["metrics"] = [r.metrics for r in state.report()]
        out["payload_bytes"] = state.transport.stats.payload_bytes
        out["buckets"] = sorted({s.name for s in state.transport.spans})
        out["in_place"], out["cut"], out["direct"] = state.in_place, state.cut, state.direct
        out["spans"] = [(s.start_s, s.end_s) for s in state.transport.spans]
        state.close()
    return out


def _count_gathers() -> tuple[list[int], Callable[[], None]]:
    """Count the bytes every ``dist.all_gather`` is handed on this rank (a gathered sparse
    bucket's lengths message and padded buffer): the counts, and what puts the real
    ``all_gather`` back."""
    real = dist.all_gather
    counts: list[int] = []

    def counting(outs, tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts.append(tensor.numel() * tensor.element_size())
        return real(outs, tensor, *args, **kwargs)

    dist.all_gather = counting

    def restore() -> None:
        dist.all_gather = real

    return counts, restore


def _worker(rank: int, init: str, hows: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results = {how: _train(rank, how) for how in hows}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    gc.collect()  # the DDP wrappers, before the group goes (examples/ddp/gradcomm_ddp.py)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(f"file://{out / 'rendezvous'}", ["ddp", "accelopt", "fp16", "topk",
                                                         "threshold",
                                                         "ddp_fp16", "fp16_plain",
                                                         "ddp_momentum", "dgc_dense"],
                            str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.timeout(120)
def test_without_plugins_the_hook_is_ddps_all_reduce_bit_for_bit(runs):
    """Iteration 0 is DDP's single bucket cut into the logical buckets; after that each of
    DDP's rebuilt buckets is a logical bucket and is sent as it is: every layout equals
    DDP's own hook. The logical buckets leave the frozen weight out, as DDP's do: it was
    sent as zeros, 2 KiB more per iteration than DDP (a frozen Linear(256, 256) under a
    trainable head sent 65x DDP's bytes)."""
    for rank in runs:
        for name, value in rank["ddp"]["params"].items():
            assert torch.equal(rank["accelopt"]["params"][name], value), name
    ours = runs[0]["accelopt"]
    assert ours["buckets"] == ["bucket0", "bucket1"]
    assert ours["in_place"] == 2 * (ITERATIONS - 1) and ours["cut"] == 1
    assert ours["payload_bytes"] == ITERATIONS * _trainable_bytes()
    # no transfer hook: every whole bucket started at once, its end timed by its future
    assert ours["direct"] == ours["in_place"]
    assert ours["spans"] and all(0 <= start <= end for start, end in ours["spans"])


def _trainable_bytes() -> int:
    """What DDP's own all-reduce sends per iteration: every gradient of a parameter that
    requires grad, once."""
    return sum(p.numel() * p.element_size() for p in _model().parameters() if p.requires_grad)


@pytest.mark.timeout(120)
def test_a_codec_counts_against_what_ddp_sends_without_the_frozen_weight(runs):
    """gradcomm's fp16 sent the frozen weight's zeros too and called that half of fp32."""
    (metrics,) = runs[0]["fp16"]["metrics"]
    assert metrics["dense_bytes_per_iteration"] == _trainable_bytes()
    assert metrics["wire_bytes_per_iteration"] * 2 == _trainable_bytes()


@pytest.mark.timeout(120)
def test_a_gathered_buckets_bytes_are_what_the_collectives_were_handed(runs):
    """Threshold sparsification's buckets are all-gathered, each rank's buffer padded to the
    longest rank's, after a message of the part lengths: the row counted only the rank's
    own encoded bytes (rank 0 reported 28,945 B/iteration and handed gloo 35,124)."""
    for rank in runs:
        ours = rank["threshold"]
        (metrics,) = ours["metrics"]
        assert ours["gathered"] == ours["payload_bytes"]
        assert metrics["wire_bytes_per_iteration"] == ours["gathered"] // ITERATIONS
        assert metrics["encoded_bytes_per_iteration"] < metrics["wire_bytes_per_iteration"]
    assert runs[0]["ddp"]["gathered"] == 0  # the counter counts gathers only


@pytest.mark.timeout(120)
def test_gradcomm_codecs_compress_and_keep_the_replicas_equal(runs):
    for how in ("fp16", "topk"):
        a, b = runs[0][how]["params"], runs[1][how]["params"]
        assert all(torch.equal(a[n], b[n]) for n in a), f"{how}: replicas differ"
        assert any(not torch.equal(a[n], runs[0]["ddp"]["params"][n]) for n in a), how
    fp16 = runs[0]["fp16"]
    assert fp16["direct"] == 0 and fp16["in_place"] > 0  # a codec sees every bucket
    assert all(torch.allclose(fp16["params"][n], v, atol=1e-3)
               for n, v in runs[0]["ddp"]["params"].items())
    assert "fp16 values" in fp16["rows"][0] and "2.0x fewer bytes" in fp16["rows"][0]
    assert "top-k density 0.1" in runs[0]["topk"]["rows"][0]


@pytest.mark.timeout(120)
def test_dgc_with_the_documented_optimizer_trains_as_momentum_sgd(runs):
    """docs/distributed.md: DGC's momentum correction with SGD built with the same momentum
    (the decoder hands it S_t - m*S_{t-1}); at density 1 without masking that is plain DDP
    with momentum SGD. (The docs used to say momentum=0: training without momentum.)"""
    for rank in runs:
        ours, theirs = rank["dgc_dense"]["params"], rank["ddp_momentum"]["params"]
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(value, rank["ddp"]["params"][name])
                   for name, value in theirs.items())  # momentum did change the training


@pytest.mark.timeout(120)
def test_gradcomm_fp16_without_error_feedback_is_ddps_fp16_hook(runs):
    """The same cast, sum and cast back as DDP's ``fp16_compress_hook``, whether DDP's
    bucket is handed over as decoded or cut into logical buckets. Not bit for bit: gradcomm
    scales by 1/2 before the cast, DDP after it, which rounds differently only where a
    value is subnormal in fp16 (~1e-7 on the weights after 4 steps)."""
    for rank in runs:
        ours, theirs = rank["fp16_plain"]["params"], rank["ddp_fp16"]["params"]
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6)
    assert runs[0]["fp16_plain"]["in_place"] > 0 and runs[0]["fp16_plain"]["cut"] > 0


@pytest.mark.timeout(120)
def test_the_documented_example_runs_and_compresses():
    """Each codec the example offers sends fewer bytes than DDP's all-reduce (its threshold
    of 0.001 sent half the elements, each with its index: more bytes than fp32). One launch
    trains both codecs beside DDP's own all-reduce (``--codec`` takes several)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "ddp" / "gradcomm_ddp.py"
    out = subprocess.run([sys.executable, str(script), "--codec", "topk", "threshold",
                          "--iterations", "3"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("DDP all-reduce: final loss") == 1
    for codec, row in (("topk", "top-k density 0.05"), ("threshold", "threshold 0.01")):
        assert f"gradcomm {codec}: final loss" in out.stdout
        assert f"gradcomm: {row}" in out.stdout
    assert out.stdout.count("x fewer bytes than fp32") == 2


def test_bad_use_is_one_line():
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    from accelopt.ddp import comm_hook

    with pytest.raises(ConfigError, match="unknown option.*desnity"):
        gradcomm_hook(nn.Linear(2, 2), desnity=0.1)
    with pytest.raises(UserError, match="init_process_group"):
        comm_hook(nn.Linear(2, 2))
    # backward failed with torch's long "Could not run 'aten::as_strided' ... SparseCPU"
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    for make in (comm_hook, gradcomm_hook):
        with pytest.raises(UserError, match="embedding '0' was built with sparse=True.*"
                                            "build it with sparse=False") as info:
            make(sparse)
        assert "\n" not in str(info.value)
    sparse[0].requires_grad_(False)  # frozen: no gradient, nothing to carry
    with pytest.raises(UserError, match="init_process_group"):
        comm_hook(sparse)
    # a switch given a number was read as true
    with pytest.raises(ConfigError, match="check_finite is a switch: give True or False, "
                                          "got 2"):
        gradcomm_hook(nn.Linear(2, 2), check_finite=2)
    # each was accepted (an upper-case 'SGD' turned momentum correction off unsaid) or a
    # bare TypeError
    for options, words in [
        ({"sparsify": "topk", "optimizer": "SGD", "momentum": 0.9}, "optimizer must be one of"),
        ({"momentum": 1.5}, r"momentum must be a number in \[0, 1\)"),
        ({"sparsify": "topk", "density": "lots"}, "density: Value 'lots'"),
        ({"bucket_mb": "1"}, "bucket_mb must be a finite number > 0"),
    ]:
        with pytest.raises(UserError, match=words) as info:
            gradcomm_hook(nn.Linear(2, 2), **options)
        assert "\n" not in str(info.value)


def test_a_process_group_that_is_not_one_is_one_line(monkeypatch):
    """``process_group="foo"`` was an AttributeError from inside torch.distributed."""
    import torch.distributed as dist

    from accelopt.ddp import comm_hook

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(UserError, match="process_group='foo' is not a process group") as info:
        comm_hook(nn.Linear(2, 2), process_group="foo")
    assert "\n" not in str(info.value)


def test_a_rank_outside_the_process_group_is_told_so(monkeypatch):
    """On a rank outside ``dist.new_group([0])`` (which gives it ``NON_GROUP_MEMBER``, -100)
    the line was "process_group=-100 is not a process group": what the user passed is one."""
    import torch.distributed as dist

    from accelopt.ddp import comm_hook

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(UserError, match="rank 1 is not a member of process_group") as info:
        comm_hook(nn.Linear(2, 2), process_group=dist.GroupMember.NON_GROUP_MEMBER)
    assert "\n" not in str(info.value) and "-100" not in str(info.value)


@pytest.mark.parametrize("options, words", [
    ({"bucket_mb": float("nan")}, r"bucket_mb must be a finite number > 0 \(MiB per bucket\), "
                                  "got nan"),
    ({"bucket_mb": float("inf")}, "bucket_mb must be a finite number > 0"),  # OverflowError
    ({"bucket_mb": 1e300}, "bucket_mb must be at most 1e"),  # int(1e300 * 2**20) overflows
    ({"momentum": float("nan")}, r"momentum must be a number in \[0, 1\)"),
    ({"sparsify": "topk", "density": float("nan")}, r"density must be in \(0, 1\]"),
    ({"sparsify": "threshold", "threshold": float("inf")},
     r"threshold must be a finite number \(> 0 with sparsify=threshold\), got inf"),
    ({"threshold": float("nan")}, "threshold must be a finite number"),
    ({"timeout_s": float("nan")}, r"timeout_s must be a finite number > 0 \(seconds"),
])
def test_nan_and_inf_are_refused_before_the_ranks_compare_settings(monkeypatch, options, words):
    """``nan != nan``: a nan bucket_mb given to every rank was reported as ranks given
    different settings (the comparison came first), and inf overflowed ``int()``. Every
    numeric option is checked before the ranks' settings are gathered."""
    import accelopt_plugins.gradcomm.ddp as gradcomm_ddp
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(gradcomm_ddp, "_same_on_every_rank",
                        lambda *a: pytest.fail("compared before the values were checked"))
    with pytest.raises(ConfigError, match=words) as info:
        gradcomm_hook(nn.Linear(2, 2), **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("options, words", [
    ({"bucket_mb": float("inf")}, "bucket_mb must be a finite number > 0"),
    ({"timeout_s": float("nan")}, r"timeout_s must be a finite number > 0 \(seconds"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
])
def test_accelopts_hook_refuses_nan_and_inf_in_one_line(options, words):
    """Checked before ``init_process_group`` is asked for: a timeout of nan reached
    ``timedelta`` (ValueError), one of 0 a transport that timed out at once."""
    from accelopt.ddp import comm_hook

    with pytest.raises(ConfigError, match=words) as info:
        comm_hook(nn.Linear(2, 2), **options)
    assert "\n" not in str(info.value)


class _FailedWork:
    """What ``dist.all_reduce(async_op=True)`` returns, for a collective a peer broke."""

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore"))
        return fut


def _bucket(iteration: int = 3):
    from accelopt.drivers.cluster.transport import ALL_RANKS
    from accelopt.types import TransferRecord

    return TransferRecord("j", iteration, 0, ALL_RANKS, "bucket0", 40, 0, "grad")


def _transport(*plugins):
    from accelopt.drivers.cluster.transport import Transport
    from accelopt.host import PluginHost

    return Transport(rank=0, host=PluginHost(list(plugins)), t0_epoch=0.0, process="test",
                     timeout_s=5.0, device=torch.device("cpu"))


def test_a_direct_all_reduce_that_fails_is_the_ranks_one_line_error(monkeypatch):
    """The bucket's future fails (DDP's backward raises it, wrapped by torch) and the
    transport keeps the rank's error, the one the rank raises: named by bucket and
    iteration, in one line. No span is recorded for it."""
    from accelopt.drivers.cluster.transport import ALL_RANKS, CommunicationError

    t = _transport()
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: _FailedWork())
    t.plan(3, ALL_RANKS, [_bucket()])
    fut = t.allreduce_direct(_bucket(), torch.ones(10))
    assert fut is not None
    with pytest.raises(RuntimeError, match="all-reduce of bucket0 at iteration 3"):
        fut.wait()
    assert isinstance(t.failure, CommunicationError)
    assert str(t.failure) == ("rank 0: all-reduce of bucket0 at iteration 3: RuntimeError: "
                              "Connection closed by peer [127.0.0.1]:1234")
    assert not t.spans
    t.wait_started(3)  # the bucket counts as started: no order error at the iteration's end


def test_a_transfer_hook_or_an_order_keeps_buckets_off_the_direct_path(monkeypatch):
    from accelopt.drivers.cluster.transport import ALL_RANKS
    from accelopt.hookspecs import hookimpl
    from accelopt.plugin import PluginSpec

    class Done:
        @hookimpl
        def accelopt_transfer_done(self, record, start_s, end_s):
            pass

    class Order:
        @hookimpl
        def accelopt_transfer_order(self, transfers, destination):
            return [r.tensor for r in transfers]

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("started"))
    for plugin in (Done(), Order()):
        t = _transport((PluginSpec(name="p", factory=lambda c, p=plugin: p), plugin))
        t.plan(3, ALL_RANKS, [_bucket()])
        assert t.allreduce_direct(_bucket(), torch.ones(10)) is None


def _mismatched(rank: int) -> dict[str, str]:
    """Hooks made with another density on each rank, then with a nan on both: each
    refusal's text."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    try:
        gradcomm_hook(_model(), sparsify="topk", density=0.1 if rank == 0 else 0.2)
        message = "accepted"
    except ConfigError as exc:
        message = str(exc)
    try:  # the same nan on every rank: said as what it is, not as a mismatch (nan != nan)
        gradcomm_hook(_model(), bucket_mb=float("nan"))
        nan = "accepted"
    except ConfigError as exc:
        nan = str(exc)
    return {"mismatch": message, "nan": nan}


@pytest.mark.timeout(120)
def test_ranks_given_different_codec_settings_are_one_line_at_once(user_runs):
    """With another density on one rank the all-reduces no longer matched and the script
    waited for the process group's timeout (30 minutes by default), then 'Connection closed'.
    (The ranks' refusals are the last thing :func:`_user_results` does.)"""
    for rank in user_runs:
        assert rank["mismatched"]["mismatch"] == (
            "gradcomm.comm_hook: rank 1 was given other settings than rank 0 (density); every "
            "rank must encode its buckets the same way: pass the same options on every rank")
        assert rank["mismatched"]["nan"] == (
            "bucket_mb must be a finite number > 0 (MiB per bucket), got nan")


RESUME = {"sparsify": "topk", "density": 0.1, "optimizer": "sgd", "momentum": MOMENTUM,
          "bucket_mb": 0.004}


def _resumable(rank: int, batches: list[torch.Tensor], saved: dict | None,
               restore_hook: bool = True) -> dict:
    """DGC top-k with momentum SGD over ``batches``, from ``saved`` (model, optimizer and the
    hook's state) when given; returns the same three at the end."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    net = _model()
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.004)
    state, hook = gradcomm_hook(net, **RESUME)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1,
                          momentum=MOMENTUM)
    if saved is not None:
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if restore_hook:
            state.load_state_dict(saved["hook"])
    for x in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), x[:, :4].argmax(dim=1)).backward()
        opt.step()
    out = {"model": {k: v.clone() for k, v in net.state_dict().items()},
           "optimizer": opt.state_dict(), "hook": state.state_dict()}
    state.close()
    return out


def _misuse(rank: int) -> dict[str, str]:
    """Each misuse's message (one line each)."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    from accelopt.ddp import comm_hook

    out = {}
    net = _model()
    ddp = DistributedDataParallel(net)
    state, hook = gradcomm_hook(_model(), dtype="fp16")  # made for another model
    ddp.register_comm_hook(state, hook)
    try:
        nn.functional.mse_loss(ddp(torch.randn(2, 16)), torch.zeros(2, 4)).backward()
        out["other_model"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - what the user sees
        out["other_model"] = str(exc)
    state.close()
    bare, _ = comm_hook(_model())  # no plugin: cannot take gradcomm's residuals
    try:
        bare.load_state_dict({"iteration": 3, "plugins": {"gradcomm": {}}})
        out["load"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - what the user sees
        out["load"] = str(exc)
    bare.close()
    return out


def _user_results(rank: int, what: str) -> dict:
    """The resume, the misuse and the mismatched settings in one pair of ranks (each makes
    its own DDP models and hooks; the mismatch, refused on both ranks, last): two processes
    to start, not six."""
    gen = torch.Generator().manual_seed(20 + rank)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(4)]
    half = _resumable(rank, batches[:2], None)
    return {"resume": {"whole": _resumable(rank, batches, None),
                       "resumed": _resumable(rank, batches[2:], half),
                       "forgot": _resumable(rank, batches[2:], half, restore_hook=False)},
            "misuse": _misuse(rank), "mismatched": _mismatched(rank)}


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory) -> list[dict]:
    """Each rank's results, read by the three tests that use them."""
    return two_ranks(tmp_path_factory.mktemp("user"), "user", _user_results)


@pytest.mark.timeout(120)
def test_a_resumed_script_with_the_hooks_state_ends_as_the_uninterrupted_one(user_runs):
    """The hook keeps gradcomm's residuals, DGC velocities and last sent sum per rank; a
    user's script had no way to save them, so a resumed DGC run dropped what was held back
    and applied the optimizer's restored momentum on top of the uncancelled sum."""
    for rank in (r["resume"] for r in user_runs):
        whole, resumed = rank["whole"], rank["resumed"]
        for name, value in whole["model"].items():
            assert torch.equal(resumed["model"][name], value), name
        assert resumed["hook"]["iteration"] == whole["hook"]["iteration"] == 3
        assert any(not torch.equal(rank["forgot"]["model"][n], v)
                   for n, v in whole["model"].items())  # the state is what made the difference


@pytest.mark.timeout(120)
def test_a_hook_made_for_another_model_or_plugins_is_one_line(user_runs):
    """A hook made for another model (or registered on a second DDP) said "was the model
    changed after it was wrapped?"; a saved state the hook cannot load is not dropped."""
    for misuse in (r["misuse"] for r in user_runs):
        assert misuse["other_model"] == (
            "DDP holds a parameter that this hook was not made for: pass comm_hook the very "
            "module this DDP wraps (ddp.module), make one (state, hook) per DDP model, and do "
            "not change the model after wrapping it")
        assert misuse["load"].startswith("the saved hook state holds the state of plugin "
                                         "'gradcomm', and this hook has no plugin 'gradcomm'")
        assert "\n" not in misuse["load"]
