"""tictac on the parameter-server transport: in-process hook checks (self-limiting, stale
priority lists, a transfer that never comes) and real cluster runs (orders enforced with no
inversion; numerics bitwise equal with and without the plugin)."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from accelopt_plugins.tictac import PLUGIN
from accelopt_plugins.tictac.config import TictacConfig
from accelopt_plugins.tictac.plugin import TictacPlugin
from omegaconf import OmegaConf

from accelopt import ClusterInfo, PluginSpec, RunInfo, TransferPriorities, TransferRecord, hookimpl
from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import TransferOrderError, run_cluster
from accelopt.errors import ConfigError
from accelopt.host import PluginHost

pytestmark = pytest.mark.timeout(120)


def make_cfg(iterations: int = 4, plugins: dict | None = None, workers: int = 2):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="tiny", model="mlp", width=32, batch_size=16, iterations=iterations, seed=0))]
    cfg.cluster.mode = "ps"
    cfg.cluster.workers = workers
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 20
    if plugins:
        cfg.plugins = plugins
    return cfg


SERVER = ClusterInfo(mode="ps", workers=2, servers=1, backend="gloo")


def server_run(tmp_path, jobs=()) -> RunInfo:
    """What rank 0 (the server) of a 1-server, 2-worker run is told about itself."""
    return RunInfo(str(tmp_path), "cpu", ("tictac",), tuple(jobs), 0, rank=0, role="server",
                   world_size=3, leader=True, cluster=SERVER)


def server_plugin(tmp_path, monkeypatch, job_settings=None,
                  **config) -> tuple[TictacPlugin, list[TransferRecord]]:
    """The plugin as rank 0 (the server) of a 1-server, 2-worker run holds it: configured,
    then told about its built job (where it plans), then the run starts. ``job_settings``:
    the job's keys to change from :func:`make_cfg`'s."""
    from accelopt.job import Job

    cfg = make_cfg()
    for key, value in (job_settings or {}).items():
        cfg.workload.jobs[0][key] = value
    conf = TictacConfig(oracle_runs=1, **config)
    plugin = TictacPlugin(conf)
    plugin.accelopt_configure(conf, cfg)
    job = Job(OmegaConf.to_object(cfg.workload.jobs[0]), job_id="tiny",
              device=torch.device("cpu"))
    run = dataclasses.replace(server_run(tmp_path, [job.info]), job=job.info)
    plugin.accelopt_job_built(run=run, job=job.built())
    plugin.accelopt_run_start(run=run)
    records = [TransferRecord("tiny", 0, 0, 1, p.name, p.nbytes, p.layer_index, "param")
               for p in job.info.parameters]
    return plugin, records


class _ShapeBranch(torch.nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = torch.relu(self.a(x))
        return self.b(x)


class _ValueBranch(torch.nn.Module):
    """Control flow on a tensor's *value*: no tracer can read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        repeats = int(x.abs().sum().item() * 1000) % 3 + 1
        return self.a(x).repeat(repeats, 1)


class _KeywordInputs(torch.nn.Module):
    """An HF-style model: keyword inputs ``input_ids`` and ``attention_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask[..., None]
        return self.head(h.mean(1))


def planned_with(tmp_path, model, inputs, **config) -> TictacPlugin:
    """A server's tictac told about a job whose model is ``model`` on ``inputs``."""
    from accelopt import BuiltJob
    from accelopt.job import Job

    cfg = make_cfg()
    conf = TictacConfig(oracle_runs=1, **config)
    plugin = TictacPlugin(conf)
    plugin.accelopt_configure(conf, cfg)
    info = Job(OmegaConf.to_object(cfg.workload.jobs[0]), job_id="tiny",
               device=torch.device("cpu")).info
    run = dataclasses.replace(server_run(tmp_path, [info]), job=info)
    built = BuiltJob(job=info, model=model, inputs=inputs, targets=torch.zeros(4).long(),
                     loss=lambda out, y: torch.nn.functional.cross_entropy(out[:len(y)], y))
    plugin.accelopt_job_built(run=run, job=built)
    plugin.accelopt_run_start(run=run)
    return plugin


def test_a_model_no_tracer_reads_keeps_the_default_order_and_says_why(tmp_path):
    """Neither torch.fx nor torch.export can read it: the job keeps the default order, the
    run goes on (no error), and the row names both reasons."""
    torch.manual_seed(0)
    plugin = planned_with(tmp_path, _ValueBranch(), torch.randn(4, 8), heuristic="tac")
    records = [TransferRecord("tiny", 0, 0, 1, n, p.numel() * 4, i, "param")
               for i, (n, p) in enumerate(_ValueBranch().named_parameters())]
    assert plugin.accelopt_transfer_order(transfers=records, destination=1) is None
    (row,) = plugin.accelopt_report_rows(run=server_run(tmp_path))
    assert "not applied: cannot trace model" in row.summary, row.summary
    assert "torch.fx" in row.summary and "torch.export" in row.summary
    assert "default order" in row.summary and "\n" not in row.summary


