"""`draftlab bench`: target-only vs speculative decoding, side by side.

Every method decodes the same prompts with the same sampling settings. After a warm-up the
methods are interleaved prompt by prompt (every method on a prompt, then the next prompt), so
machine noise hits them alike, and every ratio is taken against our own KV-cached target-only
loop (`ar`) from the same run, and against vLLM's (`vllm_ar`) when a `vllm_*` method runs.

Each `vllm_*` engine is a vLLM engine: its own processes holding the weights and a KV cache.
By default (`vllm.side_by_side`) every engine starts before the timed loop and joins the
interleaving beside ours; otherwise each runs as one block after ours, one engine alive at a
time. The report's `order` says which. `passes` repeats the timed loop and reports each
pass's ratios: their spread is the noise.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from draftlab.bench_report import BenchReport, ContenderInfo, Order, speedup_text
from draftlab.config import BenchConfig, ConfigError, SamplingParams
from draftlab.data.prompts import load_prompts
from draftlab.decoding.agreement import describe_mismatches, greedy_match, mismatches
from draftlab.decoding.baselines import Run, hf_runner
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.ngram import NgramStore
from draftlab.decoding.tree import Tree
from draftlab.decoding.tree_files import resolve_tree
from draftlab.export import (
    VLLM_FAMILIES,
    export_vllm,
    served_draft_length,
    vllm_speculative_config,
    vllm_target_dir,
)
from draftlab.hardware import describe_device
from draftlab.models.drafters.build import load_drafter, resolve_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target, load_target
from draftlab.storage import local_copy
from draftlab.verdict import SUFFIX_DEPTH, add_load_speedups, verdict
from draftlab.vllm_offline import SpecCounters, VllmEngine, require_vllm
from draftlab.vllm_scheduler import REQUEST_K, builtin_config, engine_kwargs

VLLM_METHODS = (
    "vllm_ar",
    "vllm_ngram",
    "vllm_suffix",
    "vllm_draftlab",
    "vllm_draftlab_ngram",
)  # engines' run order
TREE_METHODS = (
    "draftlab_tree",
    "draftlab_tree_ngram",
)  # verify `cfg.tree` (with or without grafts)
BENCH_TREE = "default"  # the tree method's tree without `tree` nor a saved `tree.json`: not a chain
Runner = Callable[[list[int]], Run]  # prompt ids -> one decoding
Runs = dict[
    str, list[tuple[str, Run]]
]  # method -> (prompt category, run) per prompt, in prompt order


def _engine_runner(fn: Callable, params: SamplingParams) -> Runner:
    def run(prompt: list[int]) -> Run:
        r = fn(prompt, params)
        s = r.stats
        return Run(r.tokens, s.total_s, s.rounds, s.per_position_acceptance, s.draft_s, s.verify_s)

    return run


def _by_category(runs: list[tuple[str, Run]]) -> dict[str, list[Run]]:
    """(category, run) pairs grouped by category, categories sorted."""
    by_cat: dict[str, list[Run]] = defaultdict(list)
    for cat, r in runs:
        by_cat[cat].append(r)
    return dict(sorted(by_cat.items()))


def _summarise(runs: list[tuple[str, Run]]) -> dict:
    def agg(items: list[Run]) -> dict:
        toks = sum(len(r.tokens) for r in items)
        secs = sum(r.seconds for r in items)
        fwd = sum(r.forwards for r in items)
        # tau: tokens per target forward after the prefill (which yields the first token).
        tau = (toks - len(items)) / fwd if fwd else 1.0
        out = {
            "tokens_per_s": toks / secs if secs else 0.0,
            "tau": tau,
            "tokens": toks,
            "seconds": secs,
            "forwards": fwd,
        }
        spec = [r.spec for r in items if r.spec is not None]
        if spec:  # vLLM: its mean acceptance length over rounds that had drafts, bonus included
            total = sum(spec, SpecCounters())
            out |= {
                "tau": total.tau,
                "drafts": total.drafts,
                "draft_tokens": total.draft_tokens,
                "accepted_tokens": total.accepted,
            }
            if total.drafts:
                out["per_position_acceptance"] = [
                    a / total.drafts for a in total.accepted_per_position
                ]
            return out
        acc = [r.per_position_acceptance for r in items if r.per_position_acceptance]
        if acc:  # ours: the mean over prompts of each prompt's rate
            width = max(len(a) for a in acc)
            out["per_position_acceptance"] = [
                sum(a[j] for a in acc if j < len(a)) / len(acc) for j in range(width)
            ]
        return out

    out = agg([r for _, r in runs])
    keep = ("tokens_per_s", "tau", "per_position_acceptance")
    out["by_category"] = {
        c: {k: v for k, v in agg(rs).items() if k in keep} for c, rs in _by_category(runs).items()
    }
    if any(r.per_position_acceptance for _, r in runs):
        out["draft_s"] = sum(r.draft_s for _, r in runs)
        out["verify_s"] = sum(r.verify_s for _, r in runs)
    return out


@dataclass
class Contender:
    """Another saved drafter benched beside the main one (`BenchConfig.versus`)."""

    drafter: DrafterNet
    tree: Tree
    store: NgramStore | None


def _contender(path: str, target: Target, cfg: BenchConfig) -> Contender:
    saved = local_copy(path)  # a URI's mirror synced once, then read locally
    drafter = load_drafter(saved, target)
    return Contender(
        drafter, resolve_tree(cfg.tree, saved, drafter.cfg.k, BENCH_TREE), NgramStore.beside(saved)
    )


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Load the target (and drafters) named in `cfg`, run every method, return the report."""
    target = load_target(cfg.target)
    versus = {path: _contender(path, target, cfg) for path in cfg.versus}
    drafter = None
    if cfg.drafter is not None and (
        cfg.trees or any(m.startswith(("draftlab_", "vllm_draftlab")) for m in cfg.methods)
    ):
        saved = _drafter_dir(cfg)
        k = cfg.k or 4
        if saved is None:  # an `init:` drafter is built as deep as the trees it verifies
            specs = [cfg.tree] if set(TREE_METHODS) & set(cfg.methods) else []
            k = max(
                [
                    k,
                    *(
                        resolve_tree(s, None, k, BENCH_TREE, cut=False).depth
                        for s in [*specs, *cfg.trees]
                    ),
                ]
            )
        drafter = resolve_drafter(cfg.drafter, target, k=k, depth=cfg.depth, seed=cfg.seed)
        named = {spec: resolve_tree(spec, saved, drafter.cfg.k, BENCH_TREE) for spec in cfg.trees}
        return bench_loaded(target, drafter, cfg, progress, trees=named, versus=versus)
    return bench_loaded(target, drafter, cfg, progress, versus=versus)


