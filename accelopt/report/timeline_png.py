"""A static Gantt chart of a run's spans (``timeline.png``), for a glance without Perfetto.

Uses ``matplotlib.figure.Figure`` with the Agg canvas directly instead of ``pyplot``: pyplot
keeps global figure state and picks a GUI backend, which is wrong inside a library that may
run in a headless worker thread or next to a user's own plots.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelopt.atomic import atomic_open
from accelopt.records import RunRecord, Span

MAX_LEGEND_ENTRIES = 20
_BAR_HEIGHT = 0.8


def _colour_key(span: Span) -> str:
    """Colour by job so one job's iterations read as one colour across tracks."""
    return str(span.args.get("job", span.name))


def _colour(cmap, i: int):
    """tab20 in a fixed order, saturated hues first: tab20 alternates dark/light pairs of
    one hue, and neighbouring jobs should not look alike. Job k gets the same colour in
    every run."""
    return cmap((2 * i) % 20 + (i // 10) % 2)


def _row_labels(spans: list[Span]) -> list[tuple[str, str]]:
    """(process, track) rows in order of first appearance; top row is the first seen."""
    rows: dict[tuple[str, str], None] = {}
    for span in spans:
        rows.setdefault((span.process, span.track), None)
    return list(rows)


def _bars(spans: list[Span], rows: list[tuple[str, str]], pixel_s: float = 0.0):
    """Group spans by (row, colour key) so each group is one ``broken_barh`` call: a run
    with thousands of iterations then draws in milliseconds instead of one artist per span.

    Within a group, a span narrower than two pixels (``pixel_s`` seconds each) that starts
    less than a pixel after the previous bar ends is drawn as part of that bar: the picture
    is the same at the PNG's resolution, and a cluster run's tens of thousands of
    sub-millisecond transfers become a few hundred bars (the timeline of the default run
    drew in 0.41 s instead of 0.66 s). Wider spans keep their own bar and white edge."""
    index = {row: i for i, row in enumerate(rows)}
    groups: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for span in spans:
        width = max(0.0, span.end_s - span.start_s)
        groups[(index[(span.process, span.track)], _colour_key(span))].append((span.start_s, width))
    if pixel_s <= 0:
        return groups
    narrow = 2 * pixel_s
    merged: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for key, segments in groups.items():
        segments.sort()
        out: list[list[float]] = []
        for start, width in segments:
            if out:
                last = out[-1]
                end = last[0] + last[1]
                if start - end < pixel_s and (width < narrow or last[1] < narrow):
                    last[1] = max(end, start + width) - last[0]
                    continue
            out.append([start, width])
        merged[key] = [(a, b) for a, b in out]
    return merged


@dataclass
class TimelineLayout:
    """What :func:`draw` needs, computed without matplotlib: plain values only (strings,
    numbers, lists), so the drawing can happen in another process
    (:mod:`accelopt.report.renderer`) that receives it as JSON."""

    title: str
    labels: list[str]
    """One per row, top row first."""
    bars: list[tuple[int, int, list[tuple[float, float]]]]
    """(row, colour index, [(start s, width s), ...]) per group of bars."""
    legend: list[str]
    """The colour keys (jobs, or span names) in colour-index order; empty: no legend."""
    left: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> TimelineLayout:
        return cls(title=str(document["title"]), labels=[str(x) for x in document["labels"]],
                   bars=[(int(r), int(c), [(float(a), float(b)) for a, b in segs])
                         for r, c, segs in document["bars"]],
                   legend=[str(x) for x in document["legend"]], left=float(document["left"]))


FIG_WIDTH_IN = 11
DPI = 100


def _height_in(rows: int) -> float:
    return min(2.0 + 0.35 * max(rows, 1), 30.0)


def timeline_layout(record: RunRecord) -> TimelineLayout:
    """The chart of ``record``'s spans: one row per track, one colour per job."""
    spans = record.spans
    rows = _row_labels(spans)
    many_processes = len({p for p, _ in rows}) > 1
    labels = [f"{p}: {t}" if many_processes else t for p, t in rows]
    title = f"accelopt timeline: {Path(record.info.run_dir).name or record.info.run_dir}"
    if not spans:
        return TimelineLayout(title, [], [], [])
    # a cluster's spans name the job by its id ("00-tiny-mlp"), one process's by its name:
    # the legend names it as the jobs table does, in every mode
    named = {r.job.job_id: r.job.name for r in record.jobs}
    keys = list(dict.fromkeys(named.get(_colour_key(s), _colour_key(s)) for s in spans))
    colour = {k: i for i, k in enumerate(keys)}
    colour.update({job_id: colour[name] for job_id, name in named.items() if name in colour})
    left = min(0.0, min(s.start_s for s in spans))
    right = max(s.end_s for s in spans)
    pixel_s = (right - left) / (FIG_WIDTH_IN * DPI)  # the axis is narrower
    bars = [(row, colour[key], segments)
            for (row, key), segments in _bars(spans, rows, pixel_s).items()]
    return TimelineLayout(title, labels, bars, keys if len(keys) <= MAX_LEGEND_ENTRIES else [],
                          left)


def import_matplotlib() -> None:
    """Import what :func:`draw` draws with (~0.4 s on 2 cores), e.g. in a process that
    draws later (:mod:`accelopt.report.renderer`)."""
    from matplotlib import colormaps  # noqa: F401
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.collections import PolyCollection  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401
    from matplotlib.patches import Patch  # noqa: F401


def draw(layout: TimelineLayout, path: Path) -> Path:
    """Draw ``layout``; write the PNG atomically to ``path``."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    fig = Figure(figsize=(FIG_WIDTH_IN, _height_in(len(layout.labels))), dpi=DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(layout.title)
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("track")

    if not layout.labels:
        ax.text(0.5, 0.5, "no spans", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    else:
        cmap = colormaps["tab20"]
        _draw_bars(ax, layout, cmap)
        rows = len(layout.labels)
        ax.set_yticks(range(rows), labels=layout.labels)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xlim(left=layout.left)
        ax.grid(axis="x", alpha=0.3)
        if layout.legend:
            handles = [Patch(color=_colour(cmap, i), label=k) for i, k in enumerate(layout.legend)]
            ax.legend(
                handles=handles,
                loc="upper left",
                bbox_to_anchor=(1.01, 1.0),
                fontsize="small",
                title="job (or span)",
            )

    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png")
    return path


def _draw_bars(ax, layout: TimelineLayout, cmap) -> None:
    """Every bar of ``layout`` as one collection, the pixels ``broken_barh`` draws group by
    group: a collection per group costs its own autoscaling, ~0.1 s of a cluster run's
    ~0.4 s drawing. Thin white edges keep back-to-back iterations of one job distinguishable."""
    from matplotlib.collections import PolyCollection

    corners: list[tuple[tuple[float, float], ...]] = []
    faces = []
    for row, colour, segments in layout.bars:
        face = _colour(cmap, colour)
        bottom, top = row - _BAR_HEIGHT / 2, row + _BAR_HEIGHT / 2
        for start, width in segments:
            end = start + width
            corners.append(((start, bottom), (start, top), (end, top), (end, bottom)))
            faces.append(face)
    ax.add_collection(PolyCollection(corners, facecolors=faces, edgecolor="white",
                                     linewidth=0.4), autolim=True)
    ax.autoscale_view()


def plot_timeline(record: RunRecord, path: Path) -> Path:
    """Draw one row per track and one colour per job; write the PNG atomically to ``path``."""
    return draw(timeline_layout(record), path)
