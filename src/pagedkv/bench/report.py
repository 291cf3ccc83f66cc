"""The report layer every `pagedkv bench` command shares: markdown tables, JSON files, PNG plots, progress.

A bench module returns its figures as a JSON-able dict, renders them with `table`, describes its
charts as `Plot`s, and its `command` hands all three to `finish`, which prints the tables and
writes ``--json PATH`` and ``--plots DIR``. matplotlib is imported only when plots are written
(extra ``pagedkv[bench]``). `Progress` (`pagedkv.workloads.progress`) is re-exported for the benches.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.workloads.progress import Progress

__all__ = ["Plot", "Progress", "finish", "table", "write_json", "write_plots"]


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: `header`, the separator, one line per row (cells as given)."""
    lines = [f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
    lines += [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]
    return lines


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write `result` to `path` as indented JSON (parent directories created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


@dataclass
class Plot:
    """One chart: `series` values over `x` (categories for bars, numbers for lines); None is a gap."""

    name: str  # file name without ".png"
    title: str
    ylabel: str
    x: Sequence[Any]
    series: Mapping[str, Sequence[float | None]]
    kind: str = "bar"  # "bar" (grouped) or "line"
    xlabel: str = ""
    logx: bool = False
    hline: tuple[float, str] | None = None  # a horizontal reference line: (y, label)
    dashed: set[str] = field(default_factory=set)  # line series drawn dashed


def write_plots(plots: Iterable[Plot], directory: Path) -> list[Path]:
    """One PNG per `Plot` in `directory` (created); their paths. Needs matplotlib (``pagedkv[bench]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for plot in plots:
        fig, ax = plt.subplots(figsize=(7.2, 4.2))
        if plot.kind == "line":
            for label, ys in plot.series.items():
                points = [(x, y) for x, y in zip(plot.x, ys, strict=True) if y is not None]
                style = "--" if label in plot.dashed else "-"
                ax.plot([x for x, _ in points], [y for _, y in points], style, marker="o", label=label)
        else:
            width = 0.8 / max(len(plot.series), 1)
            for i, (label, ys) in enumerate(plot.series.items()):
                heights = [0.0 if y is None else y for y in ys]
                ax.bar([k + i * width for k in range(len(plot.x))], heights, width, label=label)
            ax.set_xticks([k + 0.4 - width / 2 for k in range(len(plot.x))], [str(x) for x in plot.x],
                          rotation=20 if len(plot.x) > 4 else 0, ha="right" if len(plot.x) > 4 else "center",
                          fontsize=7)  # fmt: skip
        if plot.hline is not None:
            ax.axhline(plot.hline[0], color="gray", linestyle=":", label=plot.hline[1])
        ax.set(xlabel=plot.xlabel, ylabel=plot.ylabel, title=plot.title)
        if plot.logx:
            ax.set_xscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(directory / f"{plot.name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def finish(args: argparse.Namespace, text: str, result: dict[str, Any],
           plots: Callable[[dict[str, Any]], list[Plot]] | None = None) -> None:  # fmt: skip
    """Print `text`; write `result` to ``args.json`` and ``plots(result)`` into ``args.plots`` when given."""
    print(text)
    if getattr(args, "json", None):
        write_json(args.json, result)
    if getattr(args, "plots", None) and plots is not None:
        for path in write_plots(plots(result), args.plots):
            print(f"wrote {path}")
