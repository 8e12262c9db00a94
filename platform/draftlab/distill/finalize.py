"""The end of a training run, on rank 0: what `draftlab distill` leaves beside the drafter.

    save -> training curve -> (bench.enabled) choose the tree -> bench -> keep the winner

The drafter is saved with its lookup store and reloaded as users load it (the target's
dtype). `training.json` prices each held-out evaluation as a K-chain on this hardware. With
the bench on, `cfg.bench.tree` is chosen (`tree_select`), benched side by side with the
chains (and the searched tree verified per round), and the measured winner becomes the
drafter's `tree.json`: what serving and the sweep verify with. With `bench.fresh_process`
(the default) everything after the save runs in a child process (`end_stage`), where the
costs are timed as in a fresh process rather than in the worker that just trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets
import torch

from draftlab.bench import bench_loaded
from draftlab.config import BenchConfig, DistillConfig, NgramSpec
from draftlab.decoding.ngram import STORE_FILE, NgramStore
from draftlab.decoding.tree import Tree, load_tree, split_ngram
from draftlab.decoding.tree_files import save_tree
from draftlab.distill.tree_select import choose_tree, per_round_tree
from draftlab.models.drafters.build import load_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target
from draftlab.profiling import draft_ms, verify_ms
from draftlab.tracking import Tracker


def finish(
    cfg: DistillConfig,
    drafter: DrafterNet,
    target: Target,
    train: datasets.Dataset,
    evalset: datasets.Dataset,
    evaluations: list[dict],
    out_dir: Path,
    tracker: Tracker,
    data_path: str,
) -> dict:
    """Save `drafter` into `out_dir` with its curve (and, with the bench on, its measured
    tree); returns what the run's summary gains (`bench`, `tau`, `speedup_vs_ar`, ...).
    With the bench on and `bench.fresh_process`, the costs are timed and the tree chosen by a
    child process (`end_stage`), which reads the saved drafter and `data_path`."""
    drafter.eval().save(out_dir)
    save_lookup_store(train, out_dir)
    fresh = (
        cfg.bench.enabled and cfg.bench.fresh_process
    )  # the curve alone (sweep trials) costs no child
    if fresh:
        done = run_fresh(cfg, out_dir, data_path, target.device.type, evaluations)
        curve, report = done["curve"], done["report"]
    else:
        served = load_drafter(out_dir, target)  # as users load it: the target's dtype
        curve, report = curve_and_tree(cfg, served, target, evalset, evaluations, out_dir)
    curve["timed_in"] = (
        "fresh process" if fresh else "training worker"
    )  # where the costs were timed
    (out_dir / "training.json").write_text(json.dumps(curve, indent=2) + "\n")
    tracker.log_dict(curve, "training.json")
    if report is None:
        return {}
    tracker.log_dict(report["bench"], "bench.json")
    return report


def curve_and_tree(
    cfg: DistillConfig,
    served: DrafterNet,
    target: Target,
    evalset: datasets.Dataset,
    evaluations: list[dict],
    out_dir: Path,
) -> tuple[dict, dict | None]:
    """What follows the save, in the worker or in `end_stage`'s child: the priced training
    curve, and (bench on) the chosen, benched and saved tree's report."""
    curve = training_curve(cfg, served, target, evaluations)
    return curve, bench_trees(cfg, served, target, evalset, out_dir) if cfg.bench.enabled else None


def save_lookup_store(train: datasets.Dataset, out_dir: Path) -> None:
    """The target's responses to the training prompts, as the drafter's `NgramStore`."""
    cols = train.select_columns(["input_ids", "prompt_len"])
    responses = (ids[p:] for ids, p in zip(cols["input_ids"], cols["prompt_len"], strict=True))
    NgramStore.build(responses, NgramSpec()).save(out_dir / STORE_FILE)


