"""Sampled speculative decoding is lossless: its output has exactly the target's distribution.

Method. `tiny-llama-v8` has an 8-token vocabulary and no EOS, so the joint distribution of
the first three generated tokens has only 8**3 = 512 outcomes. We compute it *exactly* by
enumeration: decoding each of the 64 two-token prefixes step by step gives p(t1 | prompt),
p(t2 | prompt, t1) and p(t3 | prompt, t1, t2), each processed with the engine's own
`process_logits(logits, temperature, top_p)`. We then draw N samples from
`SpeculativeDecoder.generate` (one seed per sample) with an *untrained* drafter, whose q is
far from p, so the accept/reject/residual machinery is exercised, and compare.

Statistics (both must pass):

* Chi-square goodness of fit. Outcomes whose expected count N*p is >= 5 are their own bin;
  all others are pooled into one bin (merged with the smallest bin if still < 5), so every
  expected count is >= 5 and the chi-square approximation holds. We assert p-value > ALPHA
  = 1e-3: for a correct sampler this fails with probability ~1e-3 per case (a union bound
  over 5 cases x 2 checks gives <= 1% for the whole file; the seeds are fixed, so the
  outcome is deterministic and a green run stays green).
* Total variation on the same bins. With K bins, E[TV] <= 1/2 sum_i sqrt(p_i (1-p_i) / N)
  (Jensen on each |p_hat_i - p_i|), and TV changes by at most 1/N when one sample changes,
  so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 N t^2). With t = sqrt(ln(1/DELTA) / (2N))
  the bound below fails for a correct sampler with probability <= DELTA = 1e-3.

Plus an exact support check: no sample may land on an outcome of probability 0 (top-p).

Power. The same statistic is computed on N samples of wrong distributions (the target at
another temperature; the "always accept the sampled drafts" distribution p(t1) q(t2) q(t3);
a deliberately broken acceptance rule run through the real engine) and must reject them,
so a pass above is evidence, not a statistic that cannot fail.

Cost: ~10-20 ms per `generate` call on one CPU core (the tiny model's forwards are Python
overhead). The six cases and the grafted-lookup case draw half of their N = 1500 samples
each in a second process (`lossless_support.draw_both`), so they use both cores; the
broken-engine run draws all of its samples here, where its patch applies.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import lossless_support
from draftlab.decoding import acceptance, engine
from draftlab.decoding.acceptance import process_logits
from draftlab.models.drafters.build import init_drafter
from lossless_support import LENGTH, PROMPT, Draw, V, draw, draw_both

N = 1500  # speculative samples per case
ALPHA = 1e-3  # chi-square: false-failure probability per case
DELTA = 1e-3  # TV bound: false-failure probability per case
MIN_EXPECTED = 5.0


# -- exact distribution ------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    t = lossless_support.target()  # the one the decoders of `draw` verify with
    assert t.vocab_size == V and not t.eos_token_ids  # no EOS: every sample has 3 tokens
    yield t
    torch.set_num_threads(threads)  # the rest of the suite runs as it would alone


@pytest.fixture(scope="module")
def pool():
    """The second process `draw_both` draws half of each case's samples in."""
    with lossless_support.worker_pool() as p:
        yield p


@torch.inference_mode()
def _target_step_logits(target, prompt: list[int]) -> torch.Tensor:
    """(V, V, 3, V) float64 logits: [t1, t2, j] = next-token logits after prompt + (t1, t2)[:j],
    computed as the engine computes them (the prompt's prefill, then decoding steps through
    row-exact attention): in bfloat16 a full forward's rows differ in the last bits, enough
    to move a token across the top-p boundary."""
    n, out = len(prompt), []
    for prefix in itertools.product(range(V), repeat=LENGTH - 1):  # 64 x (t1, t2)
        cache = target.new_cache()
        rows = [target.forward(torch.tensor(prompt), torch.arange(n), cache)[0][-1]]
        for i, tok in enumerate(prefix):
            rows.append(target.forward(torch.tensor([tok]), torch.tensor([n + i]), cache)[0][-1])
        out.append(torch.stack(rows))  # (3, V)
    return torch.stack(out).double().reshape(V, V, LENGTH, V)