def _drafter_dir(cfg: BenchConfig) -> Path | None:
    """The saved drafter's local directory (an s3://... drafter's mirror); None for `init:`."""
    return None if not cfg.drafter or cfg.drafter.startswith("init:") else local_copy(cfg.drafter)


def bench_loaded(
    target: Target,
    drafter: DrafterNet | None,
    cfg: BenchConfig,
    progress: bool = True,
    trees: dict[str, Tree] | None = None,
    versus: dict[str, Contender] | None = None,
) -> dict:
    """Run the bench with an already loaded target and drafter (e.g. at the end of training).

    `trees` adds one method per named tree, `draftlab_tree:<name>`, interleaved with the
    others: a sweep measures all of a drafter's trees against one `ar` baseline. `versus`
    adds one method per other drafter, `draftlab_tree@<name>`, the same way.
    """
    with tempfile.TemporaryDirectory(prefix="draftlab-bench-") as work:  # vllm_draftlab's export
        return _bench(target, drafter, cfg, progress, trees or {}, versus or {}, Path(work))


@dataclass(frozen=True)
class Methods:
    """The names of the methods our engine (and HF) decode, interleaved prompt by prompt: made
    once from the config (`_methods`), then read by the runners, the warm-up, the loop, the
    summary and the report. The `vllm_*` methods are planned apart (`_vllm_plan`)."""

    fixed: list[str]  # `BenchConfig.methods` of ours and HF's, as given (`ar` and vLLM's left out)
    named: dict[str, Tree]  # `draftlab_tree:<name>` -> one of `trees`, verified by the main drafter
    versus: dict[str, Contender]  # `draftlab_tree@<name>` -> another drafter with its tree

    @property
    def interleaved(self) -> list[str]:
        """Every method, in its order on each prompt: `ar` first."""
        return ["ar", *self.fixed, *self.named, *self.versus]

    @property
    def mine(self) -> list[str]:
        """The methods that decode with the main drafter."""
        return [m for m in self.fixed if m.startswith("draftlab_")] + list(self.named)

    @property
    def speculative(self) -> list[str]:
        """Our engine's speculative methods: greedy, each must reproduce `ar` exactly."""
        return [m for m in self.interleaved if m.startswith("draftlab_")]


def _methods(cfg: BenchConfig, trees: dict[str, Tree], versus: dict[str, Contender]) -> Methods:
    return Methods(
        fixed=[m for m in cfg.methods if m not in ("ar", *VLLM_METHODS)],
        named={f"draftlab_tree:{name}": tree for name, tree in trees.items()},
        versus={f"draftlab_tree@{name}": c for name, c in versus.items()},
    )