def training_curve(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evaluations: list[dict]
) -> dict:
    """The run's held-out evaluations against training minutes and tokens, each priced as a
    K-chain on this hardware: predicted speedup = sim. accept len x t_decode / (t_verify(K+1
    rows) + t_draft(K)), with the costs measured once here (what more training would buy)."""
    k, ctx = cfg.drafter.k, cfg.bench.search_context
    with torch.inference_mode():
        decode, chain = verify_ms(target, [None, Tree.chain(k)], ctx, repeats=5)
        draft = draft_ms(drafter, k, ctx, repeats=5)
    rows = [
        e | {"predicted_speedup": e["sim_accept_len"] * decode / (chain + draft)}
        for e in evaluations
    ]
    return {
        "k": k,
        "context": ctx,
        "decode_ms": decode,
        "verify_chain_ms": chain,
        "draft_ms": draft,
        "evaluations": rows,
    }


def bench_trees(
    cfg: DistillConfig,
    drafter: DrafterNet,
    target: Target,
    evalset: datasets.Dataset,
    out_dir: Path,
) -> dict:
    """Choose `cfg.bench.tree`, bench it against the chains (and its per-round pool), save the
    fastest method's tree as `tree.json`; returns the bench report and the winner."""
    tree_file = choose_tree(cfg, drafter, target, evalset, out_dir)
    verify_tree = load_tree(str(tree_file))
    pooled = (
        per_round_tree(cfg, verify_tree, out_dir)
        if split_ngram(cfg.bench.tree)[0] == "searched"
        else None
    )
    trees = {pooled.name: pooled} if pooled is not None else {}
    depth = cfg.bench.chain_depth  # the chain methods' draft length
    chain_k = cfg.drafter.k if depth == "k" else verify_tree.depth if depth == "tree" else depth
    bcfg = BenchConfig(
        target=cfg.target,
        drafter=str(out_dir),
        prompts=cfg.bench.prompts,
        limit=cfg.bench.limit,
        max_new_tokens=cfg.bench.max_new_tokens,
        k=chain_k,
        tree=str(tree_file),
        methods=cfg.bench.methods,
    )
    report = bench_loaded(target, drafter, bcfg, progress=False, trees=trees)
    best = max(
        (m for m in report["methods"] if m.startswith("draftlab_")),
        key=lambda m: report["methods"][m]["speedup_vs_ar"],
    )
    # the measured winner is what the drafter is served with: its tree.json
    chain = best.startswith("draftlab_chain")
    if best.startswith("draftlab_tree:"):  # the per-round tree, with its own lookups
        chosen = trees[best.removeprefix("draftlab_tree:")]
    else:
        chosen = (
            Tree.chain(chain_k)
            if chain
            else Tree.from_paths(
                [list(p) for p in verify_tree.paths], split_ngram(cfg.bench.tree)[0]
            )
        )
        # the lookups it was measured with: the bench's for `*_ngram`, else the searched tree's own
        ngram = bcfg.ngram if best.endswith("_ngram") else None if chain else verify_tree.ngram
        chosen = chosen.with_ngram(ngram) if ngram else chosen
    save_tree(chosen, None, out_dir)
    return {
        "bench": report,
        "tau": report["methods"][best]["tau"],
        "speedup_vs_ar": report["methods"][best]["speedup_vs_ar"],
        "best_method": best,
        "tree": chosen.name,
        "greedy_identical": report["greedy_identical"],
    }


END_STAGE_TAIL = 3000  # characters of the child's stderr quoted in an error


def run_fresh(
    cfg: DistillConfig, out_dir: Path, data_path: str, device: str, evaluations: list[dict]
) -> dict:
    """`{"curve": ..., "report": ... | None}` computed by a child process (`end_stage`)."""
    with tempfile.TemporaryDirectory(prefix="draftlab-end-") as work:
        request, result = Path(work) / "request.json", Path(work) / "result.json"
        request.write_text(
            json.dumps(
                {
                    "config": cfg.model_dump(mode="json"),
                    "drafter_dir": str(out_dir),
                    "data_path": data_path,
                    "device": device,
                    "evaluations": evaluations,
                    "result": str(result),
                }
            )
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "draftlab.distill.end_stage", str(request)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                "the end stage's process failed (exit "
                f"{proc.returncode}):\n{proc.stderr[-END_STAGE_TAIL:]}"
            )
        return json.loads(result.read_text())