def exact_distribution(target, prompt, temperature, top_p) -> torch.Tensor:
    """(512,) float64: P(t1, t2, t3) at index t1*64 + t2*8 + t3, processed as the engine does."""
    # process_logits computes in float32, as in the engine; products are taken in float64.
    p = process_logits(
        _target_step_logits(target, prompt), temperature, top_p
    ).double()  # (V, V, 3, V)
    p = p / p.sum(-1, keepdim=True)
    p1 = p[0, 0, 0]  # (V,) first token: prompt only (any t1, t2 row)
    p2 = p[:, 0, 1]  # (V, V) [t1, t2]: prompt + t1
    p3 = p[:, :, 2]  # (V, V, V) [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return joint.reshape(-1)


def nucleus_margin(target, prompt, temperature, top_p) -> float:
    """Min distance from top_p of the cumulative masses that decide nucleus membership."""
    if top_p >= 1.0:
        return float("inf")
    probs = torch.softmax(_target_step_logits(target, prompt) / temperature, -1)
    sp = probs.sort(-1, descending=True).values
    return float(((sp.cumsum(-1) - sp) - top_p).abs().min())


# -- statistics --------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: Q(df/2, x/2)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


def pooled_bins(probs: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Bins of outcome indices with expected count >= MIN_EXPECTED each (see module doc)."""
    expected = probs * n
    big = [torch.tensor([i]) for i in torch.nonzero(expected >= MIN_EXPECTED).flatten().tolist()]
    rest = torch.nonzero(expected < MIN_EXPECTED).flatten()
    if len(rest):
        if float(expected[rest].sum()) >= MIN_EXPECTED or not big:
            big.append(rest)
        else:  # merge the under-filled pool with the smallest individual bin
            smallest = min(range(len(big)), key=lambda b: float(expected[big[b]].sum()))
            big[smallest] = torch.cat([big[smallest], rest])
    return big


def goodness_of_fit(samples: list[tuple[int, ...]], probs: torch.Tensor) -> dict:
    """Chi-square and TV of `samples` (3-token tuples) against the exact `probs` (512,)."""
    n = len(samples)
    idx = torch.tensor([a * V * V + b * V + c for a, b, c in samples])
    counts = torch.bincount(idx, minlength=V**LENGTH).double()
    bins = pooled_bins(probs, n)
    obs = torch.stack([counts[b].sum() for b in bins])
    exp_p = torch.stack([probs[b].sum() for b in bins])
    expected = exp_p * n
    assert float(expected.min()) >= MIN_EXPECTED - 1e-9
    stat = float(((obs - expected) ** 2 / expected).sum())
    df = len(bins) - 1
    tv = 0.5 * float((obs / n - exp_p).abs().sum())
    tv_bound = 0.5 * float((exp_p * (1 - exp_p) / n).sqrt().sum()) + math.sqrt(
        math.log(1 / DELTA) / (2 * n)
    )
    return dict(
        n=n,
        bins=len(bins),
        chi2=stat,
        df=df,
        p_value=chi2_sf(stat, df),
        tv=tv,
        tv_bound=tv_bound,
        off_support=int(counts[probs == 0].sum()),
    )


def passes(s: dict) -> bool:
    return s["off_support"] == 0 and s["p_value"] > ALPHA and s["tv"] <= s["tv_bound"]


def _fmt(s: dict) -> str:
    return (
        f"N={s['n']} bins={s['bins']} chi2={s['chi2']:.1f} df={s['df']} p={s['p_value']:.3g} "
        f"TV={s['tv']:.4f} (bound {s['tv_bound']:.4f}) off_support={s['off_support']}"
    )


def _multinomial_samples(probs: torch.Tensor, n: int, seed: int) -> list[tuple[int, int, int]]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(probs.float(), n, replacement=True, generator=gen).tolist()
    return [(i // (V * V), (i // V) % V, i % V) for i in idx]


# -- the speculative sampler ---------------------------------------------------------------


def speculative_samples(draws: list[Draw]) -> tuple[list[tuple[int, ...]], float]:
    """The 3-token samples and the mean accepted drafts per sample."""
    assert all(len(d.tokens) == LENGTH for d in draws)
    return [d.tokens for d in draws], sum(d.accepted for d in draws) / len(draws)


CASES = [
    # (drafter family, tree, temperature, top_p)
    ("parallel", "chain-3", 1.0, 1.0),  # chain: drafts sampled from q, accept min(1, p/q)
    ("autoregressive", "chain-3", 0.7, 0.9),  # chain with temperature and nucleus
    ("parallel", "small-6", 1.0, 1.0),  # tree: deterministic top-k drafts (point masses)
    ("autoregressive", "wide-7", 1.0, 1.0),  # wide tree: 3 siblings at the root
    ("parallel", "wide-7", 0.7, 0.9),  # tree with nucleus: drafts may have p = 0
    ("p-eagle", "wide-7@3", 1.0, 1.0),  # 3 of its nodes per round, chosen by the drafter
]


@pytest.mark.slow
@pytest.mark.parametrize("family,tree,temperature,top_p", CASES)
def test_speculative_sampling_matches_exact_target_distribution(
    target, pool, family, tree, temperature, top_p
):
    # Float noise between the engine's cached forwards and our full forwards must not move
    # a token across the nucleus boundary, or the "exact" distribution would not be exact.
    assert nucleus_margin(target, PROMPT, temperature, top_p) > 1e-4
    exact = exact_distribution(target, PROMPT, temperature, top_p)
    seed0 = 100_000 * (1 + CASES.index((family, tree, temperature, top_p)))
    samples, mean_accepted = speculative_samples(
        draw_both(  # an untrained drafter: q != p
            pool,
            (family, tree),
            dict(temperature=temperature, top_p=top_p),
            list(range(seed0, seed0 + N)),
        )
    )
    s = goodness_of_fit(samples, exact)
    print(
        f"\n[{family} {tree} T={temperature} top_p={top_p}] {_fmt(s)} "
        f"mean_accepted={mean_accepted:.3f}"
    )
    # The acceptance path must actually run (else this only re-tests the target sampler).
    assert mean_accepted > 0.1, (
        f"drafts almost never accepted ({mean_accepted:.3f}): test has no bite"
    )
    assert s["off_support"] == 0, f"samples outside the target's support: {_fmt(s)}"
    assert s["p_value"] > ALPHA, f"chi-square rejects the target distribution: {_fmt(s)}"
    assert s["tv"] <= s["tv_bound"], f"total variation above its {DELTA} bound: {_fmt(s)}"


@pytest.mark.slow
def test_grafted_lookup_drafts_keep_the_target_distribution(target, pool):
    """Prompt-lookup branches grafted onto a top-k tree (copies at the root, and lookups
    carrying on the drafter's likeliest path) are further point-mass siblings; the output
    stays exact. (1-gram lookups in this 8-token vocabulary add new nodes on ~12% of
    rounds; the rest match nothing or only repeat the tree's own tokens.)"""
    exact = exact_distribution(target, PROMPT, 1.0, 1.0)
    lookups = tuple(dict(tokens=3, min_match=1, max_match=2, extend=2).items())
    draws = draw_both(
        pool,
        ("parallel", "small-6", lookups),
        dict(temperature=1.0),
        list(range(700_000, 700_000 + N)),
    )
    samples, _ = speculative_samples(draws)
    rounds, grafted_rounds = sum(d.rounds for d in draws), sum(d.grafted for d in draws)
    s = goodness_of_fit(samples, exact)
    print(f"\n[grafted lookups small-6] {_fmt(s)} grafted rounds {grafted_rounds}/{rounds}")
    assert grafted_rounds > rounds / 10, (
        "lookups must graft nodes on many rounds, or this tests nothing new"
    )
    assert passes(s), f"grafted drafts changed the output distribution: {_fmt(s)}"


# -- power: the same statistic rejects wrong samplers ------------------------------------


@torch.inference_mode()
def accept_all_drafts_distribution(target, drafter, temperature, top_p) -> torch.Tensor:
    """(512,) P of (t1, t2, t3) if a chain engine accepted every sampled draft: t1 ~ p (prefill),
    t2 ~ q_1, t3 ~ q_2 from the parallel drafter's first round (its rows ignore the drafts)."""
    dev = target.device
    ids = torch.tensor(PROMPT, device=dev)
    cache = target.new_cache()
    _, hidden = target.forward(ids, torch.arange(len(PROMPT), device=dev), cache)
    p1 = exact_distribution(target, PROMPT, temperature, top_p).reshape(V, V * V).sum(1)  # (V,)
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for t1 in range(V):
        state = drafter.new_state()
        toks = torch.tensor(PROMPT[1:] + [t1], device=dev)
        _, dlogits = drafter.propose(state, toks, hidden, 2, lambda j, lg: int(lg.argmax()))
        q = process_logits(dlogits, temperature, top_p).double()  # (2, V)
        q = q / q.sum(-1, keepdim=True)
        joint[t1] = p1[t1] * q[0][:, None] * q[1][None, :]
    return joint.reshape(-1)


def test_statistic_accepts_exact_samples_and_rejects_wrong_distributions(target):
    exact = exact_distribution(target, PROMPT, 1.0, 1.0)
    # Control: N i.i.d. samples of the exact distribution pass.
    ok = goodness_of_fit(_multinomial_samples(exact, N, seed=1), exact)
    print(f"\n[exact multinomial] {_fmt(ok)}")
    assert passes(ok), _fmt(ok)

    drafter = init_drafter("parallel", target, k=4, depth=1, seed=0)
    wrong = {
        "target at T=0.7": exact_distribution(target, PROMPT, 0.7, 1.0),
        "target at T=1.3": exact_distribution(target, PROMPT, 1.3, 1.0),
        "target with top_p=0.9": exact_distribution(target, PROMPT, 1.0, 0.9),
        "accept every sampled draft": accept_all_drafts_distribution(target, drafter, 1.0, 1.0),
    }
    for seed, (name, probs) in enumerate(wrong.items(), start=2):
        s = goodness_of_fit(_multinomial_samples(probs, N, seed=seed), exact)
        true_tv = 0.5 * float((probs - exact).abs().sum())
        print(f"[{name}] true TV={true_tv:.3f} {_fmt(s)}")
        assert s["p_value"] < ALPHA, f"chi-square fails to reject {name}: {_fmt(s)}"
        if true_tv > 2 * s["tv_bound"]:  # TV alone is a coarse test: only demand it when far
            assert s["tv"] > s["tv_bound"], f"TV check fails to reject {name}: {_fmt(s)}"


def _buggy_sampled_walk(tree, nodes, target_probs, draft_probs, gen):
    """A classic bug: on rejection, resample from p itself instead of the residual
    norm(max(p - q, 0)). It over-weights tokens the drafter already proposed."""
    accepted, node = [], 0
    while True:
        p = target_probs[node]
        nxt = None
        for child in tree.children[node]:
            x = nodes[child]
            u = float(torch.rand((), generator=gen))
            q = draft_probs[int(tree.depths[child]) - 1]
            if float(q[x]) > 0 and u < min(1.0, float(p[x] / q[x])):
                nxt = child
                break
        if nxt is None:
            return accepted, acceptance.sample(p, gen)
        accepted.append(nxt)
        node = nxt


@pytest.mark.slow
def test_statistic_rejects_a_broken_acceptance_rule(target, monkeypatch):
    """End to end through the engine: the residual bug above must be caught at this N."""
    monkeypatch.setattr(
        engine, "sampled_walk", _buggy_sampled_walk
    )  # in this process: all N drawn here
    exact = exact_distribution(target, PROMPT, 1.0, 1.0)
    samples, _ = speculative_samples(
        draw(
            ("parallel", "chain-3"),
            dict(temperature=1.0, top_p=1.0),
            list(range(900_000, 900_000 + N)),
        )
    )
    s = goodness_of_fit(samples, exact)
    print(f"\n[broken residual] {_fmt(s)}")
    assert not passes(s), f"a broken acceptance rule passed the lossless test: {_fmt(s)}"
