"""Pictures of a :class:`Timeline`, simulated or measured: text, Chrome trace, PNG.

``ascii`` and ``chrome_trace`` are pure Python. ``png`` and ``png_side_by_side``
need matplotlib (``pip install fastpipe[plot]``), imported only when called.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from .actions import ActionKind
from .timeline import Event, Timeline

__all__ = ["ascii", "chrome_trace", "write_chrome_trace", "png", "png_side_by_side"]

MICROSECONDS_PER_UNIT = {"s": 1e6, "ms": 1e3, "us": 1.0, "µs": 1.0, "ns": 1e-3}
"""Trace time scale per timeline unit; any other unit (the simulator's abstract
``"units"``) maps 1 unit to 1000 µs, so a unit reads as 1 ms in the viewer."""

_DEFAULT_US_PER_UNIT = 1000.0
_IDLE = "."
_COLORS = {ActionKind.FORWARD: "#4c72b0", ActionKind.BACKWARD: "#dd8452",
           ActionKind.WEIGHT: "#55a868"}
_MAX_LABELS = 2000


# -- text ----------------------------------------------------------------------------


BAND = 100
"""Columns per band of a wrapped text timeline."""
_MAX_BANDS = 8


def ascii(timeline: Timeline, width: int | None = None) -> str:
    """Draw ``timeline`` as text: a header, then one row per stage.

    Each action starts with its kind letter and, where it has room, its micro-batch
    (and ``.chunk`` for chunks above 0), padded with spaces; idle time is ``.``.
    ``width``: the columns of the whole picture, in one band. Default: as many columns as
    make most actions' labels legible (``F3.1 B2``), wrapped into bands of 100 columns
    (at most 8), each headed by the time it starts at.
    """
    if width is not None and (isinstance(width, bool) or not isinstance(width, int)
                              or width < 1):
        raise ValueError(f"width must be an int >= 1 (or None to fit the labels), got {width!r}")
    columns = width if width is not None else _legible_columns(timeline)
    band = columns if width is not None else BAND
    label = len(f"stage {timeline.num_stages - 1}")
    rows = [_row(timeline, lane, columns) for lane in timeline.by_stage()]
    lines = [_header(timeline, columns)]
    for start in range(0, columns, band):
        if columns > band:
            at = timeline.makespan * start / columns
            lines.append(f"{'':<{label}}  from {at:.4g} {timeline.unit}:")
        for stage, row in enumerate(rows):
            lines.append(f"{f'stage {stage}':<{label}} |{row[start:start + band]}|")
    return "\n".join(lines)


def _legible_columns(timeline: Timeline) -> int:
    """Columns for the whole timeline such that three actions in four have room for their
    full label and a space, within the band limit."""
    durations = sorted(e.duration for e in timeline.events if e.duration > 0)
    if not durations or timeline.makespan <= 0:
        return BAND
    short = durations[len(durations) // 4]
    room = 1 + max(len(_full_label(e)) for e in timeline.events)
    wanted = int(-(-timeline.makespan * room // short))
    return max(min(BAND, wanted), min(wanted, BAND * _MAX_BANDS))


def _header(timeline: Timeline, width: int) -> str:
    scale = timeline.makespan / width
    return (
        f"{timeline.source} timeline: {timeline.num_stages} stages, "
        f"makespan {timeline.makespan:.6g} {timeline.unit}, "
        f"bubble {timeline.bubble_fraction:.1%}, 1 column = {scale:.3g} {timeline.unit}"
    )


def _row(timeline: Timeline, lane: tuple[Event, ...], width: int) -> str:
    cells = [_IDLE] * width
    scale = width / timeline.makespan if timeline.makespan > 0 else 0.0
    taken = 0
    for event in lane:
        first = max(taken, min(width - 1, round((event.start - timeline.start) * scale)))
        last = max(first + 1, min(width, round((event.end - timeline.start) * scale)))
        if first >= width:
            break
        cells[first:last] = _label(event, last - first)
        taken = last
    return "".join(cells)


def _full_label(event: Event) -> str:
    action = event.action
    text = f"{action.kind.value}{action.microbatch}"
    return f"{text}.{action.chunk}" if action.chunk else text


def _label(event: Event, room: int) -> str:
    action = event.action
    text = f"{action.kind.value}{action.microbatch}"
    for candidate in (_full_label(event), text):
        if len(candidate) <= room:
            return candidate.ljust(room)
    return action.kind.value.ljust(room)


# -- Chrome / Perfetto trace ----------------------------------------------------------------


def chrome_trace(timeline: Timeline, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The timeline as Chrome/Perfetto trace JSON: one lane (``tid``) per physical stage
    of process 0, one complete (``"X"``) event per action, times in µs from the first start.

    Seconds and other SI units convert exactly; abstract simulator units map
    1 unit to 1000 µs (see :data:`MICROSECONDS_PER_UNIT`). ``meta`` (JSON-able, e.g. the
    step's context for the doctor) goes to ``otherData.fastpipe``.
    """
    scale = MICROSECONDS_PER_UNIT.get(timeline.unit, _DEFAULT_US_PER_UNIT)
    events = _trace_metadata(timeline)
    for event in timeline.events:
        events.append({
            "ph": "X",
            "name": str(event.action),
            "cat": event.action.kind.name.lower(),
            "ts": (event.start - timeline.start) * scale,
            "dur": event.duration * scale,
            "pid": 0,
            "tid": event.stage,
            "args": _trace_args(event, timeline.unit),
        })
    other: dict[str, Any] = {"source": timeline.source, "unit": timeline.unit,
                             "microseconds_per_unit": scale}
    if meta is not None:
        other["fastpipe"] = dict(meta)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike[str],
                       meta: Mapping[str, Any] | None = None) -> None:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(chrome_trace(timeline, meta), file)


