"""Draft -> verify -> accept, with KV caches for target and drafter and rollback.

Invariants between rounds (n = committed tokens so far, prompt included):
  * the target cache holds tokens 0..n-2; token n-1 (the last bonus, `root`) is not in it;
  * the drafter has `pending` entries (token x_t, target features h_{t-1}) not yet committed.
A round (`step_many`, top-down in this file):
  1. draft (`Session.draft`): the drafter commits `pending` and drafts a tree (plus grafted
     lookups) into a `Block`;
  2. verify (`verify`): the target scores root + drafts in one forward (each row attends to
     the context and its tree ancestors, position = n-1 + depth);
  3. accept (`Session.accept`): the walk accepts a path; the target cache keeps root +
     accepted rows; the accepted tokens and the bonus become the next `pending`.

Greedy output equals target-only greedy decoding token for token; sampled output has the
target's distribution (see `acceptance.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftlab.config import SamplingParams
from draftlab.decoding.acceptance import (
    greedy_tokens,
    greedy_walk,
    process_logits,
    sample,
    sampled_walk,
)
from draftlab.decoding.cache import keep_rows
from draftlab.decoding.ngram import NgramIndex, NgramStore, graft
from draftlab.decoding.stopping import Stopper
from draftlab.decoding.tree import Topology, Tree
from draftlab.models.attention import RowPlan
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target


@dataclass
class DecodeStats:
    new_tokens: int = 0
    rounds: int = 0  # target forwards after the prefill
    drafted: int = 0  # draft tokens verified (tree: nodes)
    accepted: int = 0  # draft tokens accepted
    accepted_at: list[int] = field(default_factory=list)  # rounds accepting >= j+1 drafts
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per target forward, bonus included (1.0 for target-only)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.rounds for a in self.accepted_at] if self.rounds else []

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def record(self, drafted: int, accepted: int, depth: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        width = max(depth, accepted)  # grafted lookups may accept past the tree's depth
        if len(self.accepted_at) < width:
            self.accepted_at += [0] * (width - len(self.accepted_at))
        for j in range(accepted):
            self.accepted_at[j] += 1

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": self.tau,
            "per_position_acceptance": self.per_position_acceptance,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str
    stats: DecodeStats


@dataclass(kw_only=True)  # seven fields, three of them often None: named at every call
class Block:
    """What one round hands the target: tokens, positions and the keys each row sees
    (`verify_plan`), plus what acceptance needs afterwards."""

    ids: torch.Tensor  # (T,) root, then the drafted nodes
    positions: torch.Tensor  # (T,)
    rows: list | RowPlan  # keys per row, relative to this session's cache
    tree: (
        Topology | None
    )  # the round's tree (static, or with grafted n-gram nodes); None = no drafts
    draft_logits: torch.Tensor | None  # (k, V)
    sampled_drafts: bool | None  # chain drafts sampled from q (lossless sampling needs q)
    draft_s: float


def step_many(
    sessions: list[Session],
    speculate: list[bool],
    on_error: Callable[[Session, Exception], None] | None = None,
) -> None:
    """One round of several sessions, as the method names it: each session drafts (or not:
    `speculate`), one target forward verifies every block (`verify`), each session accepts.

    `on_error(session, exc)` isolates failures (default: raise): a session whose drafting
    or acceptance fails is reported alone; a failed shared forward reports every session
    in it, since their caches may be half-updated."""

    def fail(s: Session, e: Exception) -> None:
        if on_error is None:
            raise e
        on_error(s, e)

    live, blocks = [], []
    for s, sp in zip(sessions, speculate, strict=True):  # 1. draft
        if s.done:
            continue
        try:
            blocks.append(s.draft(sp))
            live.append(s)
        except Exception as e:
            fail(s, e)
    if not live:
        return
    try:  # 2. verify
        outs, verify_s = verify(live, blocks)
    except Exception as e:
        for s in live:
            fail(s, e)
        return
    for s, b, (logits, hid) in zip(live, blocks, outs, strict=True):  # 3. accept
        try:
            s.accept(b, logits, hid, verify_s)
        except Exception as e:
            fail(s, e)


def verify(
    sessions: list[Session], blocks: list[Block]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """The target scores every session's block in one forward (`Target.forward_many`: each
    row sees only its own session's keys, so the outputs equal one forward per session) and
    appends the blocks' rows to the sessions' caches; `accept` keeps the accepted ones.
    Returns per session (logits (T, V), states (T, F)) and the forward's seconds per session."""
    dec = sessions[0].dec
    t0 = time.perf_counter()
    outs = dec.target.forward_many(
        [(b.ids, b.positions, s.cache, b.rows) for s, b in zip(sessions, blocks, strict=True)],
        dec.aux_layers,
    )
    return outs, (time.perf_counter() - t0) / len(sessions)  # the shared forward, split evenly