def _bench(
    target: Target,
    drafter: DrafterNet | None,
    cfg: BenchConfig,
    progress: bool,
    trees: dict[str, Tree],
    versus: dict[str, Contender],
    work: Path,
) -> dict:
    """Plan, decode (`_decode`), summarise, report (module doc)."""
    prompts = load_prompts(cfg.prompts, cfg.limit)
    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
    )
    methods = _methods(cfg, trees, versus)
    if methods.mine and drafter is None:
        raise ValueError(f"methods {methods.mine} need a drafter (--drafter PATH or init:<family>)")
    encoded = [(p, target.encode_prompt(p.messages)) for p in prompts]
    saved = _drafter_dir(cfg)  # listed once: an s3:// drafter's mirror is synced per call
    vllm_plan = _vllm_plan(
        target, drafter, cfg, saved, encoded, work
    )  # before any decoding: fail fast

    tree = (
        resolve_tree(cfg.tree, saved, drafter.cfg.k, BENCH_TREE)
        if (methods.mine and set(TREE_METHODS) & set(methods.interleaved))
        else None
    )
    k = (cfg.k or drafter.cfg.k) if methods.mine else cfg.k
    runners = _runners(target, drafter, cfg, params, methods, tree, k, saved)
    runs, vllm_info, load, order = _decode(
        runners, vllm_plan, target, cfg, params, encoded, progress
    )
    vllm_runs = [m for e in vllm_plan.values() for m in e["methods"]]

    report = BenchReport(
        target=target.name,
        drafter=cfg.drafter
        if methods.mine or any(m.startswith("vllm_draftlab") for m in vllm_runs)
        else None,
        device=describe_device(target.device),
        prompts=len(prompts),
        max_new_tokens=cfg.max_new_tokens,
        **_greedy_checks(target, encoded, runs, methods, vllm_runs, params.greedy),
        temperature=cfg.temperature,
        k=k,
        tree=tree.name if tree else None,
        tree_nodes=tree.num_nodes if tree else None,
        drafter_parameters=drafter.num_parameters() if drafter else None,
        drafter_head_coverage=head_coverage(drafter, runs["ar"]) if drafter else None,
        versus={
            name: ContenderInfo(
                tree=c.tree.name,
                tree_nodes=c.tree.num_nodes,
                k=c.drafter.cfg.k,
                drafter_parameters=c.drafter.num_parameters(),
            )
            for name, c in versus.items()
        },
        order=Order(
            groups=order,
            passes=cfg.passes,
            warmup_requests=cfg.warmup,
            warmup_batch=len(encoded) if vllm_runs else None,
        ),
        vllm=vllm_info,
        torch=torch.__version__,
        methods=_summary(runs, params.greedy, bool(vllm_runs), cfg.passes),
        # each vLLM method under load: {method: {level: tokens/s, tau, speedup_vs_vllm_ar}}
        load=add_load_speedups(load) if load else None,
    )
    if vllm_runs:  # what to deploy: the fastest served configuration, with its batch-size schedule
        report.verdict = verdict(report.model_dump(), cfg)
    out = report.model_dump()
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(out, indent=2) + "\n")
    return out


def _runners(
    target: Target,
    drafter: DrafterNet | None,
    cfg: BenchConfig,
    params: SamplingParams,
    methods: Methods,
    tree: Tree | None,
    k: int | None,
    saved: Path | None,
) -> dict[str, Runner]:
    """One runner per interleaved method: prompt ids -> `Run`."""

    def decoder(d: DrafterNet, verified: Tree, store: NgramStore | None) -> Runner:
        return _engine_runner(SpeculativeDecoder(target, d, verified, store).generate, params)

    runners = {"ar": _engine_runner(lambda p, sp: autoregressive_generate(target, p, sp), params)}
    store = (
        NgramStore.beside(saved) if methods.mine else None
    )  # lookups where the text has no match
    for m in methods.fixed:
        if m == "hf_generate":
            runners[m] = hf_runner(target, params)
        elif m == "hf_prompt_lookup":
            runners[m] = hf_runner(
                target, params, prompt_lookup_num_tokens=cfg.prompt_lookup_tokens
            )
        else:  # draftlab_chain, draftlab_tree, and each with `_ngram` grafts
            shape = Tree.chain(k) if m.startswith("draftlab_chain") else tree
            runners[m] = decoder(
                drafter, shape.with_ngram(cfg.ngram) if m.endswith("_ngram") else shape, store
            )
    for m, named in methods.named.items():
        runners[m] = decoder(drafter, named, store)
    for m, c in methods.versus.items():
        runners[m] = decoder(c.drafter, c.tree, c.store)
    return runners


