"""The verdict of a bench with vLLM contenders: which served configuration to deploy, and with
which batch-size schedule of draft tokens.

    report["load"]    {method: {"1": {tokens_per_s, tau}, "4": ..., "16": ...}}
                      (the levels: bench.concurrency)
    verdict(report)   {"served": method, "deploy": VllmServeArgs fields, "levels": [...],
                       "reason": ...}

The served configuration is the contender with the most tokens/s one request at a time over
all the bench's prompts (`vllm_ar` included: when target-only decoding wins, the verdict says
so and deploys it). Its schedule comes from the load levels: at each measured level it drafts
its k where it beat `vllm_ar` at that level and 0 where it lost; batch sizes between two won
levels draft, those between a won and a lost one do not (`schedule`), and the last range
reaches any batch size.
"""

from __future__ import annotations

MAX_BATCH = (
    1024  # the schedule's last range ends here (vLLM carries it on past max_num_seqs anyway)
)
SUFFIX_DEPTH = (
    24  # vLLM's default suffix_decoding_max_tree_depth: suffix drafting's k when none is set
)


def add_load_speedups(load: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """`speedup_vs_vllm_ar` on every load level of every method (in place; returned)."""
    base = load.get("vllm_ar", {})
    for levels in load.values():
        for c, row in levels.items():
            ar = base.get(c, {}).get("tokens_per_s")
            row["speedup_vs_vllm_ar"] = row["tokens_per_s"] / ar if ar else None
    return load


def schedule(
    levels: list[int], drafts: list[bool], k: int, max_batch: int = MAX_BATCH
) -> list[list[int]]:
    """Inclusive [first, last, k or 0] batch-size ranges: it drafts k at the batch sizes from
    one level it won (`drafts[i]`) to the next it won, and 0 elsewhere: between a won and a lost
    level it does not draft (drafting that costs throughput under load is the worse error);
    neighbouring ranges of the same k merge, and the last range reaches `max_batch`.

    >>> schedule([1, 4, 16], [True, True, False], 3)
    [[1, 4, 3], [5, 1024, 0]]
    """
    if len(levels) != len(drafts) or not levels:
        raise ValueError(f"one draft decision per level: {levels} vs {drafts}")
    out: list[list[int]] = []
    first = 1
    for i, c in enumerate(levels):
        if i == len(levels) - 1:
            last = max_batch
        elif (
            drafts[i] and not drafts[i + 1]
        ):  # nothing measured between a won and a lost level: 0 there
            last = c
        else:
            last = levels[i + 1] - 1
        n = k if drafts[i] else 0
        if out and out[-1][2] == n:
            out[-1][1] = last
        else:
            out.append([first, last, n])
        first = last + 1
    return out


def _deploy(method: str, report: dict, cfg) -> tuple[dict, int]:
    """The `VllmServeArgs` fields that serve `method` as it was measured, and the tokens its
    engine drafts a step (the schedule's non-zero k)."""
    specs = report["vllm"]["speculative_config"]
    if method == "vllm_ar":
        return {"speculation": "off"}, 0
    engine, _, k = method.partition("@k")
    if engine in ("vllm_ngram", "vllm_suffix"):  # @k: its drafts were capped at k per request
        k = int(k) if k else specs[engine].get("num_speculative_tokens")
        return {
            "speculation": "on",
            "method": engine.removeprefix("vllm_"),
            "num_speculative_tokens": k,
            "ngram_min": cfg.vllm.ngram_min,
            "ngram_max": cfg.vllm.ngram_max,
            "suffix_cached_requests": cfg.vllm.suffix_cached_requests,
        }, k or SUFFIX_DEPTH
    lookups = report["vllm"]["lookups"].get(engine, {}).get("draftlab_lookup", {})
    if k:  # deployed as an engine of its own k
        return {
            "speculation": "on",
            "method": "drafter",
            "num_speculative_tokens": int(k),
            "prompt_lookup": "off",
        }, int(k)
    k = lookups.get("draft_tokens") or specs[engine]["num_speculative_tokens"]
    return (
        {
            "speculation": "on",
            "method": "drafter",
            "num_speculative_tokens": k,
            "prompt_lookup": "on" if lookups.get("spec") else "off",
        },
        specs[engine]["num_speculative_tokens"],
    )


def verdict(report: dict, cfg) -> dict:
    """The configuration to deploy from a bench report with `vllm_*` methods (module doc)."""
    methods = {m: s for m, s in report["methods"].items() if m.startswith("vllm_")}
    served = max(methods, key=lambda m: methods[m]["tokens_per_s"])
    deploy, drafted = _deploy(served, report, cfg)
    load = report.get("load") or {}
    levels = sorted(int(c) for c in load.get(served, {}))
    rows = []
    for c in levels:
        row = load[served][str(c)]
        rows.append(
            {
                "concurrency": c,
                "tokens_per_s": row["tokens_per_s"],
                "vllm_ar_tokens_per_s": load["vllm_ar"][str(c)]["tokens_per_s"],
                "drafts": bool((row["speedup_vs_vllm_ar"] or 0) > 1.0),
            }
        )
    if served != "vllm_ar" and rows:
        deploy["schedule"] = schedule(levels, [r["drafts"] for r in rows], drafted)
    one = methods[served]["speedup_vs_vllm_ar"]
    if served == "vllm_ar":
        reason = (
            "target-only vLLM was the fastest one request at a time: no speculation is deployed"
        )
    elif not served.startswith("vllm_draftlab"):
        reason = (
            f"vLLM's own {served.removeprefix('vllm_')} drafting (untrained) was the fastest one "
            f"request at a time ({one:.2f}x vllm_ar), faster than the trained drafter: it is "
            "deployed"
        )
    else:
        reason = (
            f"the trained drafter ({served}) was the fastest one request at a time ({one:.2f}x "
            "vllm_ar)"
        )
    return {
        "served": served,
        "deploy": deploy,
        "levels": rows,
        "reason": reason,
        "speedup_vs_vllm_ar": one,
        "prompts": report["prompts"],
    }
