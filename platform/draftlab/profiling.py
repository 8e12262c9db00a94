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
from draftlab.decoding.cache import keep_rows
from draftlab.hardware import describe_device, sync
from draftlab.models.drafters.network import init_drafter
from draftlab.models.target import Target, load_target


def _median_ms(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_target(target: Target, context: int, sizes: list[int], repeats: int) -> dict[str, float]:
    dev = target.device
    gen = torch.Generator().manual_seed(0)
    ctx_ids = torch.randint(0, target.vocab_size, (context,), generator=gen).to(dev)
    cache = target.new_cache()
    target.forward(ctx_ids, torch.arange(context, device=dev), cache)
    out = {}
    for n in tqdm(sizes, desc="target forward", leave=False):
        ids = torch.randint(0, target.vocab_size, (n,), generator=gen).to(dev)
        pos = torch.arange(context, context + n, device=dev)

        def step(ids=ids, pos=pos):
            target.forward(ids, pos, cache)
            keep_rows(cache, context, [])  # roll back to the context

        out[str(n)] = _median_ms(step, repeats, dev)
    return out


def profile_drafters(target: Target, context: int, depths: list[int], ks: list[int], repeats: int) -> dict:
    dev = target.device
    tok = torch.tensor([1], device=dev)
    hid = torch.zeros(1, target.hidden_size, device=dev, dtype=target.dtype)
    ctx_tok = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).to(dev)
    ctx_hid = torch.zeros(context, target.hidden_size, device=dev, dtype=target.dtype)
    out: dict[str, dict[str, dict[str, float]]] = {}
    points = [(f, d) for f in ("parallel", "autoregressive") for d in depths]
    for family, depth in tqdm(points, desc="drafter", leave=False):
        drafter = init_drafter(family, target, k=max(ks), depth=depth)
        state = drafter.new_state()
        drafter.propose(state, ctx_tok, ctx_hid, 1, lambda j, lg: int(lg.argmax()))
        row = {}
        for k in ks:

            def step(k=k, drafter=drafter, state=state):
                drafter.propose(state, tok, hid, k, lambda j, lg: int(lg.argmax()))
                state.cache.crop(-1)  # undo the committed entry: keep the context fixed
                state.pos -= 1

            row[str(k)] = _median_ms(step, repeats, dev)
        out.setdefault(family, {})[str(depth)] = row
    return out


def run_profile(cfg: ProfileConfig) -> dict:
    target = load_target(cfg.target)
    report = {
        "target": target.name,
        "device": describe_device(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "context": cfg.context,
        "repeats": cfg.repeats,
        "target_forward_ms": profile_target(target, cfg.context, cfg.new_tokens, cfg.repeats),
        # drafter_ms[family][depth][k]: one drafting round of k tokens
        "drafter_ms": profile_drafters(target, cfg.context, cfg.depths, cfg.ks, cfg.repeats),
    }
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report