def _interleave(
    runners: dict[str, Runner], encoded: list, warmup: int, passes: int, bar: tqdm
) -> Runs:
    """The warm-up (untimed: first-call allocations, lazy inits), then `passes` times every
    method on each prompt in turn, so machine noise hits them alike. Each prompt starts one
    method further along `runners`' order (prompt i of the whole run: methods i, i + 1, ...),
    so no method always runs first, or always right after the same one."""
    for _, ids in encoded[:warmup]:
        for run in runners.values():
            run(ids)
    runs: Runs = {m: [] for m in runners}
    names = list(runners)
    for i, (p, ids) in enumerate(encoded * passes):
        for m in names[i % len(names) :] + names[: i % len(names)]:
            bar.set_postfix_str(f"{p.category}:{m}")
            runs[m].append((p.category, runners[m](ids)))
            bar.update()
    return runs


def _summary(runs: Runs, greedy: bool, vllm: bool, passes: int) -> dict[str, dict]:
    """{method: its figures (`_summarise`), greedy agreement with `ar` and speedups; with
    several passes each pass's tokens/s}."""
    ar_tokens = [r.tokens for _, r in runs["ar"]]
    summary = {m: _summarise(rs) for m, rs in runs.items()}
    if passes > 1:
        for m, rs in runs.items():
            n = len(rs) // passes  # each pass ran every prompt once, passes in order
            by_pass = [rs[i * n : (i + 1) * n] for i in range(passes)]
            summary[m]["tokens_per_s_by_pass"] = [_tokens_per_s([r for _, r in p]) for p in by_pass]
            kinds = [_by_category(p) for p in by_pass]  # a kind's few prompts move more
            for cat, c in summary[m]["by_category"].items():
                c["tokens_per_s_by_pass"] = [_tokens_per_s(k.get(cat, [])) for k in kinds]
    for m, rs in runs.items():  # greedy: how much of `ar`'s output each method reproduces
        summary[m] |= (
            greedy_match(ar_tokens, [r.tokens for _, r in rs])
            if greedy
            else {"greedy_match_rate": None, "greedy_token_match_rate": None}
        )
    _add_speedups(summary, "ar")
    if vllm:
        _add_speedups(summary, "vllm_ar")
    return summary


def _greedy_checks(
    target: Target, encoded: list, runs: Runs, methods: Methods, vllm: list[str], greedy: bool
) -> dict:
    """The report's greedy agreement fields: ours and HF's against `ar`, vLLM's with speculation
    against `vllm_ar`, `vllm_ar` against `ar` (all False / empty when sampling)."""
    ar_tokens = [r.tokens for _, r in runs["ar"]]

    def same(m: str) -> bool:
        return greedy and m in runs and [r.tokens for _, r in runs[m]] == ar_tokens

    spec, vllm_spec = methods.speculative, [m for m in vllm if m != "vllm_ar"]
    found = (
        greedy_mismatches(target, encoded, runs, "vllm_ar", vllm_spec)
        if greedy and vllm_spec
        else []
    )
    return {
        "greedy_identical": greedy and all(same(m) for m in spec) and bool(spec),
        "greedy_checked": greedy and bool(spec),
        "hf_generate_matches_ar": same("hf_generate"),
        # our engine's and HF's methods vs `ar`, greedy: where each output first leaves `ar`'s
        # and the target's logit margin there (`agreement.near_tie`), so ties can be told from bugs
        "greedy_mismatches": greedy_mismatches(target, encoded, runs, "ar", methods.interleaved[1:])
        if greedy
        else [],
        # vLLM with speculation vs vLLM target-only, greedy: mismatches name method, prompt
        # index and first differing token position.
        "vllm_greedy_identical": greedy and bool(vllm_spec) and not found,
        "vllm_greedy_checked": greedy and bool(vllm_spec),
        "vllm_greedy_mismatches": found,
        "vllm_ar_matches_ar": same("vllm_ar"),
    }


def head_coverage(drafter: DrafterNet, ar_runs: list[tuple[str, Run]]) -> dict:
    """The share of the target's own output tokens (`ar`'s) that the drafter's head scores
    at all, overall and per prompt category. A token VocabTrim dropped is a certain miss
    wherever the target writes it, so this bounds the drafter's acceptance on these prompts
    (1.0 for an untrimmed head)."""
    device = drafter.target_head_weight.device

    def share(runs: list[Run]) -> float:
        ids = torch.tensor([t for r in runs for t in r.tokens], dtype=torch.long, device=device)
        return int((drafter.head_rows(ids) >= 0).sum()) / ids.numel() if ids.numel() else 1.0

    return {
        "all": share([r for _, r in ar_runs]),
        "by_category": {c: share(rs) for c, rs in _by_category(ar_runs).items()},
    }


