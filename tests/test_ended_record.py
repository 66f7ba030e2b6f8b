"""The leader's record of ended jobs (``ended.json``): written whole, atomically, by lanes
ending and switching jobs on threads of their own."""

from __future__ import annotations

import threading

from accelopt.drivers.cluster.faults import ENDED_FILE, read_ended, record_ended


def test_each_write_of_the_ended_record_has_a_temp_file_of_its_own(tmp_path) -> None:
    """One fixed temp name (``.ended.json.tmp``): two lanes writing at once, one renamed it
    and the other's rename found nothing, failing the run (FileNotFoundError). Another
    writer's temp file in the way stands for that other writer here."""
    (tmp_path / f".{ENDED_FILE}.tmp").mkdir()  # another writer's, mid-write
    record_ended(tmp_path, {"a": {"status": "done"}})
    assert read_ended(tmp_path) == {"a": {"status": "done"}}


def test_writers_on_several_threads_leave_one_whole_record(tmp_path) -> None:
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def write(k: int) -> None:
        barrier.wait()
        try:
            for i in range(50):
                record_ended(tmp_path, {f"job{k}": {"iterations": i}})
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(read_ended(tmp_path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [ENDED_FILE]  # no temp file left behind
