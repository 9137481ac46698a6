"""The one way every loadgen scenario reports: tables on the terminal (rich), the same tables
in a markdown page with PNG plots (matplotlib) under --report DIR, every figure in --json,
and the targets each scenario checks, met or not.

A scenario builds a ScenarioReport (tables, figures, verdict, data) and calls finish().
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def plt():
    import matplotlib

    matplotlib.use("Agg")  # files, not windows
    import matplotlib.pyplot as pyplot

    return pyplot


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


@dataclass
class Figure:
    name: str  # file name without .png
    caption: str
    draw: Callable[[Any], Any]  # draw(pyplot) -> a matplotlib Figure


@dataclass
class ScenarioReport:
    name: str
    title: str
    intro: str = ""
    sections: list[Section] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    # Target name -> (met?, what was measured, in words).
    verdict: dict[str, tuple[bool, str]] = field(default_factory=dict)
    data: dict = field(default_factory=dict)

    def table(self, title: str, columns: list[str], rows: list[list[Any]],
              notes: list[str] = ()) -> None:
        self.sections.append(Section(title, columns, [[str(c) for c in r] for r in rows],
                                     list(notes)))

    def figure(self, name: str, caption: str, draw: Callable[[Any], Any]) -> None:
        self.figures.append(Figure(name, caption, draw))

    def target(self, name: str, met: bool, measured: str) -> None:
        self.verdict[name] = (bool(met), measured)

    # ------------------------------------------------------------------ output

    def rich_tables(self) -> list[Table]:
        tables = []
        for s in self.sections:
            t = Table(title=s.title)
            for i, col in enumerate(s.columns):
                t.add_column(col, justify="left" if i == 0 else "right")
            for row in s.rows:
                t.add_row(*row)
            tables.append(t)
        return tables

    def print(self, console: Console) -> None:
        for t in self.rich_tables():
            console.print(t)
        for s in self.sections:
            for note in s.notes:
                console.print(f"  {note}")
        for name, (met, measured) in self.verdict.items():
            mark = "[green]met[/green]" if met else "[red]NOT met[/red]"
            console.print(f"  target {name}: {mark} ({measured})")

    def markdown(self, images: dict[str, str]) -> str:
        lines = [f"# {self.title}", ""]
        if self.intro:
            lines += [self.intro, ""]
        lines += [f"Machine: {machine()}.", ""]
        if self.verdict:
            lines += ["| target | met | measured |", "|---|---|---|"]
            for name, (met, measured) in self.verdict.items():
                lines.append(f"| {name} | {'yes' if met else '**no**'} | {measured} |")
            lines.append("")
        for s in self.sections:
            lines += [f"## {s.title}", "", "| " + " | ".join(s.columns) + " |",
                      "|" + "---|" + "---:|" * (len(s.columns) - 1)]
            lines += ["| " + " | ".join(row) + " |" for row in s.rows]
            lines += [""] + [f"{n}  " for n in s.notes] + ([""] if s.notes else [])
        for f in self.figures:
            if f.name in images:
                lines += [f"![{f.caption}]({images[f.name]})", "", f"*{f.caption}*", ""]
        return "\n".join(lines)

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        pyplot = plt()
        images = {}
        for f in self.figures:
            fig = f.draw(pyplot)
            images[f.name] = f"{f.name}.png"
            fig.tight_layout()
            fig.savefig(directory / images[f.name], dpi=110)
            pyplot.close(fig)
        path = directory / "REPORT.md"
        path.write_text(self.markdown(images))
        return path

    def json(self) -> dict:
        return {"scenario": self.name, "machine": machine(), **self.data,
                "verdict": {k: {"met": m, "measured": s} for k, (m, s) in self.verdict.items()}}


def machine() -> str:
    import os

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, {platform.system()} {platform.release()}")


def finish(report: ScenarioReport, console: Console, json_path: Path | None,
           report_dir: Path | None, started: float | None = None) -> int:
    """Print the report, write --json and --report; 0 when every target is met."""
    report.print(console)
    if started is not None:
        console.print(f"({time.perf_counter() - started:.1f} s)")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.json(), indent=2) + "\n")
    if report_dir is not None:
        console.print(f"report: {report.write(Path(report_dir))}")
    return 0


def utilisation_series(samples: list[dict], link: str) -> tuple[list[float], list[float]]:
    """(times, utilisation 0..1) between consecutive samples of one link."""
    ts, us = [], []
    for a, b in zip(samples, samples[1:]):
        la, lb = a["links"].get(link), b["links"].get(link)
        if la is None or lb is None or b["t"] <= a["t"]:
            continue
        ts.append(b["t"])
        us.append((lb["bytes"] - la["bytes"]) / (lb["capacity"] * (b["t"] - a["t"])))
    return ts, us


def draw_utilisation(runs: dict[str, list[dict]], link_of: Callable[[str], str], title: str):
    """A figure drawer: link utilisation over time, one line per run."""
    def draw(pyplot):
        fig, ax = pyplot.subplots(figsize=(7, 3.2))
        for name, samples in runs.items():
            ts, us = utilisation_series(samples, link_of(name))
            if ts:
                ax.plot(ts, [u * 100 for u in us], label=name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("link utilisation (% of capacity)")
        ax.set_ylim(0, 120)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # no run moved anything over the link
            ax.text(0.5, 0.5, "nothing crossed the link", transform=ax.transAxes,
                    ha="center", va="center")
        return fig
    return draw


def label_bars(ax, bars, fmt: str = "{:,.0f}") -> None:
    """Each bar's value above it: a bar of 0 has no height, and without its label it is
    not there at all."""
    ax.bar_label(bars, labels=[fmt.format(b.get_height()) for b in bars], fontsize=7,
                 padding=2)
    ax.margins(y=0.15)
