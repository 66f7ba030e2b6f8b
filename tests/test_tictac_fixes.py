"""tictac says what is wrong and what it cannot know: a wrong tuning grid named as such, a
grid given to a heuristic that never reads it, a chunk size too small for the model refused
before training, an order file's duplicated and missing names, a chunked prediction flagged
beside the measured iteration, and a sharded server's row about its own shard and link."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from accelopt_plugins.tictac.config import TictacConfig
from accelopt_plugins.tictac.plugin import MAX_CHUNKS, TictacPlugin
from test_tictac_cluster import SERVER, make_cfg, planned_with, server_plugin

from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _configure(**config) -> None:
    """``accelopt_configure`` of a plugin with ``config`` (raises its refusal)."""
    conf = TictacConfig(**config)
    TictacPlugin(conf).accelopt_configure(conf, make_cfg())


def test_a_negative_tuning_grid_entry_names_the_grid_not_the_valid_setting():
    """``credit_bytes=-1 tune_credits=[-5]`` was refused as "credit_bytes must be >= 0 ...",
    naming the valid setting."""
    with pytest.raises(ConfigError) as info:
        _configure(heuristic="priority", credit_bytes=-1, tune_credits=[-5])
    assert str(info.value).startswith("plugins.tictac.tune_credits=[-5] holds [-5]")
    assert "credit_bytes must" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^plugins\.tictac\.tune_partitions=\[0, -2\] holds"):
        _configure(heuristic="priority", partition_bytes=-1, tune_partitions=[0, -2])
    with pytest.raises(ConfigError, match=r"^plugins\.tictac\.credit_bytes must .*, not -3$"):
        _configure(heuristic="priority", credit_bytes=-3)


@pytest.mark.parametrize("key, value", [("tune_credits", []), ("tune_partitions", [0, 4096])])
def test_a_tuning_grid_with_a_heuristic_that_never_reads_it_is_refused(key, value):
    """``tune_credits=[]`` with heuristic=tac was accepted silently (credit_bytes was refused
    there, and tune_rounds=0)."""
    with pytest.raises(ConfigError, match=rf"^plugins\.tictac\.{key}=\[.*read by "
                                          r"heuristic=priority only, and heuristic=tac"):
        _configure(heuristic="tac", **{key: value})
    _configure(heuristic="tac", tune_credits=[0, 65536])  # the default is not a setting
    _configure(heuristic="priority", credit_bytes=-1, **{key: value or [0, 4096]})


def test_a_chunk_size_cutting_a_tensor_into_too_many_chunks_is_refused_before_training(
        tmp_path, monkeypatch):
    """64 B chunks of a 1 MiB tensor (16384 chunks) died after the 30 s timeout as a server
    "paused, stuck or overloaded"; the mlp's 4 KiB weight in 1 B chunks is 4096 chunks."""
    with pytest.raises(ConfigError) as info:
        server_plugin(tmp_path, monkeypatch, heuristic="priority", credit_bytes=1024,
                      partition_bytes=1)
    text = str(info.value)
    found = re.match(r"plugins\.tictac\.partition_bytes=1: chunks of 1 B cut tensor '(.+)' "
                     r"\((\d+) B\) into (\d+) chunks, more than the 1024 per tensor", text)
    assert found, text
    nbytes = int(found[2])
    assert int(found[3]) == nbytes > MAX_CHUNKS
    assert f"use chunk sizes >= {-(-nbytes // MAX_CHUNKS)} B" in text
    with pytest.raises(ConfigError, match=r"^plugins\.tictac\.tune_partitions=\[0, 2\]"):
        server_plugin(tmp_path, monkeypatch, heuristic="priority", credit_bytes=1024,
                      partition_bytes=-1, tune_partitions=[0, 2])
    server_plugin(tmp_path, monkeypatch, heuristic="priority", credit_bytes=1024,
                  partition_bytes=-(-nbytes // MAX_CHUNKS))  # the size it names is accepted


def test_an_order_file_names_its_duplicated_missing_and_unknown_tensors(tmp_path, monkeypatch):
    """A file naming one tensor twice and leaving one out said only "6 names vs 6
    parameters, or different names"."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="named")
    names = [r.tensor for r in records]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps([names[0], *names[:-1], "old.layer.weight"]))
    with pytest.warns(RuntimeWarning) as caught:
        server_plugin(tmp_path, monkeypatch, heuristic="named", order_file=str(edited))
    (text,) = [str(w.message) for w in caught if "order_file" in str(w.message)]
    assert (f"does not match the model's {len(names)} parameters (named more than once: "
            f"{names[0]}; missing: {names[-1]}; not in the model: old.layer.weight)") in text


def _fitted_priority(tmp_path, monkeypatch, **config) -> TictacPlugin:
    """A server's priority plugin whose warm-up measured a link of 1 MB/s and 5 ms per
    message (whole tensors), replanned with it at iteration 2, iterations 3 and 5 timed at
    50 ms."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="priority", **config)
    t = 0.0
    for nbytes in (4096, 128, 1024, 64, 2048, 256):
        end = t + 0.005 + nbytes / 1e6
        record = dataclasses.replace(records[0], nbytes=nbytes)
        plugin.accelopt_transfer_done(record=record, start_s=t, end_s=end)
        t = end
    plugin.accelopt_transfer_order(
        transfers=[dataclasses.replace(r, iteration=2) for r in records], destination=1)
    assert plugin.link is not None and plugin.link[0] == pytest.approx(0.005)
    for i in range(2, 6):
        plugin.tuner.record(i, 0.05)
    return plugin


def test_a_chunked_prediction_says_its_message_cost_was_fitted_on_whole_tensors(
        tmp_path, monkeypatch):
    """Chunks of 16 B were predicted at 2.4 s per iteration against 82 ms measured: the
    per-message cost fitted on whole tensors was charged to every chunk, and the row
    presented it as a prediction."""
    plugin = _fitted_priority(tmp_path, monkeypatch, credit_bytes=1024, partition_bytes=64)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert ("(credit 1024 B, chunks of 64 B; not a prediction for chunks: the per-message cost "
            "5.000 ms was fitted on whole tensors and is charged to each of") in row.summary
    assert "measured 50.000 ms (median of 2 timed iterations)" in row.summary
    whole = _fitted_priority(tmp_path, monkeypatch, credit_bytes=1024)
    (row,) = whole.accelopt_report_rows(run=None)
    assert "not a prediction" not in row.summary
    assert "measured 50.000 ms" in row.summary


def test_chunks_without_a_window_are_said_to_change_no_order(tmp_path, monkeypatch):
    """``partition_bytes=64 credit_bytes=0``: tensors were split, and the row said "chunks
    of 64 B per link (configured)" as if that scheduled anything."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="priority",
                                    credit_bytes=0, partition_bytes=64)
    plugin.accelopt_transfer_order(transfers=records, destination=1)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert ("credit 0 B, chunks of 64 B per link (configured; with no window every chunk "
            "starts when posted: the chunks change no order") in row.summary


def test_a_warm_up_that_measured_nothing_says_so_beside_the_assumed_link(tmp_path,
                                                                        monkeypatch):
    """With two servers, one server's row said "link 125.00 MB/s (default 1 Gbit/s)" while
    the other's said measured: its shard's warm-up gave too few arrivals to fit."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="priority",
                                    credit_bytes=0)
    for i in (0, 2):  # the warm-up passes with no arrival seen; the replan at 2 finds none
        plugin.accelopt_transfer_order(
            transfers=[dataclasses.replace(r, iteration=i) for r in records], destination=1)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert ("link 125.00 MB/s (default 1 Gbit/s; nothing measured: 0 arrivals on this "
            "server's links in the warm-up, too few") in row.summary


def test_a_sharded_servers_row_counts_its_own_shard(tmp_path, monkeypatch):
    """cluster.servers=2: each server's row said "its order is the default order (5
    tensors)", the whole model, of a server sending one tensor."""
    plugin, records = server_plugin(tmp_path, monkeypatch, heuristic="tac", force=True)
    plugin.cluster = dataclasses.replace(SERVER, servers=2)
    plugin.accelopt_transfer_order(transfers=records[:1], destination=1)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "its order is the default order (1 tensor of this server's shard)" in row.summary
    assert row.metrics["tensors"] == 1


def test_one_tensor_is_not_tensors(tmp_path):
    """A one-tensor model's row said "(1 tensors)"."""
    torch.manual_seed(0)
    plugin = planned_with(tmp_path, torch.nn.Linear(8, 4, bias=False), torch.randn(4, 8),
                          heuristic="tac", force=True)
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "its order is the default order (1 tensor);" in row.summary, row.summary
