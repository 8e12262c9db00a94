"""Sweep result files: CSV order, the Pareto front, the four plots and one per swept number."""

import csv

from draftlab.sweep.report import pareto_front, write_csv, write_plots


def _row(k, depth, tree, nodes, speedup, params, **extra):
    return {
        "trial": f"k{k}-d{depth}-{tree}",
        "family": "parallel",
        "k": k,
        "depth": depth,
        "tree": tree,
        "tree_nodes": nodes,
        "tau": 1 + speedup / 2,
        "speedup_vs_ar": speedup,
        "drafter_parameters": params,
        **extra,
    }


ROWS = [
    _row(2, 1, "chain", 2, 1.10, 4_000_000),
    _row(2, 1, "searched-4", 4, 1.25, 4_000_000, tau_by_category={"math": 1.4, "coding": 1.9}),
    _row(4, 1, "chain", 4, 1.05, 4_100_000),
    _row(4, 2, "searched-4", 4, 1.20, 7_600_000),
    _row(4, 2, "chain", 4, 1.30, 7_600_000, tau_by_category={"math": 1.5, "coding": 2.1}),
]


def test_pareto_front_keeps_only_undominated_trials():
    front = pareto_front(ROWS)
    assert [(r["drafter_parameters"], r["speedup_vs_ar"]) for r in front] == [
        (4_000_000, 1.25),
        (7_600_000, 1.30),
    ]


def test_csv_is_sorted_by_speedup(tmp_path):
    with write_csv(ROWS, tmp_path / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [float(r["speedup_vs_ar"]) for r in table] == [1.30, 1.25, 1.20, 1.10, 1.05]
    assert table[0]["tree"] == "chain" and table[0]["depth"] == "2"


def test_plots_are_written_as_png(tmp_path):
    paths = write_plots(ROWS, tmp_path / "plots")
    assert [p.name for p in paths] == [
        "speedup_vs_k.png",
        "speedup_vs_tree_budget.png",
        "pareto.png",
        "tau_by_category.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_a_swept_number_gets_its_curve_of_speedup_and_accept_length(tmp_path):
    """Minutes 1, 2, 4 (two trees each: the faster one counts); the lr took one value and the
    family is not a number, so neither gets a plot."""
    point = {"train.lr": 1e-3, "drafter.family": "p-eagle"}
    rows = [
        _row(
            2, 1, tree, 2, 1.0 + m / 20 + extra, 4_000_000, **{"eval/sim_accept_len": 1.2 + m / 10}
        )
        | {"params": point | {"train.time_budget_minutes": m}}
        for m in (1, 2, 4)
        for tree, extra in (("chain", 0.0), ("searched-4", 0.01))
    ]
    paths = write_plots(rows, tmp_path / "plots")
    assert [p.name for p in paths][4:] == ["by_train_time_budget_minutes.png"]
    assert paths[4].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[4].stat().st_size > 5000