@pytest.mark.parametrize("model,inputs", [
    (_ShapeBranch, lambda: torch.randn(4, 8)),
    (_KeywordInputs, lambda: {"input_ids": torch.randint(0, 16, (4, 5)),
                              "attention_mask": torch.ones(4, 5)}),
], ids=["fx-fails", "keyword-inputs"])
def test_models_fx_cannot_trace_are_planned_through_torch_export(tmp_path, model, inputs):
    """Shape-dependent Python and keyword inputs: traced by torch.export on the job's real
    inputs, every parameter a recv of the plan, and the row says how it was traced and how
    far its order is from the default one."""
    torch.manual_seed(0)
    net = model()
    plugin = planned_with(tmp_path, net, inputs(), heuristic="reverse")
    assert plugin.plan is not None and plugin.plan.traced_by == "torch.export"
    assert sorted(plugin.plan.dag.recv_names) == sorted(n for n, _ in net.named_parameters())
    users = plugin.plan.dag.users()
    assert all(users[r] for r in plugin.plan.dag.recvs)  # every parameter feeds an op
    (row,) = plugin.accelopt_report_rows(run=server_run(tmp_path))
    n = len(list(net.parameters()))
    assert "traced by torch.export" in row.summary
    assert row.metrics["tensors"] == n
    assert row.metrics["moved_vs_default"] == n - (n % 2)  # reverse: all but a middle one
    assert f"moves {n - n % 2} of {n} tensors" in row.summary


def test_configure_rejects_bad_keys_in_one_line():
    plugin = TictacPlugin(TictacConfig())
    with pytest.raises(ConfigError, match="plugins.tictac.heuristic"):
        plugin.accelopt_configure(TictacConfig(heuristic="fastest"), make_cfg())
    with pytest.raises(ConfigError, match="plugins.tictac.execution"):
        plugin.accelopt_configure(TictacConfig(execution="async"), make_cfg())
    with pytest.raises(ConfigError, match=r"partition_bytes must be >= 0 \(0: whole tensors"):
        plugin.accelopt_configure(TictacConfig(partition_bytes=-2), make_cfg())
    with pytest.raises(ConfigError, match="tune_partitions is empty; give the chunk sizes"):
        plugin.accelopt_configure(TictacConfig(partition_bytes=-1, tune_partitions=[]),
                                  make_cfg())
    with pytest.raises(ConfigError, match="tune_credits is empty; give the credit windows"):
        plugin.accelopt_configure(TictacConfig(credit_bytes=-1, tune_credits=[]), make_cfg())
    with pytest.raises(ConfigError, match=r"plugins.tictac.pace=1.5 must be in \[0, 1\]"):
        plugin.accelopt_configure(TictacConfig(pace=1.5), make_cfg())
    with pytest.raises(ConfigError, match=r"message_s=-5 must be >= 0 .* or -1"):
        plugin.accelopt_configure(TictacConfig(message_s=-5), make_cfg())
    with pytest.raises(ConfigError, match="replan_iteration=-1 must be >= 0"):
        plugin.accelopt_configure(TictacConfig(replan_iteration=-1), make_cfg())


FLOAT_KEYS = [f.name for f in dataclasses.fields(TictacConfig) if f.type == "float"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_configure_refuses_nan_and_inf_in_every_float_key(key, value):
    """bandwidth_bytes_per_s=nan passed its `< 0` check and was read as "measure";
    message_s=nan and inf were accepted too (inf ms, E = nan)."""
    assert {"bandwidth_bytes_per_s", "message_s", "pace"} <= set(FLOAT_KEYS)
    plugin = TictacPlugin(TictacConfig())
    with pytest.raises(ConfigError, match=rf"^plugins\.tictac\.{key}={value} must be ") as info:
        plugin.accelopt_configure(TictacConfig(**{key: float(value)}), make_cfg())
    assert "\n" not in str(info.value)


def test_pace_is_a_share_of_the_shaped_rate():
    """Two workers: on the server's link two transfers share the rate, on one bus four."""
    plugin = TictacPlugin(TictacConfig(pace=0.5))
    plugin.cluster = ClusterInfo(mode="ps", workers=2, servers=1, bandwidth_bps=8_000_000,
                                 topology="hosts")
    assert plugin._pace() == pytest.approx(0.5 * 1e6 / 2)
    plugin.cluster = dataclasses.replace(plugin.cluster, topology="shared")
    assert plugin._pace() == pytest.approx(0.5 * 1e6 / 4)
    plugin.config = TictacConfig(pace=0.0)
    assert plugin._pace() == 0.0


def test_self_limiting_tac_stays_out_and_says_so(tmp_path, monkeypatch):
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="tac")
    # an MLP is a chain: TAC's order is the default order, so there is nothing to gain
    assert plugin.accelopt_transfer_order(transfers=records, destination=1) is None
    row = plugin.accelopt_report_rows(run=server_run(tmp_path))[0]
    assert "stayed out of the way" in row.summary and row.metrics["enforced"] == 0
    assert "its order is the default order" in row.summary and row.metrics["moved_vs_default"] == 0
    assert (tmp_path / "tictac" / "plan-rank0.json").exists()
    forced, _ = server_plugin(tmp_path, monkeypatch, heuristic="tac", force=True)
    order = forced.accelopt_transfer_order(transfers=records, destination=1)
    assert order == [r.tensor for r in records]


