"""Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) accelopt spawns nothing: each
process is one rank, and rank 0 alone writes the run's outputs."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest
from clirun import cli_env

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_runs_the_same_config_as_ranks(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "accelopt.cli.main", "run", "workload=tiny", "cluster.mode=ps",
        "cluster.workers=2", "cluster.servers=1", "run.progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    # torchrun keeps its per-run directories (torchelastic_*) in the temporary directory
    env = {**cli_env(), "TMPDIR": str(tmp_path)}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["summary"]["cluster_mode"] == "ps"
    assert metrics["summary"]["cluster_workers"] == 2
    # workload=tiny has two jobs: both share the three torchrun ranks (multi-job PS)
    assert [j["status"] for j in metrics["jobs"]] == ["done", "done"]
    assert result.stdout.count("Run: 2/2 done") == 1  # only rank 0 reports


TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_other_ranks_get_a_scratch_run_directory_unless_one_is_named():
    import os

    from accelopt.cli.run_dirs import secondary_rank_dir

    scratch = secondary_rank_dir(["workload=tiny"], TORCHRUN_ENV)
    try:
        assert scratch is not None and os.path.basename(scratch).startswith("accelopt-rank1-")
    finally:
        os.rmdir(scratch)
    assert secondary_rank_dir(["hydra.run.dir=runs/x"], TORCHRUN_ENV) is None
    assert secondary_rank_dir([], {**TORCHRUN_ENV, "RANK": "0"}) is None
    assert secondary_rank_dir([], {}) is None  # not under torchrun


def test_checkpoints_under_torchrun_need_one_named_run_directory(tmp_path, monkeypatch):
    from test_cluster import make_cfg

    from accelopt.drivers.cluster import run_cluster
    from accelopt.errors import ConfigError

    # a refusing rank tries to tell the others (nobody listens here): a second at most
    for key, value in {**TORCHRUN_ENV, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    cfg = make_cfg("ps", timeout_s=1)
    cfg.run.checkpoint_every = 2
    with pytest.raises(ConfigError, match="hydra.run.dir") as info:
        run_cluster(cfg, run_dir=tmp_path / "accelopt-rank1-abc")
    assert "\n" not in str(info.value)


def test_machines_started_with_different_configurations_are_one_line(tmp_path):
    """Two torchrun nodes whose command lines differ: DDP's parameter check, gloo's
    'Connection closed by peer' and Hydra tracebacks, with no line saying why."""
    port = str(_free_port())
    env = {**cli_env(), "TMPDIR": str(tmp_path)}
    nodes = []
    for node, lr in ((0, "0.1"), (1, "0.2")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", port, "-m", "accelopt.cli.main", "run", "workload=single",
               "workload.jobs.0.iterations=3", f"workload.jobs.0.lr={lr}",
               "cluster.mode=allreduce", "cluster.workers=2", "cluster.timeout_s=30",
               "run.progress=false", f"hydra.run.dir={tmp_path / f'node{node}'}"]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=200) for p in nodes]
    assert all(p.returncode != 0 for p in nodes)
    line = ("error: rank 1 was started with another configuration than rank 0 "
            "(workload.jobs.0.lr differ); start every machine with the same accelopt command line")
    for _, err in outputs:  # both machines say it: neither waits for a dead peer
        assert line in err, err[-2000:]


def test_a_failing_rank_under_torchrun_is_one_line_and_in_rank_0s_metrics(tmp_path):
    """Rank 1's model raises at its third forward (iteration 2): its error escaped to Hydra
    as a traceback, and rank 0, stopped by torchrun, recorded "terminated (SIGTERM)"."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "accelopt.cli.main", "run", "workload=single", "cluster.mode=ps",
           "workload.jobs.0.iterations=6", "workload.jobs.0.model=cluster_models:raises_on_rank",
           "workload.jobs.0.dataset=synthetic_vectors", "cluster.timeout_s=20",
           "run.compare=none", "run.progress=false", f"hydra.run.dir={run_dir}"]
    env = {**cli_env(), "TMPDIR": str(tmp_path)}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=200)
    assert result.returncode != 0
    line = ("raised RuntimeError: boom on rank 1 at iteration 2 of job 'mlp'; the cluster run "
            "was stopped")
    assert "error: rank 1 (worker, pid " in result.stderr and line in result.stderr, \
        result.stderr[-3000:]
    assert "Error executing job" not in result.stderr, result.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    error = metrics["summary"]["error"]
    assert error.startswith("rank 1 (worker, pid ") and error.endswith(line), error
    (job,) = metrics["jobs"]  # the job whose code raised gets the cause itself
    assert job["error"] == "RuntimeError: boom on rank 1 (rank 1, iteration 2)", job


