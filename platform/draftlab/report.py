"""`draftlab report SOURCE`: one self-contained HTML page (inline CSS, plots as base64 PNG)
and its Markdown twin, for a sweep, a pipeline or an MLflow run, logged back to that run
under `report/`.

SOURCE is a directory or an MLflow run id:

    <storage>/sweeps/<name>/        results/summary.json (+ its plots and results.csv)
    .draftlab/pipelines/<name>/     summary.json, bench.json, profile.json, sweep/
    <drafter dir>                   training.json (the training curve) of `draftlab distill`
    <run id>                        the same files among its artifacts; a distillation run has
                                    bench.json and training.json, a sweep trial bench.json

The page is built once as a list of blocks (heading, paragraph, note, table, image) and
rendered twice, so the two files always say the same thing. A section appears only when
its input exists; the missing inputs are listed at the top.
"""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

from draftlab.bench_report import speedup_text
from draftlab.sweep.report import figure, finish, write_plots
from draftlab.tracking import Tracker

RUN_ID = re.compile(r"[0-9a-f]{32}")  # what MLflow run ids look like
# The artifacts a report reads (a distillation run's drafter/ weights are not downloaded).
RUN_ARTIFACTS = ("summary.json", "bench.json", "profile.json", "training.json", "sweep", "results")
SWEEP_PLOTS = (
    "speedup_vs_k.png",
    "speedup_vs_tree_budget.png",
    "pareto.png",
    "tau_by_category.png",
)
SWEEP_COLUMNS = (
    "trial",
    "family",
    "k",
    "depth",
    "tree",
    "tree_nodes",
    "tau",
    "speedup_vs_ar",
    "tokens_per_s",
    "draft_ms",
    "verify_ms",
    "drafter_parameters",
    "train_steps",
    "greedy_identical",
)
CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;\
margin:2em auto;padding:0 1em;color:#222}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:14px;max-width:100%}
td,th{overflow-wrap:anywhere}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}
.note{background:#fff6e0;border-left:4px solid #e0a000;padding:.5em 1em}
figure{display:inline-block;margin:0 1em 1em 0;vertical-align:top}img{max-width:560px}
figcaption{font-size:13px;color:#555}"""


# ----------------------------------------------------------------------------- entry point


def write_report(
    source: str, out_dir: str | None = None, tracking_uri: str | None = None, log: bool = True
) -> dict:
    """Write `report.html`, `report.md` and `plots/` into `out_dir` (default `<source>/report`,
    for a run id `./.draftlab/reports/<run_id>`); log them to the source's MLflow run unless
    `log=False`. Returns {"html": path, "markdown": path, "logged_to": run id or None}."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _write(
            path, source, Path(out_dir) if out_dir else path / "report", tracking_uri, log, None
        )
    if path.exists() or not RUN_ID.fullmatch(source):
        raise ValueError(
            f"report source {source!r} is neither a directory nor an MLflow run id: pass a sweep "
            "directory (<storage>/sweeps/<name>), a pipeline directory "
            "(.draftlab/pipelines/<name>) or a run id (32 hex characters)"
        )

    tracker = Tracker(tracking_uri, run_id=source)
    if not tracker.run_exists():
        raise ValueError(f"report source {source!r}: no such MLflow run in {tracker.tracking_uri}")
    out = Path(out_dir) if out_dir else Path(".draftlab/reports") / source
    with tempfile.TemporaryDirectory(prefix="draftlab-report-") as tmp:
        tracker.download_artifacts(tmp, RUN_ARTIFACTS)
        return _write(Path(tmp), source, out, tracker.tracking_uri, log, source)


def _write(
    root: Path, label: str, out: Path, tracking_uri: str | None, log: bool, run_id: str | None
) -> dict:
    inputs = find_inputs(root)
    if not any(inputs[k] for k in ("pipeline", "sweep", "bench", "profile", "training")):
        raise ValueError(
            f"report source {label!r} holds no report input: none of summary.json, "
            "results/summary.json, sweep/summary.json, bench.json, profile.json, training.json"
        )
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    title, blocks = build(inputs, label, plots)
    (out / "report.html").write_text(to_html(title, blocks))
    (out / "report.md").write_text(to_markdown(title, blocks, out))
    result = {
        "html": str(out / "report.html"),
        "markdown": str(out / "report.md"),
        "logged_to": None,
    }
    run_id = (
        run_id
        or (inputs["pipeline"] or {}).get("mlflow_run_id")
        or (inputs["sweep"] or {}).get("mlflow_parent_run_id")
    )
    if log and run_id:
        tracker = Tracker(tracking_uri, run_id=run_id)
        if (
            tracker.run_exists()
        ):  # a directory copied from another machine may name a run not in this store
            tracker.log_artifacts(out, "report")
            result["logged_to"] = run_id
    return result


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def find_inputs(root: Path) -> dict:
    """The pipeline summary, sweep summary (+ the folder of its plots), bench and profile
    reports under `root`; None for each one that is not there."""
    top = _read(root / "summary.json")
    sweep_file = next(
        (
            p
            for p in (root / "results" / "summary.json", root / "sweep" / "summary.json")
            if p.is_file()
        ),
        None,
    )
    if top is not None and "rows" in top:  # `root` is a sweep's results folder itself
        sweep_file = root / "summary.json"
    return {
        "pipeline": top if top is not None and "rows" not in top else None,
        "sweep": _read(sweep_file) if sweep_file else None,
        "sweep_dir": sweep_file.parent if sweep_file else None,
        "bench": _read(root / "bench.json"),
        "profile": _read(root / "profile.json"),
        "training": _read(root / "training.json"),
    }


# ----------------------------------------------------------------------------- sections


def build(inputs: dict, label: str, plots: Path) -> tuple[str, list[tuple]]:
    """(title, blocks); a block is ("h2"|"p"|"note", text), ("table", headers, rows) or
    ("img", png path, caption)."""
    pipe, sweep, bench, prof = (inputs[k] for k in ("pipeline", "sweep", "bench", "profile"))
    what = (
        f"pipeline {pipe.get('name', '?')}"
        if pipe
        else f"sweep {sweep.get('sweep', '?')}"
        if sweep
        else f"bench of {bench.get('target', '?')}"
        if bench
        else f"profile of {prof.get('target', '?')}"
        if prof
        else "training curve"
    )
    missing = [
        f"{name} is missing: no {gives}."
        for name, have, gives in (
            ("The sweep summary (results/summary.json)", sweep, "sweep table or sweep plots"),
            (
                "The bench report (bench.json)",
                bench,
                "per-category speedups, HF comparison or per-position acceptance",
            ),
            ("The cost profile (profile.json)", prof, "t_target(n) table or drafter costs"),
        )
        if not have
    ]
    verdict = (bench or {}).get("verdict")
    blocks: list[tuple] = (
        _verdict(bench, plots) if verdict else []
    )  # the first screen: what won, where
    blocks += [("h2", "Run")] if verdict else []
    blocks.append(("table", ("field", "value"), _header_rows(inputs, label)))
    blocks += [("note", m) for m in missing]
    blocks += _champion(pipe, sweep)
    if sweep:
        blocks += _sweep(sweep, inputs["sweep_dir"], plots)
    if not verdict and (bench or (sweep and _best(sweep).get("tau_by_category"))):
        blocks += _categories(bench, sweep)
    if bench:
        blocks += _comparison(bench) + _acceptance(bench)
    if prof:
        blocks += _profile(prof, plots)
    if inputs["training"]:
        blocks += _training(inputs["training"], plots)
    return f"draftlab report: {what}", blocks


def _verdict(bench: dict, plots: Path) -> list[tuple]:
    """The served configuration against every contender in the deploy engine: speedup vs
    vllm_ar at each load level and per prompt kind (one request at a time), and the
    speedup-vs-concurrency plot."""
    v, methods, load = bench["verdict"], bench["methods"], bench.get("load") or {}
    contenders = [m for m in methods if m.startswith("vllm_")]
    levels = sorted({int(c) for rows in load.values() for c in rows})
    blocks: list[tuple] = [
        ("h2", f"Verdict: deploy {v['served']}"),
        ("p", v["reason"] + "."),
        ("table", ("deploy setting", "value"), [[k, val] for k, val in v["deploy"].items()]),
    ]
    if levels:
        rows = [
            [
                m + (" (served)" if m == v["served"] else ""),
                *(
                    _speedup((load.get(m, {}).get(str(c)) or {}).get("speedup_vs_vllm_ar"), 1.0)
                    for c in levels
                ),
            ]
            for m in contenders
        ]
        blocks += [
            (
                "p",
                "Output tokens/s against vLLM target-only (vllm_ar) with that many requests in "
                f"flight (closed loop, {bench['prompts']} prompts cycled). The served "
                "configuration drafts only at the loads where it won: its batch-size schedule is "
                "in the deploy settings.",
            ),
            ("table", ("contender", *(f"{c} in flight" for c in levels)), rows),
        ]
    kinds = sorted({cat for m in contenders for cat in methods[m].get("by_category", {})})
    rows = [
        [
            cat,
            *(
                speedup_text(methods[m]["by_category"].get(cat, {}), "speedup_vs_vllm_ar")
                for m in contenders
            ),
        ]
        for cat in kinds
    ]
    blocks += [
        (
            "p",
            "Per prompt kind, one request at a time, against vllm_ar (with several passes, "
            "their range in brackets: a kind's few prompts spread wider than all of them):",
        ),
        ("table", ("kind", *(m.removeprefix("vllm_") for m in contenders)), rows),
    ]
    if len(levels) > 1:
        blocks.append(
            (
                "img",
                _load_plot(
                    load, contenders, levels, v["served"], plots / "speedup_vs_concurrency.png"
                ),
                "speedup vs concurrency (x vllm_ar)",
            )
        )
    return blocks


def _load_plot(
    load: dict, contenders: list[str], levels: list[int], served: str, path: Path
) -> Path:
    plt, fig, ax = figure()
    for m in contenders:
        ys = [(load.get(m, {}).get(str(c)) or {}).get("speedup_vs_vllm_ar") for c in levels]
        ax.plot(levels, ys, marker="o", label=m, linewidth=3 if m == served else 1.2)
    ax.axhline(1.0, color="#888", linestyle="--", linewidth=1)
    ax.set(
        xscale="log",
        xlabel="requests in flight",
        ylabel="output tokens/s / vllm_ar's",
        xticks=levels,
    )
    ax.set_xticklabels([str(c) for c in levels])
    ax.minorticks_off()
    return finish(plt, fig, [ax], path)


def _header_rows(inputs: dict, label: str) -> list[list]:
    pipe, sweep, bench, prof = (inputs[k] for k in ("pipeline", "sweep", "bench", "profile"))
    rows = [["source", label], ["generated", time.strftime("%Y-%m-%d %H:%M:%S %Z")]]
    if sweep:
        rows += [["sweep", sweep.get("sweep")], ["sweep wall s", sweep.get("wall_s")]]
    for key in ("target", "drafter", "device", "torch", "prompts", "max_new_tokens", "temperature"):
        if bench and key in bench:
            rows.append([f"bench {key}", bench[key]])
    if prof:
        rows += [["profile device", prof.get("device")], ["profile dtype", prof.get("dtype")]]
    return rows


def _best(sweep: dict) -> dict:
    rows = sweep.get("rows") or []
    return sweep.get("best") or (
        max(rows, key=lambda r: r.get("speedup_vs_ar") or 0) if rows else {}
    )


def _champion(pipe: dict | None, sweep: dict | None) -> list[tuple]:
    blocks: list[tuple] = [("h2", "Champion")]
    champ = (pipe or {}).get("champion") or (sweep or {}).get("champion")
    best = _best(sweep) if sweep else {}
    if champ:
        blocks.append(("table", ("field", "value"), [[k, v] for k, v in champ.items()]))
    if best:
        blocks += [
            ("p", "Best sweep trial (highest measured speedup vs ar):"),
            (
                "table",
                ("field", "value"),
                [[k, best.get(k)] for k in (*SWEEP_COLUMNS, "mlflow_run_id")],
            ),
        ]
    if not champ and not best:
        blocks.append(
            ("note", "No champion: neither a pipeline summary nor a sweep with finished trials.")
        )
    if pipe and pipe.get("stages"):
        blocks += [
            ("h2", "Pipeline stages"),
            (
                "table",
                ("stage", "status", "wall s"),
                [[s, v.get("status"), v.get("wall_s")] for s, v in pipe["stages"].items()],
            ),
        ]
    endpoint = (pipe or {}).get("endpoint")
    if isinstance(endpoint, dict):  # what `draftlab serve` deployed: url, model, ...
        blocks += [
            ("h2", "Endpoint"),
            ("table", ("field", "value"), [[k, v] for k, v in endpoint.items()]),
        ]
    elif endpoint:
        blocks += [("h2", "Endpoint"), ("p", str(endpoint))]
    return blocks


def _sweep(sweep: dict, src: Path, plots: Path) -> list[tuple]:
    rows = sorted(sweep.get("rows") or [], key=lambda r: -(r.get("speedup_vs_ar") or 0))
    blocks: list[tuple] = [
        ("h2", "Sweep trials"),
        (
            "p",
            f"{sweep.get('trials_done', len(rows))} of "
            f"{sweep.get('trials', len(rows))} trials finished, best speedup first.",
        ),
    ]
    if not rows:
        return blocks + [("note", "No trial of this sweep finished: no table or plots.")]
    blocks.append(("table", SWEEP_COLUMNS, [[r.get(c) for c in SWEEP_COLUMNS] for r in rows]))
    if sweep.get("not_finished"):
        blocks.append(
            (
                "table",
                ("trial (not finished)", "status", "step", "error"),
                [
                    [o.get("trial"), o.get("status"), o.get("step"), o.get("error")]
                    for o in sweep["not_finished"]
                ],
            )
        )
    if all((src / name).is_file() for name in SWEEP_PLOTS):
        names = [*SWEEP_PLOTS, *sorted(p.name for p in src.glob("by_*.png"))]  # + swept fields
        for name in names:
            shutil.copyfile(src / name, plots / name)
    else:  # a summary without its plots (copied alone): draw them again from the rows
        names = [p.name for p in write_plots(rows, plots)]
    return blocks + [
        ("img", plots / name, name.removesuffix(".png").replace("_", " ")) for name in names
    ]


def _categories(bench: dict | None, sweep: dict | None) -> list[tuple]:
    methods = (bench or {}).get("methods", {})
    ar = methods.get("ar", {}).get("by_category", {})
    others = [m for m in methods if m != "ar"]
    best_tau = _best(sweep).get("tau_by_category") or {} if sweep else {}
    headers = ["category", "ar tokens/s", *(f"{m} {x}" for m in others for x in ("tau", "speedup"))]
    headers += ["sweep best tau"] if best_tau else []
    rows = []
    for cat in sorted(set(ar) | set(best_tau)):
        ar_tps = ar.get(cat, {}).get("tokens_per_s")
        row = [cat, ar_tps]
        for m in others:
            c = methods[m].get("by_category", {}).get(cat, {})
            row += [c.get("tau"), _speedup(c.get("tokens_per_s"), ar_tps)]
        rows.append(row + ([best_tau.get(cat)] if best_tau else []))
    blocks: list[tuple] = [
        ("h2", "Per-category tau and speedup"),
        (
            "p",
            "Speedup per category = the method's tokens/s / ar's tokens/s on that category's "
            "prompts.",
        ),
    ]
    if not bench:
        blocks.append(
            ("note", "No bench report: only the sweep's best trial tau per category is shown.")
        )
    return blocks + [("table", headers, rows)]


def _speedup(tps: float | None, ar_tps: float | None) -> str | None:
    return f"{tps / ar_tps:.2f}x" if tps is not None and ar_tps else None


def _comparison(bench: dict) -> list[tuple]:
    greedy = not bench.get(
        "temperature"
    )  # output is only compared with ar's when decoding greedily
    rows = []
    for m, s in bench["methods"].items():
        if m == "ar":
            same = "reference"
        elif not greedy:
            same = "n/a (sampling)"
        elif m == "hf_generate":
            same = bench.get("hf_generate_matches_ar")
        elif m.startswith("draftlab_"):
            same = bench.get("greedy_identical")
        else:
            same = "not checked"
        rows.append(
            [
                m,
                s.get("tokens_per_s"),
                s.get("tau"),
                _speedup(s.get("speedup_vs_ar"), 1.0),
                same,
                s.get("draft_s"),
                s.get("verify_s"),
            ]
        )
    return [
        ("h2", "Comparison with HF generate and HF prompt lookup"),
        (
            "p",
            "Same prompts and sampling in one process, methods interleaved prompt by prompt; "
            "speedup is relative to draftlab's KV-cached target-only loop (ar). greedy identical: "
            "output equals ar's.",
        ),
        (
            "table",
            (
                "method",
                "tokens/s",
                "tau",
                "speedup vs ar",
                "greedy identical",
                "draft s",
                "verify s",
            ),
            rows,
        ),
    ]


def _acceptance(bench: dict) -> list[tuple]:
    acc = {
        m: s["per_position_acceptance"]
        for m, s in bench["methods"].items()
        if s.get("per_position_acceptance")
    }
    if not acc:
        return [
            ("h2", "Per-position acceptance"),
            ("note", "The bench report has no speculative method."),
        ]
    width = max(len(a) for a in acc.values())
    rows = [[j + 1, *(a[j] if j < len(a) else None for a in acc.values())] for j in range(width)]
    return [
        ("h2", "Per-position acceptance"),
        (
            "p",
            "Fraction of verify rounds that accepted at least this many draft tokens (mean over "
            "prompts).",
        ),
        ("table", ("position", *acc), rows),
    ]


def _training(curve: dict, plots: Path) -> list[tuple]:
    evals = curve.get("evaluations") or []
    blocks: list[tuple] = [
        ("h2", "Training curve: what more training buys"),
        (
            "p",
            f"Held-out evaluations of the run: simulated accept length of a K={curve.get('k')} "
            "chain, and its predicted speedup with this hardware's costs measured at the end "
            f"(decode {_fmt(curve.get('decode_ms'))} ms, verify "
            f"{_fmt(curve.get('verify_chain_ms'))} ms, draft {_fmt(curve.get('draft_ms'))} ms, "
            f"context {curve.get('context')}).",
        ),
    ]
    if not evals:
        return blocks + [
            ("note", "The run made no held-out evaluation (train.eval_every beyond its steps).")
        ]
    keys = ("step", "minutes", "tokens", "sim_accept_len", "predicted_speedup")
    blocks.append(("table", keys, [[e.get(k) for k in keys] for e in evals]))
    return blocks + [("img", _training_plot(evals, plots / "training_curve.png"), "training curve")]


def _training_plot(evals: list[dict], path: Path) -> Path:
    plt, fig, axes = figure(ncols=2)
    for ax, x, label in (
        (axes[0], "minutes", "training minutes"),
        (axes[1], "tokens", "training tokens"),
    ):
        xs = [e[x] for e in evals]
        ax.plot(
            xs, [e["sim_accept_len"] for e in evals], marker="o", label="sim. accept len (held out)"
        )
        ax.plot(
            xs,
            [e["predicted_speedup"] for e in evals],
            marker="s",
            label="predicted speedup (chain)",
        )
        ax.set(xlabel=label)
    return finish(plt, fig, list(axes), path)


def _profile(prof: dict, plots: Path) -> list[tuple]:
    t = prof.get("target_forward_ms") or {}
    ns = sorted(t, key=int)
    base = t.get("1")
    rows = [[int(n), t[n], f"{t[n] / base:.2f}x" if base else None, t[n] / int(n)] for n in ns]
    drafters = prof.get("drafter_ms") or {}
    ks = sorted({k for by_d in drafters.values() for by_k in by_d.values() for k in by_k}, key=int)
    drows = [
        [family, int(d), *(by_k.get(k) for k in ks)]
        for family, by_d in drafters.items()
        for d, by_k in by_d.items()
    ]
    return [
        ("h2", "Cost profile"),
        (
            "p",
            f"One target forward of n new tokens over {prof.get('context')} cached tokens (the "
            f"verify cost of an n-node tree), median of {prof.get('repeats')} repeats on "
            f"{prof.get('device')}.",
        ),
        ("table", ("n", "t_target ms", "vs n=1", "ms per token"), rows),
        (
            "p",
            "One drafting round of k tokens, ms, by drafter family and depth (untrained weights: "
            "cost only).",
        ),
        ("table", ("family", "depth", *(f"k={k}" for k in ks)), drows),
        ("img", _profile_plot(prof, plots / "cost_profile.png"), "cost profile"),
    ]


def _profile_plot(prof: dict, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 -- the CLI imports this module

    plt, fig, (left, right) = figure(ncols=2)
    t = prof.get("target_forward_ms") or {}
    ns = sorted(t, key=int)
    left.plot([int(n) for n in ns], [t[n] for n in ns], marker="o")
    left.set_xscale("log", base=2)
    left.set_xticks([int(n) for n in ns], labels=ns)
    left.set_ylim(bottom=0)  # noise between similar costs should not look like a trend
    left.set(title="target verify cost t(n)", xlabel="new tokens n (tree nodes)", ylabel="ms")
    for family, by_d in (prof.get("drafter_ms") or {}).items():
        for d, by_k in by_d.items():
            ks = sorted(by_k, key=int)
            right.plot(
                [int(k) for k in ks],
                [by_k[k] for k in ks],
                marker="o",
                label=f"{family}, depth {d}",
            )
    right.set_ylim(bottom=0)
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set(title="drafting round cost", xlabel="K (draft tokens)", ylabel="ms")
    return finish(plt, fig, [left, right], path)


# ----------------------------------------------------------------------------- rendering


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1 else f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, dict | list):
        return json.dumps(v)
    return str(v)


def to_html(title: str, blocks: list[tuple]) -> str:
    e = html.escape
    out = [
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{e(title)}</title>',
        f"<style>{CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    for kind, *rest in blocks:
        if kind in ("h2", "p"):
            out.append(f"<{kind}>{e(rest[0])}</{kind}>")
        elif kind == "note":
            out.append(f'<p class="note">{e(rest[0])}</p>')
        elif kind == "table":
            head = "".join(f"<th>{e(str(h))}</th>" for h in rest[0])
            body = "".join(
                "<tr>" + "".join(f"<td>{e(_fmt(c))}</td>" for c in row) + "</tr>" for row in rest[1]
            )
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(Path(rest[0]).read_bytes()).decode("ascii")
            out.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{e(rest[1])}">'
                f"<figcaption>{e(rest[1])}</figcaption></figure>"
            )
    return "\n".join([*out, "</body></html>\n"])


def to_markdown(title: str, blocks: list[tuple], out_dir: Path) -> str:
    def cell(v) -> str:
        return _fmt(v).replace("|", "\\|").replace("\n", " ")

    lines = [f"# {title}", ""]
    for kind, *rest in blocks:
        if kind == "h2":
            lines += [f"## {rest[0]}", ""]
        elif kind == "p":
            lines += [rest[0], ""]
        elif kind == "note":
            lines += [f"> **Note:** {rest[0]}", ""]
        elif kind == "table":
            lines.append("| " + " | ".join(cell(h) for h in rest[0]) + " |")
            lines.append("|" + "|".join("---" for _ in rest[0]) + "|")
            lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rest[1]]
            lines.append("")
        elif kind == "img":
            lines += [f"![{rest[1]}]({Path(rest[0]).relative_to(out_dir).as_posix()})", ""]
    return "\n".join(lines)
