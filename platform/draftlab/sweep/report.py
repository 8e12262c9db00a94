"""Sweep results as files: the table (CSV) and the plots logged on the sweep's parent run.

A row is one trial: `family`, `k`, `depth`, `tree`, `tree_nodes`, `tau`, `speedup_vs_ar`,
`drafter_parameters` and optionally `tau_by_category` ({category: tau}), `eval/sim_accept_len`
and `params` ({swept field: its value}).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

COLUMNS = [
    "trial",
    "family",
    "k",
    "depth",
    "tree",
    "tree_nodes",
    "tau",
    "speedup_vs_ar",
    "drafter_parameters",
]


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """The results table, one line per trial, best speedup first."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: -r["speedup_vs_ar"]))
    return path


def pareto_front(rows: list[dict]) -> list[dict]:
    """Trials no other trial beats on both drafter size (smaller) and speedup (higher),
    by increasing size."""
    front, best = [], float("-inf")
    for r in sorted(rows, key=lambda r: (r["drafter_parameters"], -r["speedup_vs_ar"])):
        if r["speedup_vs_ar"] > best:
            front.append(r)
            best = r["speedup_vs_ar"]
    return front


def figure(ncols: int = 1):
    """(pyplot, figure, axes): one 6x4 in panel per column, for files only (Agg)."""
    import matplotlib  # noqa: PLC0415 -- `draftlab --help` imports this module

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- after `use("Agg")`

    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4))
    return plt, fig, axes


def finish(plt, fig, axes, path: Path) -> Path:
    """Grid and (where lines are labelled) a legend on every panel; save and close."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _save(plt, fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return finish(plt, fig, [ax], path)


def parameter_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """by_<field>.png for each numeric swept field of two or more values: the speedup, and the
    measured tau beside the simulated accept length on the training data's held-out split, of
    the best trial at each value (a scaling curve when the field is
    `train.time_budget_minutes` or `train.max_samples`)."""
    paths = []
    for key in sorted({k for r in rows for k in r.get("params") or {}}):
        best: dict[float, dict] = {}  # value -> the fastest trial there
        for r in rows:
            v = (r.get("params") or {}).get(key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                if v not in best or r["speedup_vs_ar"] > best[v]["speedup_vs_ar"]:
                    best[v] = r
        if len(best) < 2:
            continue
        xs = sorted(best)
        plt, fig, (left, right) = figure(ncols=2)
        left.plot(xs, [best[x]["speedup_vs_ar"] for x in xs], marker="o")
        left.set(title=f"Speedup vs {key}", xlabel=key, ylabel="speedup vs target-only")
        for field, label, color in (
            ("tau", "tau measured on the bench prompts", "C1"),
            ("eval/sim_accept_len", "simulated on the held-out split", "C2"),
        ):
            at = [x for x in xs if best[x].get(field) is not None]
            if at:
                right.plot(at, [best[x][field] for x in at], marker="o", color=color, label=label)
        right.set(title=f"Accept length vs {key}", xlabel=key, ylabel="tokens a target forward")
        right.legend()
        for ax in (left, right):
            if xs[-1] >= 4 * xs[0] > 0:  # minutes or samples doubling: even steps on a log axis
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the swept values, as written
        paths.append(finish(plt, fig, [left, right], out_dir / f"by_{key.replace('.', '_')}.png"))
    return paths


def write_plots(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """speedup_vs_k.png, speedup_vs_tree_budget.png, pareto.png, tau_by_category.png, then
    `parameter_plots`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    plt, fig, ax = figure()  # best tree per trained drafter, one line per (family, depth)
    lines: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        key = (r["family"], r["depth"])
        lines[key][r["k"]] = max(lines[key].get(r["k"], float("-inf")), r["speedup_vs_ar"])
    for (family, depth), by_k in sorted(lines.items()):
        ks = sorted(by_k)
        ax.plot(ks, [by_k[k] for k in ks], marker="o", label=f"{family}, depth {depth}")
    paths.append(
        _save(
            plt,
            fig,
            ax,
            out_dir / "speedup_vs_k.png",
            "Speedup vs K (best tree)",
            "K",
            "speedup vs ar",
        )
    )

    plt, fig, ax = figure()
    curves: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        curves[(r["family"], r["k"], r["depth"])].append((r["tree_nodes"], r["speedup_vs_ar"]))
    for (family, k, depth), pts in sorted(curves.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{family} K={k} d={depth}"
        )
    paths.append(
        _save(
            plt,
            fig,
            ax,
            out_dir / "speedup_vs_tree_budget.png",
            "Speedup vs tree size",
            "tree nodes",
            "speedup vs ar",
        )
    )

    plt, fig, ax = figure()
    ax.scatter(
        [r["drafter_parameters"] / 1e6 for r in rows],
        [r["speedup_vs_ar"] for r in rows],
        alpha=0.5,
        label="trials",
    )
    front = pareto_front(rows)
    ax.plot(
        [r["drafter_parameters"] / 1e6 for r in front],
        [r["speedup_vs_ar"] for r in front],
        "r-o",
        label="Pareto front",
    )
    paths.append(
        _save(
            plt,
            fig,
            ax,
            out_dir / "pareto.png",
            "Speedup vs drafter size",
            "drafter parameters (M)",
            "speedup vs ar",
        )
    )

    plt, fig, ax = figure()  # the best trial's tau per prompt category
    best = max(rows, key=lambda r: r["speedup_vs_ar"])
    cats = best.get("tau_by_category") or {}
    ax.bar(list(cats), list(cats.values()))
    ax.tick_params(axis="x", rotation=45)
    title = f"tau per category (K={best['k']}, depth {best['depth']}, {best['tree']})"
    paths.append(_save(plt, fig, ax, out_dir / "tau_by_category.png", title, "category", "tau"))
    return paths + parameter_plots(rows, out_dir)
