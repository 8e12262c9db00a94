"""`draftlab bench`: target-only vs speculative decoding, side by side, in one process.

Every method decodes the same prompts with the same sampling settings. After a warm-up the
methods are interleaved prompt by prompt, so machine noise hits them alike, and every
ratio is taken against our own KV-cached target-only loop (`ar`) from the same run.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from draftlab.config import BenchConfig, SamplingParams
from draftlab.data.prompts import load_prompts
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import Tree, load_tree
from draftlab.decoding.tree_search import searched_budget
from draftlab.hardware import describe_device, sync
from draftlab.models.drafters.network import DrafterNet, resolve_drafter
from draftlab.models.target import Target, load_target


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    forwards: int  # target forwards after the prefill
    per_position_acceptance: list[float] | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0


def _hf_runner(target: Target, params: SamplingParams, **extra) -> Callable[[list[int]], Run]:
    """transformers `generate`; target forwards are counted with a forward hook."""
    calls = [0]
    sampling = {"do_sample": False} if params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": None,
    }
    eos = sorted(target.eos_token_ids) or None
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else (eos or [0])[0]

    def run(prompt: list[int]) -> Run:
        ids = torch.tensor([prompt], device=target.device)
        calls[0] = 0
        hook = target.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            sync(target.device)
            t0 = time.perf_counter()
            out = target.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens,
                eos_token_id=eos, pad_token_id=pad, **sampling, **extra,
            )
            sync(target.device)
            seconds = time.perf_counter() - t0
        finally:
            hook.remove()
        new = out[0, len(prompt):].tolist()
        for i, tok in enumerate(new):  # cut after the first EOS, as our Stopper does
            if tok in target.eos_token_ids:
                new = new[: i + 1]
                break
        return Run(new, seconds, max(calls[0] - 1, 1))

    return run


def _engine_runner(fn: Callable, params: SamplingParams) -> Callable[[list[int]], Run]:
    def run(prompt: list[int]) -> Run:
        r = fn(prompt, params)
        s = r.stats
        return Run(r.tokens, s.total_s, s.rounds, s.per_position_acceptance, s.draft_s, s.verify_s)

    return run


def _summarise(runs: list[tuple[str, Run]]) -> dict:
    def agg(items: list[Run]) -> dict:
        toks = sum(len(r.tokens) for r in items)
        secs = sum(r.seconds for r in items)
        fwd = sum(r.forwards for r in items)
        # tau: tokens per target forward after the prefill (which yields the first token).
        tau = (toks - len(items)) / fwd if fwd else 1.0
        return {"tokens_per_s": toks / secs if secs else 0.0, "tau": tau, "tokens": toks, "seconds": secs, "forwards": fwd}

    by_cat: dict[str, list[Run]] = defaultdict(list)
    for cat, r in runs:
        by_cat[cat].append(r)
    out = agg([r for _, r in runs])
    out["by_category"] = {c: {k: v for k, v in agg(rs).items() if k in ("tokens_per_s", "tau")} for c, rs in sorted(by_cat.items())}
    acc = [r.per_position_acceptance for _, r in runs if r.per_position_acceptance]
    if acc:
        width = max(len(a) for a in acc)
        out["per_position_acceptance"] = [
            sum(a[j] for a in acc if j < len(a)) / len(acc) for j in range(width)
        ]
        out["draft_s"] = sum(r.draft_s for _, r in runs)
        out["verify_s"] = sum(r.verify_s for _, r in runs)
    return out


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Load the target (and drafter) named in `cfg`, run every method, return the report."""
    target = load_target(cfg.target)
    drafter = None
    if cfg.drafter is not None and any(m.startswith("draftlab_") for m in cfg.methods):
        saved = None if cfg.drafter.startswith("init:") else Path(cfg.drafter)
        if cfg.tree is None and saved is not None and (saved / "tree.json").is_file():
            cfg = cfg.model_copy(update={"tree": str(saved / "tree.json")})
        budget = searched_budget(cfg.tree)
        if budget:  # the drafter's own best n-node tree, from its measured rank acceptance
            if saved is None:
                raise ValueError(f"tree {cfg.tree!r} needs a saved drafter directory (its tree-search.json)")
            from draftlab.distill.tree_select import searched_tree_file

            cfg = cfg.model_copy(update={"tree": str(searched_tree_file(saved, budget))})
        k = cfg.k or 4
        depth_needed = load_tree(cfg.tree or "default").depth if "draftlab_tree" in cfg.methods else k
        drafter = resolve_drafter(cfg.drafter, target, k=max(k, depth_needed), depth=cfg.depth, seed=cfg.seed)
    return bench_loaded(target, drafter, cfg, progress)


