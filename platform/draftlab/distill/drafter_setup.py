"""The drafter a training run starts from (unless it resumes from a checkpoint): new, with
VocabTrim's token set counted from the training data, or loaded from `drafter.init_from`;
the samples it trains on (`train.max_samples`) and the cached features it can train on.
"""

from __future__ import annotations

import datasets
import torch

from draftlab.config import ConfigError, DistillConfig
from draftlab.models.drafters.build import init_drafter, load_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.drafters.p_eagle import resolve_aux_layers
from draftlab.models.target import Target


def frequent_tokens(
    train: datasets.Dataset, n: int, vocab: int, always: frozenset[int]
) -> torch.Tensor:
    """VocabTrim: the n most frequent response tokens (plus EOS), sorted by id.

    Slots left once every response token is in (small data sets use a few thousand distinct
    tokens) go to the most frequent prompt tokens, then to the lowest ids (BPE ids roughly
    follow merge order, i.e. corpus frequency), instead of arbitrary never-seen tokens."""
    resp = torch.zeros(vocab, dtype=torch.long)
    prompt = torch.zeros(vocab, dtype=torch.long)
    for row in train.select_columns(["input_ids", "prompt_len"]):
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        resp += torch.bincount(ids[row["prompt_len"] :], minlength=vocab)[:vocab]
        prompt += torch.bincount(ids[: row["prompt_len"]], minlength=vocab)[:vocab]
    # One sortable score: response count, then prompt count, then lower id first.
    rank = torch.arange(vocab, 0, -1, dtype=torch.float64) / (vocab + 1)  # (V,) in (0, 1)
    score = resp.double() * (prompt.max().double() + 1) + prompt.double() + rank
    score[list(always)] = float("inf")
    return score.topk(n).indices.sort().values  # (n,)


def training_samples(train: datasets.Dataset, max_samples: int | None) -> datasets.Dataset:
    """The first `max_samples` rows of the training split (`train.max_samples`; None = all)."""
    if max_samples is None:
        return train
    if max_samples > len(train):
        raise ConfigError(
            f"train.max_samples = {max_samples}, but the training split has {len(train)} "
            "samples: lower it, or generate more (data.source.num_prompts)"
        )
    return train.select(range(max_samples))


def build_drafter(cfg: DistillConfig, target: Target, train: datasets.Dataset) -> DrafterNet:
    spec = cfg.drafter
    if spec.init_from:
        drafter = load_drafter(spec.init_from, target)
    else:
        drafter = init_drafter(
            spec.family,
            target,
            k=spec.k,
            depth=spec.depth,
            seed=cfg.train.seed,
            vocab_size=spec.vocab_size,
            aux_layers=spec.aux_layers,
        )
        if spec.vocab_size:
            drafter.set_vocab(
                frequent_tokens(train, spec.vocab_size, target.vocab_size, target.eos_token_ids)
            )
    return drafter.float().train()  # float32 master weights (autocast does the bf16 math)


def usable_features(
    data: datasets.Dataset, cfg: DistillConfig, target: Target, drafter: DrafterNet
) -> datasets.Dataset:
    """`data` without its cached features when they are not the ones `drafter` fuses (another
    `aux_layers`): training then runs the target for them. A last-state family reads the
    last columns of any cache."""
    want = drafter.cfg.aux_layers or []
    cached = resolve_aux_layers(cfg.data.aux_layers, target.num_layers)
    if "hidden" in data.column_names and want and want != cached:
        return data.remove_columns("hidden")
    return data