def test_a_rendezvous_that_fails_names_master_addr_and_port(tmp_path, monkeypatch):
    """A rank given a port nobody listens on (or one already taken, for rank 0): torch's
    DistNetworkError/DistStoreError escaped as a Hydra traceback, naming neither."""
    import socket

    from test_cluster import make_cfg

    from accelopt.drivers.cluster import RankFailed, run_cluster

    port = _free_port()
    for key, value in {**TORCHRUN_ENV, "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RankFailed) as info:
        run_cluster(make_cfg("ps", timeout_s=1), run_dir=tmp_path / "accelopt-rank1-x")
    assert f"rank 1 could not join the other ranks through MASTER_ADDR=127.0.0.1 " \
           f"MASTER_PORT={port} (" in str(info.value)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("RANK", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(RankFailed) as info:
            run_cluster(make_cfg("ps", timeout_s=1), run_dir=tmp_path)
    assert str(info.value).startswith(f"the rendezvous port {port} (MASTER_PORT) is already "
                                      "in use by another process; give torchrun another")
    assert info.value.exit_code == 2


def test_under_torchrun_only_rank_0_keeps_a_failed_runs_evidence(tmp_path, monkeypatch):
    """Ranks sharing one hydra.run.dir (for checkpoint parts) each wrote a failed run's
    metrics.json, the last writer's view of the failure replacing rank 0's line."""
    import accelopt.drivers.cluster as cluster
    from accelopt.cli.hydra_run import prepared_configs
    from accelopt.plugin import Registry
    from accelopt.runtime.run import execute

    def fails(*_args, **_kwargs):
        raise RuntimeError("a peer rank failed")

    monkeypatch.setattr(cluster, "run_cluster", fails)
    (cfg,) = prepared_configs(["workload=tiny", "cluster.mode=ps", "run.progress=false"],
                              Registry.discover(), run_dir=tmp_path)
    for rank, writes in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(key, TORCHRUN_ENV[key])
        run_dir = tmp_path / f"rank{rank}"
        with pytest.raises(RuntimeError, match="a peer rank failed"):
            execute(cfg, run_dir=run_dir, registry=Registry.discover())
        assert (run_dir / "metrics.json").exists() is writes, rank


def _node_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """What torchrun would give rank ``rank`` of a launch of one rank per machine."""
    return cli_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


NODE_RUN = ["workload=single", "workload.jobs.0.iterations=3", "cluster.mode=allreduce",
            "cluster.workers=2", "run.progress=false"]


@pytest.mark.parametrize(("node1", "refusal"), [
    (["run.checkpoint_every=2"],
     "run.checkpoint_every under torchrun: every rank writes its part of each checkpoint "
     "into the run directory"),
    (["+plugins=[gradcomm]", "plugins.gradcomm.density=5"],
     "plugins.gradcomm.density must be in (0, 1], got 5.0"),
    (["+plugins=[nosuch]"], "unknown plugin 'nosuch'"),
], ids=["cluster-check", "run-check", "command-line"])
def test_a_rank_that_refuses_its_config_stops_the_others_at_once(tmp_path, node1, refusal):
    """Node 1 refused its config before joining: started without the hydra.run.dir that
    run.checkpoint_every needs (the cluster's checks), or with a plugin setting that its
    configure refuses (the run's checks, before the cluster starts); node 0 waited its whole
    cluster.timeout_s, then blamed MASTER_ADDR, MASTER_PORT and WORLD_SIZE (or, for the
    second, named rank 1 as never joined; and for a mistake in its command line, refused
    as its config was composed)."""
    from clirun import accelopt_cmd

    port = _free_port()
    timeout_s = 120  # what node 0 no longer waits out (the test's own limit is below it)
    common = [*NODE_RUN, f"cluster.timeout_s={timeout_s}"]
    commands = [[*common, "run.checkpoint_every=2", f"hydra.run.dir={tmp_path / 'node0'}"],
                [*common, *node1]]
    nodes = [subprocess.Popen(accelopt_cmd("run", *args), cwd=tmp_path,
                              env=_node_env(rank, 2, port, TMPDIR=str(tmp_path)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, args in enumerate(commands)]
    try:
        outputs = [p.communicate(timeout=timeout_s * 0.75) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [2, 2], outputs
    assert f"error: rank 1 refused its config: {refusal}" in outputs[0][1], outputs[0][1]
    assert outputs[1][1].startswith(f"error: {refusal}"), outputs[1][1]
    assert all(len(err.strip().splitlines()) == 1 for _, err in outputs), outputs


def test_a_rank_alone_names_the_ranks_that_never_joined(tmp_path, monkeypatch):
    """Rank 0 of two, rank 1 never started: the line blamed MASTER_ADDR, MASTER_PORT and
    WORLD_SIZE without saying that a rank had not come."""
    from test_cluster import make_cfg

    from accelopt.drivers.cluster import RankFailed, run_cluster

    port = _free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RankFailed) as info:
        run_cluster(make_cfg("allreduce", timeout_s=0.5), run_dir=tmp_path)
    assert str(info.value).startswith(
        f"rank 1 never joined the rendezvous at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
        "within cluster.timeout_s=0.5 s (rank 0 waited for it)"), str(info.value)
    assert info.value.rank == 1


@pytest.mark.parametrize(("env", "words"), [
    ({"RANK": "1", "WORLD_SIZE": "3"},
     "RANK=1 and WORLD_SIZE=3 declare a torchrun launch but MASTER_ADDR and MASTER_PORT are "
     "not set"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "but RANK is not set"),
    ({"RANK": "abc", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "RANK='abc' is not an integer"),
    ({"RANK": "5", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "RANK=5 must be in 0..2 (WORLD_SIZE=3)"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "port"},
     "MASTER_PORT='port' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000 is not a port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
      "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 must be in 0..0"),
])
def test_a_partial_or_wrong_torchrun_environment_is_refused_in_one_line(env, words):
    """RANK=1 WORLD_SIZE=3 without MASTER_ADDR was taken for a local run (a whole cluster
    started on the machine, exit 0); RANK=abc was a traceback, RANK=5 of 3 a rendezvous that
    waited out its timeout."""
    from accelopt.drivers.processes import under_torchrun
    from accelopt.errors import UserError

    with pytest.raises(UserError, match=re.escape(words)) as info:
        under_torchrun(env)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("env", [
    {"RANK": "3"},  # some schedulers export a RANK of their own
    {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},  # a job script's, for later ranks
    {"LOCAL_RANK": "0"},
    {},
])
def test_a_stray_variable_alone_leaves_a_local_run_alone(env):
    from accelopt.drivers.processes import under_torchrun

    assert under_torchrun(env) is False


def test_the_command_refuses_a_partial_torchrun_environment_before_running(tmp_path):
    from clirun import accelopt

    result = accelopt("run", *NODE_RUN, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                      RANK="1", WORLD_SIZE="3")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: RANK=1 and WORLD_SIZE=3 declare a torchrun launch but MASTER_ADDR and "
        "MASTER_PORT are not set; start the ranks with torchrun (it sets RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT), set the missing ones, or unset RANK and WORLD_SIZE "
        "for a local run"], result.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_rank_that_cannot_reach_the_rendezvous_says_so_in_one_line(tmp_path):
    """Its store client logged each failed connect with ~20 lines of C++ stack frames
    before the rank's one line."""
    from clirun import accelopt_cmd

    port = _free_port()  # nobody listens there
    result = subprocess.run(accelopt_cmd("run", *NODE_RUN, "cluster.timeout_s=1"),
                            cwd=tmp_path, env=_node_env(1, 2, port, TMPDIR=str(tmp_path)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: rank 1 could not join the other ranks through MASTER_ADDR=127.0.0.1 "
        f"MASTER_PORT={port} ("), result.stderr[-3000:]
