"""bytecount: the bytes each tensor puts on the wire, per iteration, written to a CSV in the
run directory (an example of the plugin guide).

It observes ``accelopt_transfer_done``: called on the receiving rank once per transfer
(all-reduce: on every rank, for its own contribution), with ``record.wire_bytes``, what
crossed the link for it (header included), the figure the core sums into
``bytes_per_iteration``. Each rank writes ``bytecount-rank<N>.csv``; the rank comes from the
run's record (``RunInfo.rank``), never from the environment. Summed over the ranks, an
iteration's rows equal the core's per-iteration total.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from accelopt import PluginSpec, ReportRow, RunInfo, TransferRecord, hookimpl
from accelopt.types import INERT

COLUMNS = ("rank", "job", "iteration", "tensor", "kind", "source", "destination",
           "transfers", "wire_bytes")


class ByteCount:
    """One per process: every job's transfers that arrive here."""

    def __init__(self, config: object) -> None:
        self.rows: dict[tuple[str, int, str, str, int, int], list[int]] = defaultdict(
            lambda: [0, 0])
        self.path: Path | None = None
        self.rank = 0
        self.mode = "none"

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.rank, self.mode = run.rank, run.cluster.mode
        name = "bytecount.csv" if run.world_size == 1 else f"bytecount-rank{run.rank}.csv"
        self.path = Path(run.run_dir) / name if run.run_dir else None

    @hookimpl
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float,
                               end_s: float) -> None:
        key = (record.job_id, record.iteration, record.tensor, record.kind, record.source,
               record.destination)
        row = self.rows[key]
        row[0] += 1
        row[1] += record.wire_bytes

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(COLUMNS)
            for (job, it, tensor, kind, src, dst), (n, nbytes) in sorted(self.rows.items()):
                writer.writerow([self.rank, job, it, tensor, kind, src, dst, n, nbytes])

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        if self.mode == "none":
            # inert: it changed nothing, so a measured difference is noise, not its gain
            return [ReportRow("bytecount", "no transfers in a one-process run "
                              "(cluster.mode=none); nothing counted", {INERT: 1})]
        total = sum(nbytes for _, nbytes in self.rows.values())
        tensors = len({(k[0], k[2]) for k in self.rows})
        return [ReportRow("bytecount",
                          f"rank {self.rank} received {total} wire bytes over {tensors} "
                          f"tensors; per tensor and iteration in {self.path}",
                          {"rank": self.rank, "wire_bytes": total})]


PLUGIN = PluginSpec(
    name="bytecount",
    factory=ByteCount,
    description="Writes the wire bytes of every transfer, per tensor and iteration, to a CSV.",
)