def _trace_metadata(timeline: Timeline) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
         "args": {"name": f"fastpipe {timeline.source}"}},
    ]
    for stage in range(timeline.num_stages):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": stage,
                       "args": {"name": f"stage {stage}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": stage,
                       "args": {"sort_index": stage}})
    return events


def _trace_args(event: Event, unit: str) -> dict[str, Any]:
    action = event.action
    return {"stage": event.stage, "kind": action.kind.value, "microbatch": action.microbatch,
            "chunk": action.chunk, "start": event.start, "end": event.end, "unit": unit}


# -- PNG -------------------------------------------------------------------------------


def png(timeline: Timeline, path: str | os.PathLike[str]) -> None:
    """Draw ``timeline`` as a Gantt chart PNG at ``path``: one row per stage, colored by
    action kind (lighter for higher chunks), labelled with the micro-batch where legible."""
    figure = _figure(rows=1, height=_height(timeline))
    _draw(figure.add_subplot(1, 1, 1), timeline)
    figure.savefig(path, format="png", dpi=100)


def png_side_by_side(simulated: Timeline, measured: Timeline, path: str | os.PathLike[str]) -> None:
    """Draw a simulated and a measured timeline in one PNG, one above the other, each on
    its own time axis, so their shapes can be compared."""
    figure = _figure(rows=2, height=_height(simulated) + _height(measured))
    _draw(figure.add_subplot(2, 1, 1), simulated)
    _draw(figure.add_subplot(2, 1, 2), measured)
    figure.savefig(path, format="png", dpi=100)


def _figure(rows: int, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "PNG output needs matplotlib: pip install matplotlib (or pip install fastpipe[plot])"
        ) from None
    return Figure(figsize=(12, height + 0.8 * rows), layout="constrained")


def _height(timeline: Timeline) -> float:
    return 1.0 + 0.45 * timeline.num_stages


def _draw(axes: Any, timeline: Timeline) -> None:
    """One broken bar per (stage, kind, chunk), so large timelines draw quickly."""
    groups: dict[tuple[int, ActionKind, int], list[tuple[float, float]]] = {}
    for event in timeline.events:
        key = (event.stage, event.action.kind, event.action.chunk)
        groups.setdefault(key, []).append((event.start - timeline.start, event.duration))
    for (stage, kind, chunk), spans in groups.items():
        axes.broken_barh(spans, (stage - 0.4, 0.8), facecolors=_COLORS[kind],
                         alpha=_shade(chunk), edgecolor="white", linewidth=0.5)
    if len(timeline.events) <= _MAX_LABELS:
        _label_microbatches(axes, timeline)
    axes.set_yticks(range(timeline.num_stages),
                    [f"stage {s}" for s in range(timeline.num_stages)])
    axes.set_ylim(timeline.num_stages - 0.5, -0.5)
    axes.set_xlim(0, timeline.makespan or 1.0)
    axes.set_xlabel(f"time ({timeline.unit})")
    axes.set_title(f"{timeline.source}: makespan {timeline.makespan:.4g} {timeline.unit}, "
                   f"bubble {timeline.bubble_fraction:.1%}")
    axes.legend(handles=_legend_handles(timeline), loc="upper left", bbox_to_anchor=(1.0, 1.0),
                fontsize=7, title="bar: micro-batch", title_fontsize=7)


def _label_microbatches(axes: Any, timeline: Timeline) -> None:
    for event in timeline.events:
        if event.duration >= timeline.makespan / 150:
            axes.text(event.start - timeline.start + event.duration / 2, event.stage,
                      str(event.action.microbatch), ha="center", va="center", fontsize=7)


def _shade(chunk: int) -> float:
    """Opacity of a bar of model chunk ``chunk``: later chunks lighter."""
    return 1.0 / (1 + 0.5 * chunk)


def legend_labels(timeline: Timeline) -> list[tuple[ActionKind, int, str]]:
    """(kind, chunk, label) of each legend entry: one per action kind, and with several
    model chunks per stage one per (kind, chunk), naming the chunk its shade stands for."""
    chunks = sorted({e.action.chunk for e in timeline.events}) or [0]
    entries = []
    for kind in _COLORS:
        for chunk in chunks:
            name = kind.name.lower()
            entries.append((kind, chunk, name if len(chunks) == 1 else
                            f"{name}, model chunk {chunk}" + (" (lighter)" if chunk else "")))
    return entries


def _legend_handles(timeline: Timeline) -> list[Any]:
    from matplotlib.patches import Patch

    return [Patch(facecolor=_COLORS[kind], alpha=_shade(chunk), label=label)
            for kind, chunk, label in legend_labels(timeline)]