class SpeculativeDecoder:
    """Speculative decoding with a drafter and a tree, one request per `Session`.

    `tree` = `Tree.chain(k)` for chain verification (drafts are *sampled* from the drafter
    when sampling), any other tree for top-k tree verification (deterministic drafts; a
    `per_round` tree verifies each round the part of it the drafter rates likeliest).
    A tree with `ngram` set grafts prompt-lookup drafts onto itself each round
    (`decoding/ngram.py`; from `store`, the drafter's `NgramStore`, where the text has no
    match), except onto sampled chain drafts, whose lossless walk assumes one draft per
    position.
    """

    def __init__(
        self, target: Target, drafter: DrafterNet, tree: Tree, store: NgramStore | None = None
    ):
        drafter.check_k(tree.depth)
        self.target, self.drafter, self.tree, self.store = target, drafter, tree, store
        self.aux_layers = drafter.aux_layers  # target states the drafter fuses
        dev = target.device
        self._depths = tree.depths.to(dev)  # (N+1,)
        self._ancestors, self._counts = (t.to(dev) for t in tree.ancestor_rows)

    def start(self, prompt: list[int], params: SamplingParams) -> Session:
        """Prefill `prompt`; `Session.step()` then decodes it a round at a time."""
        return Session(self, prompt, params)

    def generate(self, prompt: list[int], params: SamplingParams) -> GenerationResult:
        session = self.start(prompt, params)
        while not session.done:
            session.step()
        return session.result()


