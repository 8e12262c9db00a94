"""`draftlab profile`: what verification and drafting cost on this hardware.

t_target(n): one target forward of n new tokens over a cached context (the verify cost of
an n-node tree; n = 1 is a plain decoding step). t_draft(family, depth, k): one drafting
round of an (untrained: cost does not depend on weights) drafter. The sweep's tree search
turns expected accepted lengths into expected speedups with these numbers.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from draftlab.config import ProfileConfig
from draftlab.decoding.acceptance import greedy_tokens
from draftlab.decoding.cache import keep_rows
from draftlab.decoding.engine import verify_plan
from draftlab.decoding.tree import Tree
from draftlab.decoding.tree_files import resolve_tree
from draftlab.hardware import describe_device, sync
from draftlab.models.drafters.build import init_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target, load_target

MAX_TREE_DEPTH = 64  # `chain` alone in `trees` = a 64-deep chain; deeper trees are kept whole


def _median_ms(fns: list[Callable[[], None]], repeats: int, device: torch.device) -> list[float]:
    """Median ms of each function, timed round-robin (one call each per round) so that a
    machine slowing down or speeding up during the measurement shifts them all alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            out.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def _cached_context(target: Target, context: int) -> tuple[object, torch.Generator]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (context,), generator=gen).to(target.device)
    cache = target.new_cache()
    target.forward(ids, torch.arange(context, device=target.device), cache, last_logits=True)
    return cache, gen


def verify_ms(target: Target, trees: list[Tree | None], context: int, repeats: int) -> list[float]:
    """Median ms of one verify forward of each tree (root + nodes, row-exact attention, as
    the engine runs it) over `context` cached tokens; None = a decoding step (one token)."""
    dev = target.device
    cache, gen = _cached_context(target, context)
    steps = []
    for tree in trees:
        rows, depths = None, torch.zeros(1, dtype=torch.long)
        if tree is not None:
            rows, depths = (
                verify_plan(tree, context, *(t.to(dev) for t in tree.ancestor_rows)),
                tree.depths,
            )
        ids = torch.randint(0, target.vocab_size, (len(depths),), generator=gen).to(dev)
        pos = context + depths.to(dev)

        def step(ids=ids, pos=pos, rows=rows):
            target.forward(ids, pos, cache, rows=rows)
            keep_rows(cache, context, [])  # roll back to the context

        steps.append(step)
    return _median_ms(steps, repeats, dev)


def profile_target(
    target: Target, context: int, sizes: list[int], repeats: int
) -> dict[str, float]:
    """t_target(n): verifying an n-row chain (n = 1: a decoding step)."""
    trees = [Tree.chain(n - 1) if n > 1 else None for n in sizes]
    return {
        str(n): ms for n, ms in zip(sizes, verify_ms(target, trees, context, repeats), strict=True)
    }


def profile_trees(
    target: Target, context: int, trees: dict[str, Tree], repeats: int
) -> dict[str, dict]:
    """Each tree's verify forward beside a decoding step (timed round-robin): its rows
    (root + nodes), ms, and ms in decoding steps."""
    step, *costs = verify_ms(target, [None, *trees.values()], context, repeats)
    return {
        spec: {"rows": len(tree.depths), "ms": ms, "steps": ms / step}
        for (spec, tree), ms in zip(trees.items(), costs, strict=True)
    }


def draft_ms(drafter: DrafterNet, k: int, context: int, repeats: int) -> float:
    """Median ms of one drafting round of k tokens (one new committed entry) after `context`."""
    dev, target_dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    hidden = drafter.feature_size
    ctx_tok = torch.randint(
        0, drafter.target_vocab_size, (context,), generator=torch.Generator().manual_seed(0)
    ).to(dev)
    state = drafter.new_state()
    drafter.propose(
        state, ctx_tok, torch.zeros(context, hidden, device=dev, dtype=target_dtype), 1, _argmax
    )
    tok, hid = torch.tensor([1], device=dev), torch.zeros(1, hidden, device=dev, dtype=target_dtype)

    def step():
        drafter.propose(state, tok, hid, k, _argmax)
        state.cache.crop(-1)  # undo the committed entry: keep the context fixed
        state.pos -= 1

    with torch.inference_mode():
        return _median_ms([step], repeats, dev)[0]


def _argmax(j: int, logits: torch.Tensor) -> int:
    return int(greedy_tokens(logits))  # the engine's greedy pick, so the profile times what it runs


def profile_drafters(
    target: Target, context: int, depths: list[int], ks: list[int], repeats: int
) -> dict:
    out: dict[str, dict[str, dict[str, float]]] = {}
    points = [(f, d) for f in ("p-eagle", "parallel", "autoregressive") for d in depths]
    for family, depth in tqdm(points, desc="drafter", leave=False):
        drafter = init_drafter(family, target, k=max(ks), depth=depth)
        out.setdefault(family, {})[str(depth)] = {
            str(k): draft_ms(drafter, k, context, repeats) for k in ks
        }
    return out


def run_profile(cfg: ProfileConfig) -> dict:
    trees = {
        spec: resolve_tree(spec, None, k=MAX_TREE_DEPTH, cut=False) for spec in cfg.trees
    }  # bad specs fail first
    target = load_target(cfg.target)
    report = {
        "target": target.name,
        "device": describe_device(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "context": cfg.context,
        "repeats": cfg.repeats,
        "target_forward_ms": profile_target(target, cfg.context, cfg.new_tokens, cfg.repeats),
        # tree_verify[spec]: {"rows", "ms", "steps" (ms over one decoding step's)}
        "tree_verify": profile_trees(target, cfg.context, trees, cfg.repeats),
        # drafter_ms[family][depth][k]: one drafting round of k tokens
        "drafter_ms": profile_drafters(target, cfg.context, cfg.depths, cfg.ks, cfg.repeats),
    }
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report