def greedy_mismatches(
    target: Target,
    encoded: list,
    runs: dict[str, list[tuple[str, Run]]],
    reference: str,
    methods: list[str],
) -> list[dict]:
    """Every (method, prompt) whose greedy output differs from `reference`'s in some pass (the
    first such pass's): the prompt's index, the first differing position and the target's
    margins there."""
    prompts, ref = [ids for _, ids in encoded], [r.tokens for _, r in runs[reference]]
    passes = len(ref) // len(prompts)  # runs hold every pass, in order
    found: dict[tuple[str, int], dict] = {}
    for m in methods:
        for f in mismatches(target, prompts * passes, ref, [r.tokens for _, r in runs[m]]):
            i = f["prompt"] % len(prompts)
            found.setdefault((m, i), {"method": m, **f, "prompt": i})
    return list(found.values())


def _add_speedups(summary: dict, base: str) -> None:
    """`speedup_vs_<base>` for every method, overall, per prompt category and per pass."""
    key, b = f"speedup_vs_{base}", summary[base]

    def ratios(s: dict, b: dict) -> None:  # s's tokens/s (and each pass's) over b's
        s[key] = s["tokens_per_s"] / b["tokens_per_s"] if b.get("tokens_per_s") else 0.0
        if "tokens_per_s_by_pass" in s and "tokens_per_s_by_pass" in b:
            s[f"{key}_by_pass"] = [
                x / y if y else 0.0
                for x, y in zip(s["tokens_per_s_by_pass"], b["tokens_per_s_by_pass"], strict=True)
            ]

    for s in summary.values():
        ratios(s, b)
        for cat, c in s["by_category"].items():
            ratios(c, b["by_category"].get(cat, {}))


def _vllm_plan(
    target: Target,
    drafter: DrafterNet | None,
    cfg: BenchConfig,
    source: Path | None,
    encoded: list,
    work: Path,
) -> dict[str, dict]:
    """{engine: {"kwargs": its engine's settings ({} = target only), "methods": {method: the
    per-request `extra_args` it is measured with}, "kv_cache_bytes": its KV cache}} in run
    order, `vllm_ar` first; {} without vLLM methods. Checks what would otherwise fail after
    minutes of decoding: vLLM (and Arctic for suffix) installed, prompts fit
    `vllm.max_model_len`, the drafter exports."""
    asked = [m for m in VLLM_METHODS if m in cfg.methods]
    if not asked:
        return {}

    v = cfg.vllm
    try:
        require_vllm()
        builtin = {
            m: builtin_config(
                m.removeprefix("vllm_"),
                cfg.k if m == "vllm_ngram" else None,
                v.ngram_min,
                v.ngram_max,
                v.suffix_cached_requests,
            )
            for m in ("vllm_ngram", "vllm_suffix")
            if m in asked
        }
    except ImportError as e:
        raise ConfigError(f"methods {asked}: {e}") from None
    longest = max((len(ids) for _, ids in encoded), default=0)
    if longest + cfg.max_new_tokens > v.max_model_len:
        raise ConfigError(
            f"vllm.max_model_len={v.max_model_len} is shorter than the longest prompt "
            f"({longest} tokens) + max_new_tokens ({cfg.max_new_tokens})"
        )
    plan: dict[str, dict] = {"vllm_ar": {"kwargs": {}, "methods": {"vllm_ar": None}}}
    for m, spec in builtin.items():  # scheduled by ours: per-request draft lengths (`draftlab_k`)
        methods = {m: None}
        if m == "vllm_suffix":
            depth = spec.get("num_speculative_tokens") or SUFFIX_DEPTH
            if bad := [n for n in v.suffix_draft_lengths if not 1 <= n < depth]:
                raise ConfigError(
                    f"vllm.suffix_draft_lengths {bad}: each must be >= 1 and < suffix "
                    f"drafting's depth {depth}"
                )
            methods |= {f"{m}@k{n}": {REQUEST_K: n} for n in v.suffix_draft_lengths}
        plan[m] = {
            "kwargs": engine_kwargs(None, spec, spec.get("num_speculative_tokens", 0)),
            "methods": methods,
        }
    drafted = [m for m in asked if m.startswith("vllm_draftlab")]
    if drafted:
        if drafter is None:
            raise ValueError(f"methods {drafted} need a drafter (--drafter PATH or init:p-eagle)")

        if drafter.family not in VLLM_FAMILIES:
            raise ValueError(
                f"methods {drafted}: drafter {cfg.drafter!r} is a {drafter.family!r} drafter; vLLM "
                f"runs {list(VLLM_FAMILIES)} (--drafter init:p-eagle, or train with "
                "drafter.family=p-eagle)"
            )
        # The drafter in memory is the one measured (a saved dir or init:), so export that.
        saved = drafter.save(work / "drafter")
        k = cfg.k or (
            served_draft_length(source) if source else drafter.cfg.k
        )  # as deep as its tree.json drafts
        if bad := [n for n in v.draft_lengths if not 1 <= n < k]:
            raise ConfigError(
                f"vllm.draft_lengths {bad}: each must be >= 1 and < the drafter's draft length {k}"
            )
        spec = vllm_speculative_config(export_vllm(saved, work / "vllm", target=target), k)
        if "vllm_draftlab" in asked:
            methods = {"vllm_draftlab": None} | {
                f"vllm_draftlab@k{n}": {REQUEST_K: n} for n in v.draft_lengths
            }
            plan["vllm_draftlab"] = {"kwargs": engine_kwargs(None, spec, k), "methods": methods}
        if "vllm_draftlab_ngram" in asked:  # the drafter's k tokens, or a copy from the text
            plan["vllm_draftlab_ngram"] = {
                "kwargs": engine_kwargs(cfg.ngram, spec, k),
                "methods": {"vllm_draftlab_ngram": None},
            }
    for name, e in plan.items():  # each engine's KV cache, sized for what it decodes here
        drafted = name.startswith("vllm_draftlab")
        e["kv_cache_bytes"] = _kv_cache_bytes(target, drafter.cfg.depth if drafted else 0, cfg)
    return plan