class Session:
    """One request's decoding state, advanced a round at a time by `step()`.

    A server batches the sessions of concurrent requests round by round (`step_many`); each
    owns its target and drafter caches, so they share no state. `step(speculate=False)` is a plain
    target decode step (a round verifying no drafts): the drafter's pending entries grow
    and are committed by the next speculative round, so a session may switch freely.
    """

    @torch.inference_mode()
    def __init__(self, dec: SpeculativeDecoder, prompt: list[int], params: SamplingParams):
        self.dec, self.params = dec, params
        target, dev = dec.target, dec.target.device
        self.t_start = time.perf_counter()
        self.stats, self.gen = DecodeStats(), _generator(params, dev)
        self.stopper = Stopper(target.tokenizer, target.eos_token_ids, params)
        self.cache, hidden, self.root = _prefill(
            target, prompt, params, self.gen, self.stats, dec.aux_layers
        )
        self.state = dec.drafter.new_state()
        self.ctx = len(prompt)  # target cache length (the root is not in it)
        # Pending drafter entries: (x_t, h_{t-1}) for t = 1..n-1 and the first new token.
        self.pend_tok = torch.tensor(prompt[1:] + [self.root], device=dev)
        self.pend_hid = hidden
        self.lookup = (
            NgramIndex(dec.tree.ngram, prompt + [self.root], dec.store) if dec.tree.ngram else None
        )
        self.done = self.stopper.feed([self.root])

    @property
    def tokens(self) -> list[int]:
        """Output tokens committed so far (cut at the stopping token)."""
        return self.stopper.tokens

    def step(self, speculate: bool = True) -> None:
        """One round: draft (or not), verify in one target forward, accept."""
        step_many([self], [speculate])

    @torch.inference_mode()
    def draft(self, speculate: bool = True) -> Block:
        """Draft this round (or not) and return the block the target must verify."""
        dec, params = self.dec, self.params
        tree, dev = dec.tree, dec.target.device
        t0 = time.perf_counter()
        if not speculate:  # a plain decode step: the root alone, through the same verify attention
            return Block(
                ids=torch.tensor([self.root], device=dev),
                positions=torch.tensor([self.ctx], device=dev),
                rows=[self.ctx + 1],
                tree=None,
                draft_logits=None,
                sampled_drafts=None,
                draft_s=0.0,
            )
        sample_drafts = tree.is_chain and not params.greedy

        def pick(j: int, logits: torch.Tensor) -> int:
            if not sample_drafts:
                return int(greedy_tokens(logits))
            return sample(process_logits(logits, params.temperature, params.top_p), self.gen)

        drafts, dlogits = dec.drafter.propose(
            self.state, self.pend_tok, self.pend_hid, tree.depth, pick
        )  # (k,), (k, V)
        self.pend_tok, self.pend_hid = self.pend_tok[:0], self.pend_hid[:0]  # committed
        if tree.is_chain:
            shape, nodes = (
                tree,
                torch.cat([torch.tensor([self.root], device=dev), drafts]),
            )  # (k+1,)
        else:
            shape, nodes = tree.round_tree(
                self.root, dlogits
            )  # the tree, or this round's part of it
        if self.lookup is not None and not sample_drafts:  # this round's tree plus the lookups
            ids = nodes.tolist()
            # the drafter's likeliest path (its argmax at every depth) and first-position
            # candidates carried on, then the copied span (grafted last: its rows lead the block)
            carried = (
                self.lookup.carried(drafts.tolist(), [ids[c] for c in shape.children[0]])
                if tree.ngram.extend
                else []
            )
            grown = shape
            for branch in (*carried, self.lookup.propose()):
                if branch:
                    grown, ids = graft(grown, ids, branch)
            if grown is not shape:
                shape, nodes = grown, torch.tensor(ids, device=dev)
        if shape is tree:  # the static tree's buffers, built once
            rows = verify_plan(tree, self.ctx, dec._ancestors, dec._counts)
            return Block(
                ids=nodes,
                positions=self.ctx + dec._depths,
                rows=rows,
                tree=tree,
                draft_logits=dlogits,
                sampled_drafts=sample_drafts,
                draft_s=time.perf_counter() - t0,
            )
        ancestors, counts = (t.to(dev) for t in shape.ancestor_rows)
        return Block(
            ids=nodes,
            positions=self.ctx + shape.depths.to(dev),
            rows=verify_plan(shape, self.ctx, ancestors, counts),
            tree=shape,
            draft_logits=dlogits,
            sampled_drafts=False,
            draft_s=time.perf_counter() - t0,
        )

    @torch.inference_mode()
    def accept(
        self, block: Block, logits: torch.Tensor, hid: torch.Tensor, verify_s: float
    ) -> None:
        """Walk `block`'s tree against the target's `logits` (T, V) (greedy or lossless
        sampling), keep the accepted rows of the target cache and `hid` (T, F), and commit the
        accepted tokens and the bonus."""
        params, dev = self.params, self.dec.target.device
        node_list = block.ids.tolist()
        if block.tree is None:
            accepted, bonus = [], _choose(logits[0], params, self.gen)
        elif params.greedy:
            accepted, bonus = greedy_walk(block.tree, node_list, logits)
        else:
            probs = process_logits(logits, params.temperature, params.top_p)  # (N+1, V)
            q = (
                process_logits(block.draft_logits, params.temperature, params.top_p)
                if block.sampled_drafts
                else None
            )
            accepted, bonus = sampled_walk(block.tree, node_list, probs, q, self.gen)
        keep = [0] + accepted
        keep_rows(self.cache, self.ctx, keep)
        self.ctx += len(keep)
        new = [node_list[i] for i in accepted] + [bonus]
        self.pend_tok = torch.cat([self.pend_tok, torch.tensor(new, device=dev)])
        self.pend_hid = torch.cat(
            [self.pend_hid, hid[keep]]
        )  # (m+1, F): the states that produced each new token
        self.root = bonus
        self.stats.draft_s += block.draft_s
        self.stats.verify_s += verify_s
        self.stats.record(
            drafted=block.ids.numel() - 1, accepted=len(accepted), depth=self.dec.tree.depth
        )
        if self.lookup is not None:
            self.lookup.extend(new)
        self.done = self.stopper.feed(new)

    def result(self) -> GenerationResult:
        return _finish(self.stopper, self.stats, self.t_start)


