"""The PNGs that ``plugdist-bench --plot`` and the repository's benchmarks write beside their
tables: latency against size (ours against the comparison, log axes), bars of one number per
case, and the chaos soak's timeline.

matplotlib is the optional extra ``plugdist[plots]``; it is imported here, when a plot is asked
for, and nowhere else (:func:`require` says how to install it). Figures are drawn without pyplot
(no global state, no display needed). Each function saves ``path`` and returns the figure, whose
axes hold exactly the series plotted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["require", "latency_plot", "bar_plot", "timeline_plot", "INSTALL_HINT"]

INSTALL_HINT = "plots need matplotlib: pip install 'plugdist[plots]'"
_COLORS = ("#1565c0", "#c62828", "#2e7d32", "#6a1b9a", "#ef6c00", "#00838f")
_FAULT_COLORS = ("#c62828", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#5d4037", "#455a64")


def require() -> Any:
    """The Figure class, or RuntimeError with :data:`INSTALL_HINT` when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    return Figure


def _figure(width: float = 7.0, height: float = 4.2) -> Any:
    return require()(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig: Any, path: str | os.PathLike[str]) -> Any:
    fig.savefig(os.fspath(path), format="png")
    return fig


def _size_label(nbytes: float, _pos: Any = None) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def latency_plot(path: str | os.PathLike[str], title: str,
                 series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                 ylabel: str = "latency per op (us)") -> Any:
    """Latency against message size, one line per ``series`` item (label -> (bytes, values)),
    both axes logarithmic."""
    from matplotlib.ticker import FuncFormatter
    fig = _figure()
    ax = fig.add_subplot()
    for (label, (sizes, values)), color in zip(series.items(), _COLORS, strict=False):
        ax.plot(list(sizes), list(values), marker="o", markersize=3.5, label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.set_xlabel("message size (bytes per rank)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def bar_plot(path: str | os.PathLike[str], title: str, cases: Sequence[str],
             series: Mapping[str, Sequence[float]], ylabel: str, log: bool = True) -> Any:
    """One group of bars per case, one bar per ``series`` item (label -> a value per case; NaN:
    not measured), on a logarithmic axis unless ``log`` is False."""
    fig = _figure(max(7.0, 0.3 * len(cases) * len(series) + 2.5))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    for i, ((label, values), color) in enumerate(zip(series.items(), _COLORS, strict=False)):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, list(values), width, label=label, color=color)
    ax.set_xticks(range(len(cases)), list(cases))
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def timeline_plot(path: str | os.PathLike[str], title: str,
                  world: Sequence[tuple[float, int]], faults: Sequence[tuple[float, str]],
                  pauses: Sequence[tuple[float, float]],
                  steps: Sequence[tuple[float, int]]) -> Any:
    """A run over time (seconds from its start): the world's size (a step line), each fault a
    vertical line labelled with its kind, each pause (start, seconds) a shaded span, and the
    committed steps on a second axis."""
    fig = _figure(9.0, 4.2)
    ax = fig.add_subplot()
    if world:
        ts, sizes = zip(*world, strict=True)
        ax.step(ts, sizes, where="post", color=_COLORS[0], linewidth=2, label="world size")
        ax.set_ylim(0, max(sizes) + 1)
    for start, seconds in pauses:
        ax.axvspan(start, start + seconds, color="#ffcc80", alpha=0.5, linewidth=0)
    colors: dict[str, str] = {}   # a colour per kind, in order of first appearance
    top = ax.get_ylim()[1]
    for at, kind in faults:
        first = kind not in colors
        color = colors.setdefault(kind, _FAULT_COLORS[len(colors) % len(_FAULT_COLORS)])
        ax.axvline(at, color=color, linestyle="--", linewidth=1.6,
                   label=f"fault: {kind}" if first else None)
        ax.text(at, top * 0.98, f" {kind}", rotation=90, va="top", ha="right", fontsize=7,
                color=color)
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("world size")
    ax.set_title(title, fontsize=9)
    if steps:
        right = ax.twinx()
        st, sv = zip(*steps, strict=True)
        right.plot(st, sv, color=_COLORS[2], linewidth=1, label="committed steps")
        right.set_ylabel("committed steps")
        lines, labels = ax.get_legend_handles_labels()
        more, more_labels = right.get_legend_handles_labels()
        ax.legend(lines + more, labels + more_labels, loc="lower left", fontsize=8)
    else:
        ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)