def _load_prompts_for(encoded: list, level: int, requests: int | None) -> list[list[int]]:
    """The prompts of one load level: each in turn, cycled to `requests` (None = max(prompts,
    2 x level), so every level keeps its clients busy past the first wave)."""
    n = requests or max(len(encoded), 2 * level)
    return [encoded[i % len(encoded)][1] for i in range(n)]


def _kv_cache_bytes(target: Target, drafter_layers: int, cfg: BenchConfig) -> int:
    """An engine's KV cache: `vllm.max_model_len` tokens for each request of the highest load
    level (one without levels) over the target's layers and the drafter's, K and V of every KV
    head in the target's dtype (vLLM's full-attention layout; the drafter's layers take the
    target's heads, `export.py`)."""
    c = target.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_token = 2 * kv_heads * head_dim * target.dtype.itemsize  # K and V of one layer
    tokens = cfg.vllm.max_model_len * max(cfg.concurrency, default=1)
    # a tenth more: vLLM rounds each request up to whole blocks, and drafts look ahead
    return per_token * (c.num_hidden_layers + drafter_layers) * tokens * 11 // 10


def _groups(plan: dict, side_by_side: bool) -> list[list[str]]:
    """The vLLM engines alive together, in run order; ours join the first group: every engine
    beside ours, else ours alone and then one engine at a time."""
    return [list(plan)] if side_by_side else [[], *([name] for name in plan)]


def _vllm_runner(llm: VllmEngine, params: SamplingParams, extra: dict | None) -> Runner:
    """One prompt decoded by one of an engine's methods (`extra`: its per-request settings)."""

    def run(ids: list[int]) -> Run:
        r = llm.generate(
            ids, params.max_new_tokens, params.temperature, params.top_p, params.seed, extra
        )
        if extra and REQUEST_K in extra:  # the engine counts all its slots; this verifies k
            r.spec.accepted_per_position = r.spec.accepted_per_position[: extra[REQUEST_K]]
        # target forwards after the prefill: each yields 1 + its accepted drafts
        return Run(r.tokens, r.seconds, max(len(r.tokens) - 1 - r.spec.accepted, 0), spec=r.spec)

    return run