def test_the_row_names_its_schedule_directory_as_the_run_directory_line_does(
        tmp_path, monkeypatch):
    """Relative to the working directory when under it (the README's form; the row printed
    the whole absolute path beside a relative ``run directory:`` line)."""
    plugin, _ = server_plugin(tmp_path, monkeypatch, heuristic="tac")
    monkeypatch.chdir(tmp_path.parent)
    row = plugin.accelopt_report_rows(run=server_run(tmp_path))[0]
    assert f"predicted schedule in {tmp_path.name}/tictac/" in row.summary, row.summary
    assert str(tmp_path) not in row.summary


def test_random_is_fresh_each_iteration_and_seeded(tmp_path, monkeypatch):
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="random")
    orders = set()
    for it in range(4):
        recs = [TransferRecord(r.job_id, it, 0, 1, r.tensor, r.nbytes, r.layer_index, "param")
                for r in records]
        order = plugin.accelopt_transfer_order(transfers=recs, destination=1)
        assert sorted(order) == sorted(r.tensor for r in records)
        orders.add(tuple(order))
    assert len(orders) > 1
    again, _ = server_plugin(tmp_path, monkeypatch, heuristic="random")
    assert tuple(again.accelopt_transfer_order(transfers=records, destination=1)) in orders
    grads = [TransferRecord("tiny", 0, 1, 0, r.tensor, r.nbytes, r.layer_index, "grad")
             for r in records]
    assert plugin.accelopt_transfer_order(transfers=grads, destination=0) is None


def test_stale_order_file_is_detected_and_rebuilt(tmp_path, monkeypatch):
    stale = tmp_path / "order.json"
    stale.write_text(json.dumps(["net.1.weight", "old.layer.weight"]))
    with pytest.warns(RuntimeWarning, match="does not match the model"):
        plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="reverse",
                                        order_file=str(stale))
        order = plugin.accelopt_transfer_order(transfers=records, destination=1)
    assert order == [r.tensor for r in reversed(records)]
    good = tmp_path / "good.json"
    wanted = [r.tensor for r in records][::2] + [r.tensor for r in records][1::2]
    good.write_text(json.dumps(wanted))
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="named",
                                    order_file=str(good))
    assert plugin.accelopt_transfer_order(transfers=records, destination=1) == wanted


def test_unknown_tensor_means_stale_plan_rebuilt(tmp_path, monkeypatch):
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="named")
    plugin.accelopt_transfer_order(transfers=records, destination=1)
    plugin.plan.dag.names[plugin.plan.dag.recvs[0]] = "edited.name"  # the plan goes stale
    with pytest.warns(RuntimeWarning, match="does not match the model"):
        order = plugin.accelopt_transfer_order(transfers=records, destination=1)
    assert order == [r.tensor for r in records]


def test_transfer_that_never_comes_is_an_error_naming_tensor_and_priority(tmp_path,
                                                                         monkeypatch):
    """The real Transport, driven by tictac's order: the first-priority tensor is never
    posted, so the others are held; the wait ends in TransferOrderError, not a hang."""
    from accelopt.drivers.cluster.transport import Transport

    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="reverse")
    host = PluginHost([(PLUGIN, plugin)])
    transport = Transport(rank=0, host=host, t0_epoch=0.0, process="rank 0 (server)",
                          timeout_s=1.0, device=torch.device("cpu"))
    transport.plan(0, 1, records)
    first = records[-1]  # reverse order: the last layer's tensor has priority 0
    for rec in records[:-1]:
        transport.post(rec, torch.zeros(1))
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", _catch(
        transport.wait_started, 0)))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    err = box["r"]
    assert isinstance(err, TransferOrderError)
    assert f"'{first.tensor}' (priority 0)" in str(err)


