"""Self-distillation data: the frozen target answers the training prompts, and (optionally)
its states are cached so drafter training needs no target forward: the residual states
after `data.aux_layers` (for `p-eagle`) then the last hidden state, (T, (n_aux + 1) * H).

Generation is scaled out with Ray Data: prompts are cut into shards of `shard_size`; a pool
of `num_actors` actors, each holding one copy of the target, generates a shard and saves it
itself, so a killed job keeps every finished shard and a rerun only does the rest. The
driver then concatenates the shards in order, splits train/eval and saves the result.

This module is that driver (`load_or_generate`) and the view training reads the result
through (`training_view`). The actors and what they run are `draftlab.data.generation`; the
finished data set's assembly (concatenation, split, meta.json) is `draftlab.data.dataset`;
the cache (keys, layout, its lock, growth from a smaller data set) is `draftlab.data.cache`.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import datasets
import ray
import torch
from tqdm import tqdm

from draftlab import vllm_offline
from draftlab.config import ConfigError, DataConfig, TargetSpec
from draftlab.data import sources
from draftlab.data.cache import (
    cache_path,
    exclusive,
    reuse_donor_shards,
    save_atomic,
    save_prompts,
    shard_dir,
    stored_prompts,
    write_json_atomic,
    writers,
)
from draftlab.data.dataset import concat_shards, dataset_meta, train_eval_split
from draftlab.data.generation import ShardGenerator, generation_spec, open_writer
from draftlab.models.target import describe_target, load_target

logger = logging.getLogger(__name__)


def _prompts_and_plan(
    work: Path, data: DataConfig, target, spec: TargetSpec, progress: bool
) -> tuple[list[sources.Prompt], list[int] | None, int]:
    """Prompts, their answer lengths (None: all `data.max_new_tokens`) and shard size: read
    back from `work/prompts.json`, or made and recorded.

    A resumed run keeps the recorded shard size even if `data.shard_size` changed, so the
    finished shards still line up with the prompts.
    """
    plan = work / "prompts.json"
    if plan.is_file():
        saved = json.loads(plan.read_text())
        if saved["shard_size"] != data.shard_size:
            logger.info(
                "resuming with the recorded shard_size=%d (config says %d)",
                saved["shard_size"],
                data.shard_size,
            )
        return saved["prompts"], saved.get("lengths"), saved["shard_size"]
    prompts, lengths = _cached_prompts(data, target, spec, progress)
    write_json_atomic(plan, {"shard_size": data.shard_size, "prompts": prompts, "lengths": lengths})
    return prompts, lengths, data.shard_size


def _cached_prompts(
    data: DataConfig, target, spec: TargetSpec, progress: bool
) -> tuple[list[sources.Prompt], list[int] | None]:
    """Each source's first `num_prompts` prompts (a mix's share): cut from its cached list,
    or collected (a shorter cached list is extended where its stream stopped) and cached;
    a mix's lists then interleaved (`interleave`). With them, each prompt's answer length,
    its source's (None when every source answers to `data.max_new_tokens`). `target` (a
    `TargetInfo`) measures them; magpie prompts load the target from `spec` to write them,
    on the CPU of a CPU-only head node, once for all sources."""
    lists: list[list[str] | None] = []
    todo = []
    for source in data.sources:
        cached = stored_prompts(data, target.fingerprint, source)
        if cached is not None and len(cached.prompts) >= source.num_prompts:
            logger.info("prompts: reusing the cached list of %d", len(cached.prompts))
            lists.append(cached.prompts[: source.num_prompts])
            continue
        lists.append(None)
        todo.append((len(lists) - 1, source, cached))
    written = [source for _, source, _ in todo if data.prompt_writer(source)]  # by the target
    if written:
        target = load_target(
            spec
            if spec.device == "cpu" or torch.cuda.is_available()
            else spec.model_copy(update={"device": "cpu"})
        )
    by_vllm = [source for source in written if data.prompt_writer(source) == "vllm"]
    with open_writer(data, target, "vllm" if by_vllm else "hf") as writer:
        for i, source, cached in todo:
            got = sources.collect_prompts(
                source,
                target,
                progress=progress,
                magpie_batch_size=data.batch_size,
                writer=writer if source in by_vllm else None,
                start=cached if cached is not None and cached.consumed is not None else None,
                save=functools.partial(save_prompts, data, target.fingerprint, source=source),
            )
            save_prompts(data, target.fingerprint, got, source)
            lists[i] = got.prompts
    placed = interleave(lists)
    lengths = data.response_lengths
    return (
        [lists[k][j] for k, j in placed],
        [lengths[k] for k, _ in placed] if len(set(lengths)) > 1 else None,
    )


def interleave(lists: list[list[sources.Prompt]]) -> list[tuple[int, int]]:
    """The (list, item) places of the lists merged so each keeps its order and its share of
    every stretch: item j of a list of n sits at (j + 0.5) / n of the way (ties: the earlier
    list first). A prompt in two lists is kept once, where it comes first."""
    placed = sorted(
        ((j + 0.5) / len(items), k, j) for k, items in enumerate(lists) for j in range(len(items))
    )
    unique = {}
    for _, k, j in placed:
        unique.setdefault(sources.prompt_key(lists[k][j]), (k, j))
    return list(unique.values())


def _run_shards(
    todo: list[int],
    prompts: list[sources.Prompt],
    lengths: list[int] | None,
    shard_size: int,
    num_shards: int,
    data: DataConfig,
    target_spec: TargetSpec,
    work: Path,
    progress: bool,
) -> None:
    """Generate the shards in `todo` with a Ray Data actor pool on the current Ray instance."""
    if not ray.is_initialized():
        ray.init()
    rows = [
        {
            "shard": i,
            "prompts": json.dumps(prompts[i * shard_size : (i + 1) * shard_size]),
            "lengths": json.dumps(lengths and lengths[i * shard_size : (i + 1) * shard_size]),
        }
        for i in todo
    ]  # JSON: chat prompts are lists (`ShardGenerator`)
    ctx = ray.data.DataContext.get_current()
    ray_bars, ctx.enable_progress_bars = (
        ctx.enable_progress_bars,
        not progress,
    )  # ours replaces Ray's
    try:
        mapped = ray.data.from_items(
            rows, override_num_blocks=len(rows)
        ).map_batches(  # one block per shard
            ShardGenerator,
            batch_size=1,
            # One shard in flight per actor: a free actor takes the next shard (no queueing
            # behind a busy one), which keeps the tail of the job short.
            compute=ray.data.ActorPoolStrategy(
                size=min(data.num_actors, len(rows)), max_tasks_in_flight_per_actor=1
            ),
            num_gpus=1 if data.use_gpu else 0,
            num_cpus=data.cpus_per_actor,
            fn_constructor_kwargs={
                "target_spec": target_spec.model_dump(),
                "data": data.model_dump(),
                "work_dir": str(work),
            },
        )
        bar = tqdm(
            total=num_shards,
            initial=num_shards - len(todo),
            desc="self-distill shards",
            unit="shard",
            disable=not progress,
        )
        with bar:
            for r in mapped.iter_rows():  # one summary row per shard, as each finishes
                bar.update(1)
                logger.info(
                    "shard %d/%d done on %s: %d/%d samples, %d response tokens, %.1f s",
                    r["shard"] + 1,
                    num_shards,
                    r["device"],
                    r["samples"],
                    r["prompts"],
                    r["response_tokens"],
                    r["seconds"],
                )
    finally:
        ctx.enable_progress_bars = ray_bars


def _generate(
    root: Path,
    prompts: list[sources.Prompt],
    lengths: list[int] | None,
    shard_size: int,
    data: DataConfig,
    target_spec: TargetSpec,
    fingerprint: str,
    progress: bool,
) -> None:
    """Generate the missing shards, then save the final DatasetDict + meta.json atomically."""
    work = root / "work"
    num_shards = -(-len(prompts) // shard_size)  # ceil
    (work / "shards").mkdir(parents=True, exist_ok=True)
    for stale in (work / "shards").glob(".*.tmp-*"):  # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    todo = [i for i in range(num_shards) if not shard_dir(work, i).is_dir()]
    logger.info(
        "self-distillation data at %s: %d prompts in %d shards, %d to generate",
        root,
        len(prompts),
        num_shards,
        len(todo),
    )
    todo, reused = reuse_donor_shards(root, todo, prompts, shard_size, data, fingerprint, progress)
    if todo:
        _run_shards(
            todo, prompts, lengths, shard_size, num_shards, data, target_spec, work, progress
        )
    ds = concat_shards(work, num_shards)
    dsd = train_eval_split(ds, data.eval_fraction, data.seed)
    meta = dataset_meta(ds, dsd, data, target_spec, fingerprint, len(prompts), shard_size, reused)
    save_atomic(dsd, root / "dataset", extra={"meta.json": meta})
    logger.info(
        "saved self-distillation data at %s (%d train, %d eval)",
        root / "dataset",
        meta["num_train"],
        meta["num_eval"],
    )


def training_view(ds: datasets.Dataset | datasets.DatasetDict):
    """Rows as training reads them: cached features as numpy arrays, the rest as Python
    values. Python lists of a (T, 4H) feature array cost more to fetch and collate than the
    training step itself; numpy arrays, a small fraction of it."""
    names = (
        ds.column_names
        if isinstance(ds, datasets.Dataset)
        else next(iter(ds.values())).column_names
    )
    if "hidden" not in names:
        return ds.with_format(None)
    return ds.with_format("numpy", columns=["hidden"], output_all_columns=True)


def _check_generator(data: DataConfig) -> None:
    """Fail before any work (and not inside an actor) when the chosen writer is missing."""
    if "vllm" in writers(data):
        field = "generator" if data.generator == "vllm" else "prompt_generator"
        try:
            vllm_offline.require_vllm()
        except ImportError as e:
            raise ConfigError(
                f"data.{field}={getattr(data, field)}: {e}; or set data.{field}=hf"
            ) from None


def load_or_generate(
    data: DataConfig, target_spec: TargetSpec, progress: bool = True, *, keep_shards: bool = False
) -> datasets.DatasetDict:
    """The self-distillation DatasetDict ("train", "eval") for `data` and `target_spec`:
    loaded from the cache, or generated with Ray Data (resuming finished shards) and cached.

    Columns: `input_ids` (prompt ids from `Target.encode_prompt`, then the response, EOS
    kept), `prompt_len`, `prompt`, and with `data.store_features` also `hidden` (T, F)
    float16 (`generation.target_features`). `keep_shards=False` deletes the work dir once the
    dataset is saved (the shards duplicate it on disk).
    """
    spec = generation_spec(target_spec, data.use_gpu)
    # The driver needs the fingerprint (cache key) and the tokenizer (prompt filters): both
    # come without the weights, read from the weight files' metadata. Only magpie prompts,
    # which the target writes itself, load it (`_cached_prompts`).
    target = describe_target(spec)
    fingerprint = target.fingerprint
    root = cache_path(data, fingerprint)
    final = root / "dataset"
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root):
        if (final / "dataset_dict.json").is_file():
            logger.info("reusing cached self-distillation data at %s", final)
        else:
            _check_generator(data)
            prompts, lengths, shard_size = _prompts_and_plan(
                root / "work", data, target, spec, progress
            )
            if torch.cuda.is_available():  # the actors load their own copies
                torch.cuda.empty_cache()
            _generate(root, prompts, lengths, shard_size, data, spec, fingerprint, progress)
            if not keep_shards:
                shutil.rmtree(root / "work", ignore_errors=True)
    return datasets.load_from_disk(str(final))