def _decode(
    ours: dict[str, Runner],
    plan: dict,
    target: Target,
    cfg: BenchConfig,
    params: SamplingParams,
    encoded: list,
    progress: bool,
) -> tuple[Runs, dict | None, dict, list[list[str]]]:
    """Every method's runs, group by group (`_groups`): its engines started and warmed up, its
    methods (ours in the first group) interleaved prompt by prompt for `cfg.passes` passes,
    then each load level (`cfg.concurrency`) for its engines' finalists, the engines closed.
    Returns the runs, the engines' info (None without vLLM methods), {method: {level: load}}
    and each group's methods in their order on a prompt."""
    levels = [(c, _load_prompts_for(encoded, c, cfg.load_requests)) for c in cfg.concurrency]
    vllm_methods = sum(len(e["methods"]) for e in plan.values())
    bar = tqdm(
        total=(len(ours) + vllm_methods) * len(encoded) * cfg.passes
        + vllm_methods * sum(len(ps) for _, ps in _timed_levels(levels, cfg)),
        desc="bench",
        disable=not progress,
        unit="run",
    )
    model_dir = vllm_target_dir(target) if plan else None
    runs: Runs = {}
    load: dict[str, dict[str, dict]] = {}
    startup: dict[str, float] = {}
    order: list[list[str]] = []
    for i, names in enumerate(_groups(plan, cfg.vllm.side_by_side)):
        with ExitStack() as alive:
            runners, engines = dict(ours) if i == 0 else {}, []
            for name in names:
                bar.set_postfix_str(f"{name}: starting engine")
                llm = alive.enter_context(
                    VllmEngine(
                        model_dir,
                        dtype=target.dtype,
                        max_model_len=cfg.vllm.max_model_len,
                        memory_fraction=cfg.vllm.memory_fraction / len(names),
                        kv_cache_bytes=plan[name]["kv_cache_bytes"],
                        env=cfg.vllm.env,
                        enforce_eager=cfg.vllm.enforce_eager,
                        memory_setting="vllm.side_by_side, vllm.memory_fraction (GPU), concurrency",
                        seed=cfg.seed,
                        **plan[name]["kwargs"],
                    )
                )
                startup[name], methods = llm.startup_s, plan[name]["methods"]
                engines.append((llm, methods))
                runners |= {m: _vllm_runner(llm, params, x) for m, x in methods.items()}
            for llm, methods in engines:
                # every prompt once, all in flight: an engine's first steps of each new shape run
                # slower (a cold first prompt runs much slower), whichever method comes first
                bar.set_postfix_str("vLLM warm-up")
                llm.generate_closed_loop(
                    [ids for _, ids in encoded],
                    len(encoded),
                    params.max_new_tokens,
                    temperature=params.temperature,
                    extra_args=next(iter(methods.values())),
                )
            runs |= _interleave(runners, encoded, cfg.warmup, cfg.passes, bar)
            order.append(list(runners))
            load |= _load_levels(engines, runs, levels, cfg, params.temperature, bar)
    bar.close()
    if not plan:
        return runs, None, load, order
    info = {
        "version": require_vllm(),
        "target_dir": model_dir,
        "dtype": str(target.dtype).removeprefix("torch."),
        **cfg.vllm.model_dump(),
        "startup_s": startup,
        "kv_cache_bytes": {name: e["kv_cache_bytes"] for name, e in plan.items()},
        "engines": {name: list(e["methods"]) for name, e in plan.items()},
        "speculative_config": {
            name: e["kwargs"].get("speculative_config") for name, e in plan.items()
        },
        "lookups": {
            name: e["kwargs"]["additional_config"]
            for name, e in plan.items()
            if "additional_config" in e["kwargs"]
        },
    }
    return runs, info, load, order


def _tokens_per_s(runs: list[Run]) -> float:
    """Output tokens over decoding seconds."""
    secs = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / secs if secs else 0.0


def _level_one(runs: list[tuple[str, Run]]) -> dict:
    """Load level 1 of a method: its one-at-a-time runs (every prompt once a pass, one in
    flight)."""
    done = [r for _, r in runs]
    secs, spec = sum(r.seconds for r in done), sum((r.spec for r in done), SpecCounters())
    return {
        "tokens_per_s": _tokens_per_s(done),
        "tau": spec.tau,
        "requests": len(done),
        "seconds": secs,
    }


def _finalist(runs: dict[str, list[tuple[str, Run]]], method: str) -> bool:
    """Measured under load: `vllm_ar`, and each method faster than it one request at a time
    (one slower there is never the served configuration, `draftlab.verdict`)."""
    return (
        method == "vllm_ar"
        or _level_one(runs[method])["tokens_per_s"] > _level_one(runs["vllm_ar"])["tokens_per_s"]
    )


def _timed_levels(levels: list, cfg: BenchConfig) -> list:
    """The load levels decoded again; level 1 with the default request count is the
    one-at-a-time runs already made (every prompt once a pass, one in flight)."""
    return [(c, ps) for c, ps in levels if c > 1 or cfg.load_requests is not None]


