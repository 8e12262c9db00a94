"""The lossless-sampling tests' decoders and sample draws (`decoding/test_lossless_sampling.py`),
importable by a second process: `draw_both` draws half of a case's seeds in a spawned worker
and half here, so a case uses both cores (each process runs torch on one thread: the
matrices are tiny). One seed per sample, so which process draws a sample does not change it.
"""

from __future__ import annotations

import functools
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import NamedTuple

import torch

from draftlab.config import NgramSpec, SamplingParams
from draftlab.decoding.engine import SpeculativeDecoder
from draftlab.decoding.tree import Tree, load_tree
from draftlab.models.drafters.build import init_drafter
from draftlab.models.fingerprint import weights_fingerprint
from draftlab.models.target import load_target

V = 8
LENGTH = 3  # tokens whose joint distribution is enumerated: V**LENGTH = 512 outcomes
PROMPT = [4, 5, 5]  # chosen for a spread-out target distribution (entropy ~3.1 nats at T=1)
WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
TARGET = "tiny-llama-v8"


def tree_named(name: str) -> Tree:
    """A preset, or `wide-7` (WIDE); `@n` verifies n of its nodes per round (`per_round`)."""
    base, _, per_round = name.partition("@")
    tree = Tree.from_paths(WIDE, name="wide-7") if base == "wide-7" else load_tree(base)
    return tree.with_per_round(int(per_round)) if per_round else tree


@functools.cache
def target():
    """This process's tiny-llama-v8 (seeded: the same weights in every process)."""
    return load_target(TARGET)


@functools.cache
def decoder(family: str, tree: str, ngram: tuple | None = None) -> SpeculativeDecoder:
    """An untrained drafter (q far from p) of `family` on `tree`; `ngram`: NgramSpec items."""
    shape = tree_named(tree)
    if ngram is not None:
        shape = shape.with_ngram(NgramSpec(**dict(ngram)))
    return SpeculativeDecoder(target(), init_drafter(family, target(), k=4, depth=1, seed=0), shape)


class Draw(NamedTuple):
    """One `generate` of PROMPT."""

    tokens: tuple[int, ...]
    accepted: int  # drafts accepted
    rounds: int
    grafted: int  # rounds that verified more than the tree's own nodes (grafted lookups)


def draw(case: tuple, params: dict, seeds: list[int]) -> list[Draw]:
    """One `Draw` per seed, in order."""
    dec, out = decoder(*case), []
    for seed in seeds:
        session = dec.start(PROMPT, SamplingParams(max_new_tokens=LENGTH, seed=seed, **params))
        rounds = grafted = 0
        while not session.done:
            before = session.stats.drafted
            session.step()
            rounds += 1
            grafted += session.stats.drafted - before > dec.tree.num_nodes
        result = session.result()
        out.append(Draw(tuple(result.tokens), result.stats.accepted, rounds, grafted))
    return out


def _worker_init() -> None:
    torch.set_num_threads(1)


def _fingerprint() -> str:
    return weights_fingerprint(target().model)


def worker_pool() -> Executor:
    """One spawned worker process (fork is unsafe once torch's OpenMP threads exist), checked
    to hold the same target weights as this process."""
    pool = ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
    )
    if pool.submit(_fingerprint).result(timeout=240) != _fingerprint():
        pool.shutdown()
        raise AssertionError(
            "the worker process's tiny-llama-v8 weights differ from this process's"
        )
    return pool


def draw_both(pool: Executor, case: tuple, params: dict, seeds: list[int]) -> list[Draw]:
    """`draw` of `seeds`: the first half in `pool`'s worker, the rest here, in seed order."""
    half = len(seeds) // 2
    theirs = pool.submit(draw, case, params, seeds[:half])
    ours = draw(case, params, seeds[half:])
    return theirs.result(timeout=280) + ours
