"""PNG figures of training runs: the per-iteration breakdown (Fig. 1 style) and inline against
Conduit per workload (Fig. 11 style). Each is skipped, returning None, when matplotlib is not
installed (see :func:`conduit.report.pyplot`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from conduit.report import pyplot, save_figure, signed_percent
from conduit.workloads.breakdown import PHASES

PHASE_COLORS = {"rollout": "#4C72B0", "ingestion": "#DD8452", "delivery": "#C44E52",
                "update": "#55A868", "other": "#B0B0B0"}
MODE_COLORS = {"inline": "#8c8c8c", "conduit": "#C44E52"}


def change_label(before: float, after: float) -> str:
    """The relative change from ``before`` to ``after``, signed: ``"-30%"``, ``"+10%"``."""
    return signed_percent(after / before - 1.0)


def plot_breakdown(results: Mapping[str, Mapping[str, float]], path: str | Path, *,
                   title: str = "") -> Path | None:
    """Stacked per-iteration breakdown bars, one per run.

    Args:
        results: Label -> summary (``rollout``, ``ingestion``, ``delivery``, ``update``,
            ``other`` in seconds).
        path: PNG to write.
        title: Figure title.
    """
    plt = pyplot()
    if plt is None:
        return None
    labels = list(results)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(labels)))
    for row, label in enumerate(labels):
        s = results[label]
        left = 0.0
        total = sum(s.get(p, 0.0) for p in PHASES) or 1.0
        for p in PHASES:
            w = 1000 * s.get(p, 0.0)
            ax.barh(row, w, left=left, color=PHASE_COLORS[p], label=p if row == 0 else None)
            if w / (1000 * total) > 0.08:
                ax.text(left + w / 2, row, f"{100 * w / (1000 * total):.0f}%",
                        ha="center", va="center", fontsize=8, color="white")
            left += w
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("latency per iteration (ms, median)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_comparison(rows: Mapping[str, Mapping[str, Mapping[str, float]]],
                    path: str | Path) -> Path | None:
    """Per workload, inline and Conduit bars for the exposed path and end to end, each pair
    labelled with Conduit's relative change.

    Args:
        rows: Workload label -> ``{"inline": summary, "conduit": summary}``.
        path: PNG to write.
    """
    plt = pyplot()
    if plt is None:
        return None
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(names) + 2) * 2 / 1.5, 3.6))
    for ax, key, title in ((axes[0], "exposed", "Exposed experience path"),
                           (axes[1], "end_to_end", "End to end")):
        for j, mode in enumerate(MODE_COLORS):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            ys = [1000 * rows[n].get(mode, {}).get(key, 0.0) for n in names]
            ax.bar(xs, ys, width=0.38, color=MODE_COLORS[mode],
                   label="inline (sequential)" if mode == "inline" else "Conduit")
        for i, n in enumerate(names):
            a = rows[n].get("inline", {}).get(key)
            b = rows[n].get("conduit", {}).get(key)
            if a and b is not None and a > 0:
                ax.text(i, 1000 * max(a, b) * 1.02, change_label(a, b), ha="center",
                        fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel("latency per iteration (ms)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)