def _load_levels(
    engines: list[tuple[VllmEngine, dict[str, dict | None]]],
    runs: Runs,
    levels: list,
    cfg: BenchConfig,
    temperature: float,
    bar: tqdm,
) -> dict[str, dict[str, dict]]:
    """{method: {level: tokens/s, tau, requests, seconds}} of the engines' methods, closed loop
    at each load level in turn (every engine's finalists at one level, then the next): level 1
    of every method from `runs` (`_timed_levels`), the others for the finalists only
    (`_finalist`, or all with `cfg.load_all`)."""
    methods = {m: (llm, extra) for llm, ms in engines for m, extra in ms.items()}
    finalists = {m for m in methods if cfg.load_all or _finalist(runs, m)}
    timed = _timed_levels(levels, cfg)
    bar.total -= (len(methods) - len(finalists)) * sum(len(ps) for _, ps in timed)
    decoded = {c for c, _ in timed}
    out: dict[str, dict[str, dict]] = {m: {} for m in methods}
    for c, prompts in levels:
        for m, (llm, extra) in methods.items():
            if c not in decoded:
                out[m]["1"] = _level_one(runs[m])
                continue
            if m not in finalists:
                continue
            bar.set_postfix_str(f"{m} x{c}")
            r = llm.generate_closed_loop(
                prompts, c, cfg.max_new_tokens, temperature=temperature, extra_args=extra
            )
            out[m][str(c)] = {
                "tokens_per_s": r.tokens_per_s,
                "tau": r.spec.tau,
                "requests": len(prompts),
                "seconds": r.seconds,
            }
            bar.update(len(prompts))
    return out


def render_table(report: dict) -> str:
    """A readable summary table (rich), one row per method."""
    table = Table(title=f"draftlab bench: {report['target']} on {report['device']}")
    vllm = report.get("vllm") is not None
    cols = ("method", "tokens/s", "tau", "speedup vs ar", "greedy match (prompts/tokens)")
    for col in cols + (("speedup vs vllm_ar",) if vllm else ()):
        table.add_column(col, justify="right" if col != "method" else "left")

    for m, s in report["methods"].items():
        extra = (speedup_text(s, "speedup_vs_vllm_ar"),) if vllm else ()
        match = "n/a"
        if s.get("greedy_match_rate") is not None:
            match = f"{s['greedy_match_rate']:.0%} / {s['greedy_token_match_rate']:.1%}"
        speed = (f"{s['tokens_per_s']:.2f}", f"{s['tau']:.2f}", speedup_text(s, "speedup_vs_ar"))
        table.add_row(m, *speed, match, *extra)
    console = Console(record=True, width=100)
    with console.capture() as cap:
        console.print(table)
        ident = (
            report["greedy_identical"]
            if report["greedy_checked"]
            else ("n/a (sampling)" if report["temperature"] else "n/a (no draftlab_* method)")
        )
        console.print(
            f"greedy_identical: {ident}   prompts: {report['prompts']}   max_new_tokens: "
            f"{report['max_new_tokens']}"
        )
        if report.get("greedy_mismatches"):
            console.print(
                "greedy outputs that left ar's: "
                f"{describe_mismatches(report['greedy_mismatches'])} (greedy_mismatches in the "
                "JSON)"
            )
        if cov := report.get("drafter_head_coverage"):
            low = min(cov["by_category"].items(), key=lambda kv: kv[1])
            console.print(
                f"drafter head scores {cov['all']:.1%} of the target's output tokens "
                f"(lowest: {low[0]} {low[1]:.1%}); the rest are certain misses"
            )
        if vllm:
            vident = report["vllm_greedy_identical"] if report["vllm_greedy_checked"] else "n/a"
            console.print(
                f"vllm_greedy_identical: {vident}   vllm_ar_matches_ar: "
                f"{report['vllm_ar_matches_ar']}"
            )
        groups = report["order"]["groups"]
        console.print(
            f"{report['order']['passes']} pass(es), every method on each prompt in turn"
            + (f", in {len(groups)} groups one after another: " if len(groups) > 1 else "")
            + "; ".join(", ".join(g) for g in groups if len(groups) > 1)
        )
        if load := report.get("load"):
            console.print(load_table(load))
        if v := report.get("verdict"):
            console.print(f"verdict: deploy {v['served']} {v['deploy']}\n  {v['reason']}")
    return cap.get()


def load_table(load: dict[str, dict[str, dict]]) -> Table:
    """tokens/s (and x vllm_ar) of each vLLM method at each load level."""
    levels = sorted({int(c) for rows in load.values() for c in rows})
    table = Table(title="under load: output tokens/s (x vllm_ar), closed loop")
    table.add_column("method")
    for c in levels:
        table.add_column(f"{c} in flight", justify="right")
    for m, rows in load.items():
        cells = []
        for c in levels:
            r = rows.get(str(c))
            x = r and r.get("speedup_vs_vllm_ar")
            cells.append(
                "" if r is None else f"{r['tokens_per_s']:.1f}" + (f" ({x:.2f}x)" if x else "")
            )
        table.add_row(m, *cells)
    return table
