"""CudaLanes' bookkeeping on a CPU, against a recording stand-in for torch's CUDA allocator
API: every begin is matched by an end and a release on the same pool, the thread's stream is
restored, and no pool is destroyed while any thread still routes to one (on a real GPU that
aborts the process; benchmarks/gpu/salus_check.py checks the real thing)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from accelopt_plugins.salus.cuda_lanes import CudaLanes

pytestmark = pytest.mark.timeout(30)


class FakeTorch:
    """Records the allocator calls CudaLanes makes; pools count how many objects are alive."""

    def __init__(self, stream_routing: bool = True) -> None:
        self.calls: list[tuple[str, int]] = []
        self.routing: set[int] = set()
        self.alive: set[int] = set()
        self.destroyed_while_routing = 0
        ids = itertools.count(1)
        fake = self
        self.default = SimpleNamespace(cuda_stream=0)
        self.current = self.default

        class Pool:
            def __init__(self) -> None:
                self.id = next(ids)
                fake.alive.add(self.id)

            def snapshot(self) -> list[dict]:
                return [{"total_size": 2 * 2**20}]

            def __del__(self) -> None:
                fake.alive.discard(self.id)
                if fake.routing:
                    fake.destroyed_while_routing += 1

        def begin(device: int, pool: int) -> None:
            fake.calls.append(("begin", pool))
            fake.routing.add(pool)

        def end(device: int, pool: int) -> None:
            fake.calls.append(("end", pool))
            fake.routing.discard(pool)

        def set_stream(stream: object) -> None:
            fake.current = stream

        c_api = {"_cuda_beginAllocateCurrentThreadToPool": begin,
                 "_cuda_endAllocateToPool": end,
                 "_cuda_releasePool": lambda device, pool: fake.calls.append(("release", pool))}
        if stream_routing:
            c_api["_cuda_beginAllocateCurrentStreamToPool"] = begin
        self._C = SimpleNamespace(**c_api)
        self.cuda = SimpleNamespace(
            MemPool=Pool, Stream=lambda: SimpleNamespace(cuda_stream=next(ids) + 1000,
                                                         synchronize=lambda: None),
            current_stream=lambda: fake.current, set_stream=set_stream,
            current_device=lambda: 0)


@pytest.mark.parametrize("stream_routing", [True, False])
def test_enter_exit_pair_up_and_restore_the_stream(stream_routing: bool) -> None:
    fake = FakeTorch(stream_routing)
    lanes = CudaLanes(fake)
    assert lanes.routing == ("stream" if stream_routing else "thread")
    lanes.enter("L0")
    assert fake.current is not fake.default and len(fake.routing) == 1
    lanes.exit()
    assert fake.current is fake.default and not fake.routing
    pool = fake.calls[0][1]
    assert fake.calls == [("begin", pool), ("end", pool), ("release", pool)]
    assert lanes.pool_peak == {"L0": 2 * 2**20} and "L0" in lanes.stream_ids
    lanes.exit()  # nothing entered on this thread: a no-op
    assert len(fake.calls) == 3


def test_a_failed_job_leaves_its_pool_even_after_its_lane_was_retired() -> None:
    fake = FakeTorch()
    lanes = CudaLanes(fake)
    lanes.enter("L0")
    lanes.retire("L0")  # the lane went away while this thread was still routing to it
    lanes.exit(synchronize=False)
    assert not fake.routing and fake.current is fake.default


def test_retired_pools_survive_until_close_and_close_waits_for_routing_threads() -> None:
    fake = FakeTorch()
    lanes = CudaLanes(fake)
    lanes.enter("L0")
    lanes.exit()
    lanes.retire("L0")
    lanes.enter("L1")  # another lane still routing: L0's pool must not be destroyed now
    assert len(fake.alive) == 2
    lanes.close()  # refused while L1 routes
    assert len(fake.alive) == 2 and fake.destroyed_while_routing == 0
    lanes.exit()
    lanes.close()
    assert not fake.alive and fake.destroyed_while_routing == 0