def bench_loaded(
    target: Target, drafter: DrafterNet | None, cfg: BenchConfig, progress: bool = True, trees: dict[str, Tree] | None = None
) -> dict:
    """Run the bench with an already loaded target and drafter (e.g. at the end of training).

    `trees` adds one method per named tree, `draftlab_tree:<name>`, interleaved with the
    others: a sweep measures all of a drafter's trees against one `ar` baseline.
    """
    prompts = load_prompts(cfg.prompts, cfg.limit)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    trees = trees or {}
    methods = ["ar"] + [m for m in cfg.methods if m != "ar"] + [f"draftlab_tree:{name}" for name in trees]
    spec_methods = [m for m in methods if m.startswith("draftlab_")]
    if spec_methods and drafter is None:
        raise ValueError(f"methods {spec_methods} need a drafter (--drafter PATH or init:<family>)")

    runners: dict[str, Callable[[list[int]], Run]] = {
        "ar": _engine_runner(lambda p, sp: autoregressive_generate(target, p, sp), params),
    }
    if "hf_generate" in methods:
        runners["hf_generate"] = _hf_runner(target, params)
    if "hf_prompt_lookup" in methods:
        runners["hf_prompt_lookup"] = _hf_runner(target, params, prompt_lookup_num_tokens=cfg.prompt_lookup_tokens)
    tree, k = None, cfg.k
    if spec_methods:
        k = cfg.k or drafter.cfg.k
        if "draftlab_chain" in methods:
            runners["draftlab_chain"] = _engine_runner(SpeculativeDecoder(target, drafter, Tree.chain(k)).generate, params)
        if "draftlab_tree" in methods:
            tree = load_tree(cfg.tree or "default")
            runners["draftlab_tree"] = _engine_runner(SpeculativeDecoder(target, drafter, tree).generate, params)
        for name, named in trees.items():
            runners[f"draftlab_tree:{name}"] = _engine_runner(SpeculativeDecoder(target, drafter, named).generate, params)

    encoded = [(p, target.encode_prompt(p.text)) for p in prompts]
    for _, ids in encoded[: cfg.warmup]:  # untimed: first-call allocations, lazy inits
        for m in methods:
            runners[m](ids)

    runs: dict[str, list[tuple[str, Run]]] = {m: [] for m in methods}
    bar = tqdm(total=len(encoded) * len(methods), desc="bench", disable=not progress, unit="run")
    for p, ids in encoded:
        for m in methods:
            bar.set_postfix_str(f"{p.category}:{m}")
            runs[m].append((p.category, runners[m](ids)))
            bar.update()
    bar.close()

    ar_tokens = [r.tokens for _, r in runs["ar"]]
    identical = params.greedy and all(
        [r.tokens for _, r in runs[m]] == ar_tokens for m in spec_methods
    ) and bool(spec_methods)
    summary = {m: _summarise(rs) for m, rs in runs.items()}
    ar_tps = summary["ar"]["tokens_per_s"]
    for s in summary.values():
        s["speedup_vs_ar"] = s["tokens_per_s"] / ar_tps if ar_tps else 0.0
    report = {
        "target": target.name,
        "drafter": cfg.drafter if spec_methods else None,
        "device": describe_device(target.device),
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "greedy_identical": identical,
        "greedy_checked": params.greedy and bool(spec_methods),
        "temperature": cfg.temperature,
        "k": k,
        "tree": tree.name if tree else None,
        "tree_nodes": tree.num_nodes if tree else None,
        "drafter_parameters": drafter.num_parameters() if drafter else None,
        "hf_generate_matches_ar": (
            params.greedy and "hf_generate" in runs and [r.tokens for _, r in runs["hf_generate"]] == ar_tokens
        ),
        "torch": torch.__version__,
        "methods": summary,
    }
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def render_table(report: dict) -> str:
    """A readable summary table (rich), one row per method."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"draftlab bench: {report['target']} on {report['device']}")
    for col in ("method", "tokens/s", "tau", "speedup vs ar"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for m, s in report["methods"].items():
        table.add_row(m, f"{s['tokens_per_s']:.2f}", f"{s['tau']:.2f}", f"{s['speedup_vs_ar']:.2f}x")
    console = Console(record=True, width=100)
    with console.capture() as cap:
        console.print(table)
        ident = report["greedy_identical"] if report["greedy_checked"] else "n/a (sampling)"
        console.print(f"greedy_identical: {ident}   prompts: {report['prompts']}   max_new_tokens: {report['max_new_tokens']}")
    return cap.get()