def verify_plan(
    tree: Topology, ctx: int, ancestors: torch.Tensor, counts: torch.Tensor
) -> list | RowPlan:
    """Keys each verified row of `tree` sees after `ctx` cached tokens (the context, then its
    ancestors and itself), for the target's verify attention (row-exact on CPU, fused on
    CUDA: `attention.choose`). A chain's rows are causal prefixes; `ancestors`, `counts` =
    `tree.ancestor_rows` on the target's device."""
    if tree.is_chain:
        return [ctx + i + 1 for i in range(tree.num_nodes + 1)]
    return RowPlan.tree(ctx, ancestors, counts, tree.ancestor_counts)  # sizes: no device read-back


@torch.inference_mode()
def autoregressive_generate(
    target: Target, prompt: list[int], params: SamplingParams
) -> GenerationResult:
    """Target-only decoding with a KV cache: the reference every speedup is measured against."""
    t_start = time.perf_counter()
    stats, gen = DecodeStats(), _generator(params, target.device)
    stopper = Stopper(target.tokenizer, target.eos_token_ids, params)
    cache, _, tok = _prefill(target, prompt, params, gen, stats)
    pos = len(prompt)
    while not stopper.feed([tok]):
        t0 = time.perf_counter()
        logits, _ = target.forward(
            torch.tensor([tok], device=target.device),
            torch.tensor([pos], device=target.device),
            cache,
        )
        tok = _choose(logits[-1], params, gen)
        pos += 1
        stats.verify_s += time.perf_counter() - t0
        stats.record(drafted=0, accepted=0, depth=0)
    return _finish(stopper, stats, t_start)


def _generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def _choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Next token from (V,) target logits: argmax, or a sample of the processed distribution."""
    if params.greedy:
        return int(greedy_tokens(logits))
    return sample(process_logits(logits, params.temperature, params.top_p), gen)


def _prefill(
    target: Target,
    prompt: list[int],
    params: SamplingParams,
    gen,
    stats: DecodeStats,
    aux_layers: tuple[int, ...] = (),
):
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    t0 = time.perf_counter()
    ids = torch.tensor(prompt, device=target.device)
    cache = target.new_cache()
    logits, hidden = target.forward(
        ids,
        torch.arange(len(prompt), device=target.device),
        cache,
        aux_layers=aux_layers,
        last_logits=True,
    )  # (1, V), (T, F)
    first = _choose(logits[-1], params, gen)
    stats.prefill_s = time.perf_counter() - t0
    return cache, hidden, first


def _finish(stopper: Stopper, stats: DecodeStats, t_start: float) -> GenerationResult:
    stats.total_s = time.perf_counter() - t_start
    stats.new_tokens = len(stopper.tokens)
    return GenerationResult(stopper.tokens, stopper.text, stopper.finish_reason or "length", stats)