def _catch(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def test_report_row_outside_ps_mode(tmp_path):
    plugin = TictacPlugin(TictacConfig())
    cfg = make_cfg()
    cfg.cluster.mode = "none"
    plugin.accelopt_configure(TictacConfig(), cfg)
    plugin.accelopt_run_start(run=RunInfo(str(tmp_path), "cpu", ("tictac",), (), 0))
    row = plugin.accelopt_report_rows(run=None)[0]
    assert "nothing to order" in row.summary


def test_cluster_orders_enforced_and_numerics_bitwise_equal(tmp_path):
    """Random orders (fresh every iteration) move every transfer around; parameters after N
    iterations must still be bitwise equal to the run without the plugin."""
    base = run_cluster(make_cfg(), run_dir=tmp_path / "base")
    ordered = run_cluster(make_cfg(plugins={"tictac": {"heuristic": "random",
                                                       "oracle_runs": 1}}),
                          run_dir=tmp_path / "tictac")
    assert base.metrics["transfers_ordered"] == 0
    n_params = len(base.state) - 0
    assert ordered.metrics["transfers_ordered"] == 4 * 2 * n_params  # iterations x workers
    assert ordered.metrics["out_of_order_fraction"] == 0.0
    for name, value in base.state.items():
        assert torch.equal(value, ordered.state[name]), name
    rows = [r for r in ordered.plugin_rows if r.plugin == "tictac"]
    assert any("enforced random" in r.summary for r in rows)
    started = [s for r in ordered.ranks if r.role == "server"
               for s in r.stats.started_log if s[1] == 1]
    per_it = {}
    for it, _dest, _seq, tensor in started:
        per_it.setdefault(it, []).append(tensor)
    assert len({tuple(v) for v in per_it.values() if len(v) == n_params}) > 1  # fresh orders
    plan = json.loads((tmp_path / "tictac" / "tictac" / "plan-rank0.json").read_text())
    assert plan["heuristic"] == "random" and len(plan["order"]) == n_params


def test_inference_harness_enforces_the_order_and_measures_e(tmp_path):
    """benchmarks/tictac_infer_ps.py (forward-only PS steps on the cluster's transport): the
    worker receives the parameters in the plugin's enforced order (reverse here, so the
    enforced order is visibly not the layer order) and the run yields E and a."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "tictac_infer_ps.py"
    spec = importlib.util.spec_from_file_location("tictac_infer_ps", path)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["tictac_infer_ps"] = module  # the spawned ranks import it by this name
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
        cfg = make_cfg(iterations=3, workers=1,
                       plugins={"tictac": {"heuristic": "reverse", "oracle_runs": 1}})
        cfg.workload.jobs[0].kind = "infer"
        out = module.run_inference(cfg, run_dir=str(tmp_path))
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop("tictac_infer_ps", None)
    names = [n for n, _ in torch.nn.Module.named_parameters(_tiny_model())]
    arrived = [s for r in out.ranks if r.role == "worker" for s in r.stats.arrival_log]
    for it in range(3):
        assert [t for i, _src, _seq, t in arrived if i == it] == names[::-1]
    assert out.metrics["out_of_order_fraction"] == 0.0
    assert out.metrics["transfers_ordered"] == 3 * len(names)
    assert out.metrics.get("efficiency_e_with_warmup") is not None
    assert out.results[0].iterations_done == 3


def _tiny_model():
    from accelopt.job import Job

    cfg = make_cfg()
    return Job(OmegaConf.to_object(cfg.workload.jobs[0]), job_id="tiny",
               device=torch.device("cpu")).model


def test_two_servers_each_enforce_the_plan_on_their_own_link(tmp_path):
    """Parameters sharded over two servers: each server's link carries its shard in the
    plan's order (reverse here, visibly not the layer order), every iteration, to every
    worker, and the numerics stay bitwise those of the run without the plugin."""
    def two_servers(plugins=None):
        cfg = make_cfg(iterations=3, plugins=plugins)
        cfg.cluster.servers = 2
        return cfg

    base = run_cluster(two_servers(), run_dir=tmp_path / "base")
    ordered = run_cluster(two_servers({"tictac": {"heuristic": "reverse", "oracle_runs": 1}}),
                          run_dir=tmp_path / "tictac")
    names = [n for n, _ in _tiny_model().named_parameters()]
    servers = [r for r in ordered.ranks if r.role == "server"]
    workers = [r.rank for r in ordered.ranks if r.role == "worker"]
    assert len(servers) == 2
    shards = []
    for server in servers:
        sent = {}
        for it, dest, _seq, tensor in server.stats.started_log:
            sent.setdefault((it, dest), []).append(tensor)
        shard = set(sent[(0, workers[0])])
        assert shard, f"server rank {server.rank} holds no parameter"
        shards.append(shard)
        expected = [n for n in names[::-1] if n in shard]  # the plan, restricted to the link
        for it in range(3):
            for w in workers:
                assert sent[(it, w)] == expected, (server.rank, it, w)
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(names)
    assert ordered.metrics["out_of_order_fraction"] == 0.0
    assert ordered.metrics["transfers_ordered"] == 3 * len(workers) * len(names)
    for name, value in base.state.items():
        assert torch.equal(value, ordered.state[name]), name


def test_heuristic_off_is_out_of_the_transfer_path_and_says_so(tmp_path):
    """heuristic=off: no transfer hook at all (the transport never calls into the plugin per
    transfer), the default order, and a row saying so."""
    off = PLUGIN.instantiate(TictacConfig(heuristic="off"))
    hooks = PluginHost([(PLUGIN, off)]).hooks_of("tictac")
    assert not {h for h in hooks if h.startswith("accelopt_transfer_")}
    assert "accelopt_transfer_order" in PluginHost(
        [(PLUGIN, PLUGIN.instantiate(TictacConfig()))]).hooks_of("tictac")
    out = run_cluster(make_cfg(iterations=2, plugins={"tictac": {"heuristic": "off"}}),
                      run_dir=tmp_path)
    assert out.metrics["transfers_ordered"] == 0
    rows = [r.summary for r in out.plugin_rows if r.plugin == "tictac"]
    assert any("heuristic=off" in r for r in rows), rows


# -- cross-iteration priority scheduling (heuristic=priority) --------------------------------


class _Answer:
    """An order plugin answering priority scheduling: ``order`` with a credit window."""

    def __init__(self, order: list[str], credit: int, partition: int = 0,
                 pace: float = 0.0) -> None:
        self.answer = TransferPriorities(tuple(order), credit_bytes=credit,
                                         partition_bytes=partition, pace_bytes_per_s=pace)

    @hookimpl
    def accelopt_transfer_order(self, transfers, destination):
        return self.answer


class _HeldWatcher:
    """Stands in for the send watcher: the test decides when a transfer's sends complete."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []
        self.paced: list[float] = []

    def put(self, stream, works, nbytes, paced_until=0.0) -> None:
        self.entries.append((stream, works, nbytes))
        self.paced.append(paced_until)


def _priority_transport(order: list[str], credit: int, partition: int = 0,
                        real_start: bool = False, pace: float = 0.0):
    from accelopt.drivers.cluster.transport import Transport

    answer = _Answer(order, credit, partition, pace)
    host = PluginHost([(PluginSpec(name="prio", factory=lambda c: None), answer)])
    t = Transport(rank=0, host=host, t0_epoch=0.0, process="test", timeout_s=5.0,
                  device=torch.device("cpu"), tensor_ids={n: k for k, n in enumerate(order)})
    started: list[str] = []
    watcher = _HeldWatcher()
    t._watcher = lambda destination: watcher  # type: ignore[method-assign]
    if real_start:
        return t, started, watcher

    def start(stream, item, prio):
        started.append(item.record.tensor)
        item.chunk += 1
        return item.record.nbytes

    t._start = start  # type: ignore[method-assign]
    return t, started, watcher


def _grad(name: str, nbytes: int, layer: int) -> TransferRecord:
    return TransferRecord("j", 0, 1, 0, name, nbytes, layer, "grad")


def test_priority_sends_start_the_best_posted_transfer_when_credit_frees():
    """Posted last-layer first (as backward does), with room for one transfer in flight:
    each time credit returns, the highest-priority waiting transfer starts, so the first
    layer's gradient, posted last, overtakes the later layers' still waiting."""
    records = [_grad(f"l{k}", 100, k) for k in range(4)]
    t, started, watcher = _priority_transport([r.tensor for r in records], credit=100)
    schedule = t.plan(0, 0, records)
    assert schedule is not None and schedule.credit_bytes == 100
    for rec in reversed(records):  # l3, l2, l1, l0 posted in backward order
        t.post(rec, torch.zeros(1))
    assert started == ["l3"]  # the window holds one transfer
    while watcher.entries:
        stream, _works, nbytes = watcher.entries.pop(0)
        t._returned(stream, nbytes)
    assert started == ["l3", "l0", "l1", "l2"]
    stream = t._out[(0, 0)]
    assert stream.overtaken == 2  # l0 and l1 went ahead of l2, posted before them
    assert stream.inflight == 0 and not stream.queue


def test_a_paced_window_returns_credit_when_the_link_would_be_free(monkeypatch):
    """pace_bytes_per_s: each transfer's credit returns when its bytes have left a link of
    that rate, back to back after the previous one's; the watcher sleeps until then."""
    from accelopt.drivers.cluster import transport

    records = [_grad(f"l{k}", 100, k) for k in range(3)]
    t, _started, watcher = _priority_transport([r.tensor for r in records], credit=10_000,
                                               pace=100.0)
    t.plan(0, 0, records)
    for rec in records:
        t.post(rec, torch.zeros(1))
    first, second, third = watcher.paced
    assert second - first == pytest.approx(1.0) and third - second == pytest.approx(1.0)

    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    real = transport._SendWatcher.__new__(transport._SendWatcher)
    real.transport = t
    returned: list[int] = []
    t._returned = lambda stream, nbytes: returned.append(nbytes)  # type: ignore[method-assign]
    real.handle((t._out[(0, 0)], [], 100, transport.time.monotonic() + 0.5))
    assert returned == [100] and len(slept) == 1 and 0 < slept[0] <= 0.5


def test_priority_with_no_window_starts_each_transfer_when_posted():
    records = [_grad(f"l{k}", 100, k) for k in range(3)]
    t, started, watcher = _priority_transport([r.tensor for r in records], credit=0)
    t.plan(0, 0, records)
    for rec in reversed(records):
        t.post(rec, torch.zeros(1))
    assert started == ["l2", "l1", "l0"] and not watcher.entries


class _Wire:
    """Stands in for gloo between two transports in one process: a send is kept by tag, a
    receive copies the send with its tag into the start of its buffer, as gloo fills a
    receive with a shorter message (every send here is issued before the receives)."""

    class Work:
        def wait(self, timeout=None) -> bool:
            return True

    def __init__(self, monkeypatch) -> None:
        from accelopt.drivers.cluster import transport

        self.sent: dict[int, torch.Tensor] = {}
        wire = self
        monkeypatch.setattr(transport.Transport, "_send",
                            lambda _t, tensor, destination, tag: wire.isend(tensor, tag))
        monkeypatch.setattr(transport.Transport, "_recv",
                            lambda _t, tensor, source, tag: wire.irecv(tensor, tag))

    def isend(self, tensor, tag):
        assert tag not in self.sent, f"tag {tag} sent twice"
        self.sent[tag] = tensor.clone()
        return self.Work()

    def irecv(self, tensor, tag):
        sent = self.sent[tag].reshape(-1).view(torch.uint8)
        assert sent.numel() <= tensor.numel() * tensor.element_size(), "message too long"
        tensor.view(-1).view(torch.uint8)[:sent.numel()].copy_(sent)
        return self.Work()


def test_a_partitioned_transfer_is_preempted_between_chunks_and_arrives_whole(monkeypatch):
    """A 400-byte tensor in chunks of 100 bytes, a window of one message: a better transfer
    posted after its first chunk started goes before its second; the receiver gets both
    bitwise, the small one first (it completes first), the large one assembled in place."""
    from accelopt.drivers.cluster.transport import HEADER_BYTES, Transport

    wire = _Wire(monkeypatch)
    t, _started, watcher = _priority_transport(["small", "big"], credit=100, partition=100,
                                               real_start=True)
    big = TransferRecord("j", 0, 0, 1, "big", 400, 1, "param")
    small = TransferRecord("j", 0, 0, 1, "small", 40, 0, "param")
    big_value, small_value = torch.randn(10, 10), torch.randn(10)
    t.plan(0, 1, [big, small])
    t.post(big, big_value)
    t.post(small, small_value)
    while watcher.entries:
        stream, _works, nbytes = watcher.entries.pop(0)
        t._returned(stream, nbytes)
    assert [name for *_rest, name in t.stats.started_log] == [
        "big", "small", "big", "big", "big"]
    assert t.stats.partitioned == 1 and t.stats.chunks == 4 and t.stats.transfers == 2
    assert t._out[(0, 1)].overtaken == 1
    assert len(wire.sent) == 5  # one message each: every chunk is inline, behind its header

    receiver = Transport(rank=1, host=PluginHost([]), t0_epoch=0.0, process="test",
                         timeout_s=5.0, device=torch.device("cpu"))
    got: list[tuple[str, torch.Tensor]] = []
    receiver.receive(0, 0, {0: small, 1: big}, lambda rec, payload: got.append(
        (rec.tensor, payload)))
    assert [name for name, _ in got] == ["small", "big"]
    assert torch.equal(got[0][1], small_value) and torch.equal(got[1][1], big_value)
    assert receiver.spans[-1].name == "big" and receiver.spans[-1].args["tensor_bytes"] == 400
    # the span's bytes are the link's: each of big's four chunks behind its own header
    assert receiver.spans[-1].args["bytes"] == 400 + 4 * HEADER_BYTES


def test_a_large_payload_goes_behind_its_header_and_a_small_one_inside_it(monkeypatch):
    """Payloads up to INLINE_BYTES travel in their header's message, larger ones as a second
    message, chunk by chunk for a partitioned tensor: every tensor arrives bitwise, in the
    order it started, and the bytes counted are the same on both sides."""
    from accelopt.drivers.cluster.transport import INLINE_BYTES, Transport

    wire = _Wire(monkeypatch)
    over = INLINE_BYTES // 4 + 10  # float32 elements just over the limit
    names = ["small", "big", "split", "halves"]
    t, _started, watcher = _priority_transport(names, credit=10**9,
                                               partition=INLINE_BYTES + 64, real_start=True)
    values = [torch.randn(10), torch.randn(over), torch.randn(2 * over),
              torch.randn(INLINE_BYTES // 4 + 25)]
    records = [TransferRecord("j", 0, 0, 1, name, 4 * v.numel(), k, "param")
               for k, (name, v) in enumerate(zip(names, values, strict=True))]
    t.plan(0, 1, records)
    for record, value in zip(records, values, strict=True):
        t.post(record, value)
    while watcher.entries:
        stream, _works, nbytes = watcher.entries.pop(0)
        t._returned(stream, nbytes)
    # small: 1 message; big (under the partition): header, then payload; split: 2 chunks
    # over the limit, 2 messages each; halves: 2 chunks under it, 1 message each
    assert len(wire.sent) == 1 + 2 + 4 + 2
    assert t.stats.partitioned == 2 and t.stats.chunks == 4
    receiver = Transport(rank=1, host=PluginHost([]), t0_epoch=0.0, process="test",
                         timeout_s=5.0, device=torch.device("cpu"))
    got: dict[str, torch.Tensor] = {}
    receiver.receive(0, 0, dict(enumerate(records)),
                     lambda rec, payload: got.__setitem__(rec.tensor, payload))
    assert list(got) == names
    for record, value in zip(records, values, strict=True):
        assert torch.equal(got[record.tensor], value), record.tensor
    sent = sum(v.numel() * v.element_size() for v in wire.sent.values())
    assert sent == t.stats.header_bytes + t.stats.payload_bytes
    assert sum(span.args["tensor_bytes"] for span in receiver.spans) == \
        sum(r.nbytes for r in records)
    assert sum(span.args["bytes"] for span in receiver.spans) == sent  # what crossed the link


def test_on_nccl_no_payload_rides_in_its_header():
    """NCCL needs both ends of a message to name its size, so a CUDA transport (NCCL's)
    posts header receives of exactly a header and sends every non-empty payload apart."""
    from accelopt.drivers.cluster.transport import INLINE_BYTES, Transport

    def transport(device: str) -> Transport:
        return Transport(rank=0, host=PluginHost([]), t0_epoch=0.0, process="test",
                         timeout_s=5.0, device=torch.device(device))

    assert transport("cpu")._inline == INLINE_BYTES
    assert transport("cuda")._inline == 0


def test_priority_answer_is_a_strict_order_for_all_reduce():
    """Collectives must start in the same sequence on every rank: all-reduce keeps the
    answer's order as a strict order, and no early update is asked."""
    t, _started, _watcher = _priority_transport(["b", "a"], credit=100)
    records = [TransferRecord("j", 0, 0, -1, n, 100, k, "grad") for k, n in enumerate("ab")]
    assert t.plan(0, -1, records) is None
    stream = t._out[(0, -1)]
    assert stream.credit is None and stream.order == ["b", "a"]


def test_priority_updates_each_tensor_early_and_keeps_the_numerics_bitwise(tmp_path):
    """heuristic=priority: the server updates every tensor as its gradients arrive and
    posts it for the next iteration at once; workers stage what arrives during backward.
    After N iterations the parameters are bitwise those of the run without the plugin."""
    iterations = 4
    base = run_cluster(make_cfg(iterations), run_dir=tmp_path / "base")
    prio = run_cluster(make_cfg(iterations, plugins={"tictac": {
        "heuristic": "priority", "oracle_runs": 1, "credit_bytes": 100}}),
        run_dir=tmp_path / "prio")
    n_params = len(base.state)
    assert base.metrics["tensors_updated_early"] == 0
    assert prio.metrics["tensors_updated_early"] == iterations * n_params
    for name, value in base.state.items():
        assert torch.equal(value, prio.state[name]), name
    rows = [r.summary for r in prio.plugin_rows if r.plugin == "tictac"]
    assert any(r.startswith("server rank 0: enforced priority (cross-iteration: parameters "
                            "by the plan's") and "credit 100 B per link (configured)" in r for r in rows)
    assert any("gradients pushed first-layer first" in r for r in rows)
    # the server predicts both schedules with the cross-iteration simulator
    server = [r.metrics for r in prio.plugin_rows
              if r.plugin == "tictac" and "predicted_ms" in r.metrics]
    assert server and all(m["predicted_off_ms"] > 0 and m["predicted_credit_100_ms"] > 0
                          and m["predicted_ms"] == m["predicted_credit_100_ms"] for m in server)
    plan = json.loads((tmp_path / "prio" / "tictac" / "plan-rank0.json").read_text())
    assert set(plan["cross_iteration"]["schedules"]) == {"off", "credit_100"}


def test_priority_with_partitioned_tensors_keeps_the_numerics_bitwise(tmp_path):
    """Chunks of 64 bytes through a window of 100 over real gloo processes: every tensor
    larger than a chunk is partitioned both ways (parameters and gradients) and the weights
    are bitwise those of the run without the plugin."""
    base = run_cluster(make_cfg(3), run_dir=tmp_path / "base")
    prio = run_cluster(make_cfg(3, plugins={"tictac": {
        "heuristic": "priority", "oracle_runs": 1, "credit_bytes": 100,
        "partition_bytes": 64}}), run_dir=tmp_path / "prio")
    assert base.metrics["transfers_partitioned"] == 0
    assert prio.metrics["transfers_partitioned"] > 0
    for name, value in base.state.items():
        assert torch.equal(value, prio.state[name]), name
    rows = [r.summary for r in prio.plugin_rows if r.plugin == "tictac"]
    assert any("credit 100 B, chunks of 64 B per link (configured)" in r for r in rows)


def test_priority_tunes_its_window_by_measurement_and_switches_modes_bitwise(tmp_path):
    """credit_bytes=-1: after the warm-up, the default order (whole step) and each window in
    turn, two iterations each (the first untimed), then the fastest; switching between the
    early update and the whole step from one iteration to the next leaves the weights bitwise
    unchanged."""
    iterations = 10
    base = run_cluster(make_cfg(iterations), run_dir=tmp_path / "base")
    tuned = run_cluster(make_cfg(iterations, plugins={"tictac": {
        "heuristic": "priority", "oracle_runs": 1, "credit_bytes": -1,
        "tune_credits": [0, 100], "tune_block": 2, "tune_rounds": 1}}),
        run_dir=tmp_path / "tuned")
    for name, value in base.state.items():
        assert torch.equal(value, tuned.state[name]), name
    n_params = len(base.state)
    early = tuned.metrics["tensors_updated_early"]
    # iterations 4-7 measure the windows; 8 and 9 run the choice (or the default)
    assert 4 * n_params <= early <= 6 * n_params and early % n_params == 0
    rows = [r for r in tuned.plugin_rows if r.plugin == "tictac"]
    assert rows and all("measured over iterations 2-7 (median of 1 timed iterations each)"
                        in r.summary for r in rows)
    assert all({"measured_off_ms", "measured_credit_0_ms", "measured_credit_100_ms"}
               <= set(r.metrics) for r in rows)


def test_priority_keeps_the_whole_step_where_the_step_reads_every_gradient(tmp_path):
    """Gradient clipping needs the norm over every tensor: no early update (and no other
    change of the numerics), the same weights as without the plugin."""
    def clipped(plugins=None):
        cfg = make_cfg(3, plugins=plugins)
        cfg.workload.jobs[0].grad_clip = 0.01
        return cfg

    base = run_cluster(clipped(), run_dir=tmp_path / "base")
    prio = run_cluster(clipped({"tictac": {"heuristic": "priority", "oracle_runs": 1,
                                           "credit_bytes": 0}}), run_dir=tmp_path / "prio")
    assert prio.metrics["tensors_updated_early"] == 0  # asked for from iteration 0, refused
    assert prio.metrics["transfers_ordered"] > 0
    for name, value in base.state.items():
        assert torch.equal(value, prio.state[name]), name


def test_priority_with_two_servers_and_several_jobs_keeps_every_jobs_weights(tmp_path):
    """Two servers each update their shard early, and two jobs share the processes (the
    leader interleaves their iterations, so a job's next-iteration parameters wait on the
    workers while the other job runs): every job's weights are bitwise unchanged."""
    def cluster(plugins=None):
        cfg = make_cfg(iterations=3, plugins=plugins)
        second = OmegaConf.structured(JobConfig(name="cnn", model="cnn", width=8,
                                                batch_size=8, iterations=3, seed=1))
        cfg.workload.jobs = [cfg.workload.jobs[0], second]
        cfg.cluster.servers = 2
        return cfg

    base = run_cluster(cluster(), run_dir=tmp_path / "base")
    prio = run_cluster(cluster({"tictac": {"heuristic": "priority", "oracle_runs": 1,
                                           "credit_bytes": 0}}), run_dir=tmp_path / "prio")
    assert set(base.state) == set(prio.state) and len(base.state) == 2
    for job, params in base.state.items():
        for name, value in params.items():
            assert torch.equal(value, prio.state[job][name]), (job, name)
    buffers = ("running_mean", "running_var", "num_batches_tracked")  # the cnn's batch norms
    n_params = sum(not n.endswith(buffers) for p in base.state.values() for n in p)
    assert prio.metrics["tensors_updated_early"] == 3 * n_params
