"""The finished self-distillation data set: the generated shards concatenated in prompt
order, split train/eval, and described by `meta.json` (`draftlab.data.cache` holds the
layout; `draftlab.data.selfdistill` saves the result).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from draftlab.config import DataConfig, TargetSpec
from draftlab.data.cache import dataset_key, key_inputs, shard_dir


def token_counts(ds: datasets.Dataset) -> tuple[int, int]:
    """(prompt tokens, response tokens) of a dataset without an indices mapping."""
    total = pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0
    prompt = pc.sum(ds.data.column("prompt_len")).as_py() or 0
    return prompt, total - prompt


def train_eval_split(ds: datasets.Dataset, eval_fraction: float, seed: int) -> datasets.DatasetDict:
    """Deterministic train/eval split; eval gets >= 1 sample when eval_fraction > 0 and
    there are >= 2 samples, and train always keeps >= 1."""
    n = ds.num_rows
    n_eval = min(round(n * eval_fraction), n - 1)
    if eval_fraction > 0 and n >= 2:
        n_eval = max(n_eval, 1)
    if n_eval <= 0:
        return datasets.DatasetDict(train=ds, eval=ds.select([]))
    # Not `train_test_split`: it caches the indices inside the first shard's directory, and
    # datasets 5.2 rejects its keep_in_memory=True for file-backed data. Same algorithm.
    order = np.random.default_rng(seed).permutation(n)  # (n,)
    return datasets.DatasetDict(
        train=ds.select(order[n_eval:], keep_in_memory=True),
        eval=ds.select(order[:n_eval], keep_in_memory=True),
    )


def concat_shards(work: Path, num_shards: int) -> datasets.Dataset:
    """The shards of `work`, in prompt order; raises when none holds a sample."""
    shards = [datasets.load_from_disk(str(shard_dir(work, i))) for i in range(num_shards)]
    ds = datasets.concatenate_datasets(shards)  # memory-mapped, in prompt order
    if ds.num_rows == 0:
        raise ValueError(
            f"self-distillation produced no samples (every response was empty); see {work}"
        )
    return ds


def dataset_meta(
    ds: datasets.Dataset,
    dsd: datasets.DatasetDict,
    data: DataConfig,
    target_spec: TargetSpec,
    fingerprint: str,
    num_prompts: int,
    shard_size: int,
    reused: dict | None,
) -> dict:
    """`meta.json`: the key and its inputs, the target, the shard plan, and the counts."""
    prompt_tokens, response_tokens = token_counts(ds)
    return {
        "key": dataset_key(data, fingerprint),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "inputs": key_inputs(data, fingerprint),
        "target": target_spec.model_dump(mode="json"),
        "num_prompts": num_prompts,
        "shard_size": shard_size,
        # {"key", "shards"}: shards copied from a cached data set of the same stream
        "reused_from": reused,
        "num_samples": ds.num_rows,
        "num_dropped_empty": num_prompts - ds.num_rows,
        "num_train": dsd["train"].num_rows,
        "num_eval": dsd["eval"].num_rows,
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
    }
