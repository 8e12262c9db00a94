"""Self-distillation data: the frozen target answers the training prompts, and (optionally)
its states are cached so drafter training needs no target forward: the residual states
after `data.aux_layers` (for `p-eagle`) then the last hidden state, (T, (n_aux + 1) * H).

Generation is scaled out with Ray Data: prompts are cut into shards of `shard_size`; a pool
of `num_actors` actors, each holding one copy of the target, generates a shard and saves it
itself, so a killed job keeps every finished shard and a rerun only does the rest. The
driver then concatenates the shards in order, splits train/eval and saves the result.

The cache (keys, layout, growth from a smaller data set) is `draftlab.data.cache`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm import tqdm
from transformers import LogitsProcessorList

from draftlab.config import ConfigError, DataConfig, TargetSpec
from draftlab.data.cache import (
    cache_path,
    dataset_key,
    key_inputs,
    reuse_donor_shards,
    save_atomic,
    save_prompts,
    shard_dir,
    stored_prompts,
    write_json_atomic,
    writers,
)
from draftlab.data.sampling import TopKTopPSampler
from draftlab.models.drafters.p_eagle import resolve_aux_layers

logger = logging.getLogger(__name__)

_FP16_MAX = 65504.0  # float16's largest finite value; bf16/fp32 features are clamped to it


# --- generation: pure functions of a loaded target (they run inside the actors) ----------


def sample_features(feature_size: int, store_features: bool) -> datasets.Features:
    cols = {
        "input_ids": datasets.List(datasets.Value("int32")),
        "prompt_len": datasets.Value("int32"),
        "prompt": datasets.Value("string"),
    }
    if store_features:
        cols["hidden"] = datasets.Array2D(shape=(None, feature_size), dtype="float16")
    return datasets.Features(cols)


def token_counts(ds: datasets.Dataset) -> tuple[int, int]:
    """(prompt tokens, response tokens) of a dataset without an indices mapping."""
    import pyarrow.compute as pc

    total = pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0
    prompt = pc.sum(ds.data.column("prompt_len")).as_py() or 0
    return prompt, total - prompt


def _cut_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Keep tokens up to and including the first EOS (what follows is HF's padding)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def open_writer(data: DataConfig, target, generator: str) -> contextlib.AbstractContextManager:
    """The vLLM engine on `target`'s weights when `generator` (`data.generator` for the
    responses, `data.prompt_generator` for magpie prompts) is `vllm`; None for `hf` (the
    target's own `generate` writes them)."""
    if generator == "hf":
        return contextlib.nullcontext(None)
    from draftlab.export import vllm_target_dir
    from draftlab.vllm_offline import VllmEngine

    # Room for the longest chat-formatted prompt plus its response: prompts are cut to
    # max_prompt_tokens of text, the chat template adds its header and system turn.
    length = data.source.max_prompt_tokens + data.max_new_tokens + 256
    return VllmEngine(vllm_target_dir(target), dtype=target.dtype, max_model_len=length,
                      memory_fraction=data.vllm_memory_fraction, max_num_seqs=data.batch_size, reserved_cpus=0,
                      memory_setting="data.vllm_memory_fraction")


@torch.inference_mode()
def generate_responses(
    target, prompt_ids: list[list[int]], data: DataConfig, seed: int = 0, writer=None
) -> list[list[int]]:
    """The target's response to each prompt; greedy when `data.temperature == 0`. Written by
    `writer` (a `VllmEngine` from `open_writer`: prompt i samples with seed `seed + i`) or
    by batched, left-padded HF `generate`, `data.batch_size` prompts per call."""
    eos = sorted(target.eos_token_ids)
    if writer is not None:
        seeds = [seed + i for i in range(len(prompt_ids))] if data.temperature > 0 else None
        rows = writer.generate_many(prompt_ids, data.max_new_tokens, temperature=data.temperature, top_p=data.top_p,
                                    seeds=seeds, stop_token_ids=eos)
    else:
        rows = _hf_responses(target, prompt_ids, data, seed, eos)
    stop = set(eos)
    return [_cut_after_eos(r, stop) for r in rows]


def _hf_responses(target, prompt_ids: list[list[int]], data: DataConfig, seed: int, eos: list[int]) -> list[list[int]]:
    """HF `generate`'s new ids per prompt (padding after EOS included), left-padded batches."""
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    mode = {}
    if data.temperature > 0:  # our sampler in the greedy loop: fast on CPU
        mode = dict(logits_processor=LogitsProcessorList([TopKTopPSampler(data.temperature, data.top_p)]))
    devices = [target.device.index or 0] if target.device.type == "cuda" else []
    rows: list[list[int]] = []
    for start in range(0, len(prompt_ids), data.batch_size):
        chunk = prompt_ids[start : start + data.batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # (B, W), left-padded
        mask = torch.zeros_like(ids)  # (B, W), 1 = real token
        for row, p in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.random.fork_rng(devices=devices):  # seeded, global RNG untouched
            torch.manual_seed(seed + start)
            out = target.model.generate(
                ids.to(target.device),
                attention_mask=mask.to(target.device),
                max_new_tokens=data.max_new_tokens,
                eos_token_id=eos or None,
                pad_token_id=pad,
                do_sample=False,
                **mode,
            )  # (B, W + new)
        rows += out[:, width:].tolist()
    return rows


@torch.inference_mode()
def target_features(target, sequences: list[list[int]], batch_size: int, aux_layers: list[int]) -> list[np.ndarray]:
    """The target's features (`Target.features`: the states after `aux_layers`, then the
    last hidden state, as `Target.forward` returns them) for every position of each
    sequence, as float16 arrays of shape (T, (len(aux_layers) + 1) * H).

    Sequences are right-padded and run without an attention mask: attention is causal, so
    no real position ever sees the padding after it. Batches are cut from the sequences
    sorted by length, so little of each forward is padding.
    """
    pad = target.tokenizer.pad_token_id or 0
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[np.ndarray | None] = [None] * len(sequences)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids = torch.full((len(chunk), max(len(sequences[i]) for i in chunk)), pad, dtype=torch.long)  # (B, W)
        for row, i in enumerate(chunk):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
        hidden = target.run_decoder(tuple(aux_layers), input_ids=ids.to(target.device), use_cache=False)  # (B, W, F)
        hidden = hidden.float().clamp(-_FP16_MAX, _FP16_MAX).half().cpu()
        for row, i in enumerate(chunk):
            out[i] = hidden[row, : len(sequences[i])].numpy()  # (T, F)
    return out


def build_shard(target, prompts: list[str], data: DataConfig, seed: int, writer=None) -> datasets.Dataset:
    """Generate (`writer`: see `generate_responses`), cut and (optionally) featurise one
    shard; empty responses are dropped."""
    prompt_ids = [target.encode_prompt(p) for p in prompts]
    responses = generate_responses(target, prompt_ids, data, seed, writer)
    keep = [i for i, r in enumerate(responses) if r]
    seqs = [prompt_ids[i] + responses[i] for i in keep]
    cols = {
        "input_ids": seqs,
        "prompt_len": [len(prompt_ids[i]) for i in keep],
        "prompt": [prompts[i] for i in keep],
    }
    aux = resolve_aux_layers(data.aux_layers, target.num_layers)
    if data.store_features:
        cols["hidden"] = target_features(target, seqs, data.batch_size, aux)
    width = (len(aux) + 1) * target.hidden_size
    return datasets.Dataset.from_dict(cols, features=sample_features(width, data.store_features))


class ShardGenerator:
    """Ray Data actor: loads the target (and, for `generator: vllm`, starts its engine)
    once, then generates and saves one shard per row.

    Rows are `{"shard": int, "prompts": list[str]}`; each output row is a small summary
    (the samples themselves go to disk, so a killed job keeps the finished shards).
    """

    def __init__(self, target_spec: dict, data: dict, work_dir: str):
        from draftlab.models.target import load_target

        datasets.disable_progress_bars()  # per-shard "Saving the dataset" bars would flood the driver
        self.data = DataConfig.model_validate(data)
        self.work_dir = Path(work_dir)
        self.target = load_target(TargetSpec.model_validate(target_spec))
        self._stack = contextlib.ExitStack()
        self.writer = self._stack.enter_context(open_writer(self.data, self.target, self.data.generator))

    def __del__(self):
        stack = getattr(self, "_stack", None)
        if stack is not None:  # the vLLM engine's processes end with it
            stack.close()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        (index,) = batch["shard"].tolist()  # batch_size=1: one shard per call
        prompts = [str(p) for p in batch["prompts"][0]]
        dest = shard_dir(self.work_dir, index)
        t0 = time.perf_counter()
        if not dest.is_dir():  # a retried task may find its shard already saved
            ds = build_shard(self.target, prompts, self.data, seed=self.data.source.seed * 1_000_003 + index,
                             writer=self.writer)
            save_atomic(ds, dest)
        ds = datasets.load_from_disk(str(dest))
        return {
            "shard": [index],
            "prompts": [len(prompts)],
            "samples": [ds.num_rows],
            "response_tokens": [token_counts(ds)[1]],
            "seconds": [time.perf_counter() - t0],
            "device": [str(self.target.device)],
        }


# --- driver ------------------------------------------------------------------------------


def generation_spec(target_spec: TargetSpec, use_gpu: bool) -> TargetSpec:
    """The spec the generation actors load: no "auto" left in device or dtype.

    The device follows `use_gpu`, not CUDA availability: Ray 2.60 leaves
    CUDA_VISIBLE_DEVICES alone for actors that reserved no GPU, so "auto" would grab an
    unreserved GPU on a GPU node.
    """
    from draftlab.models.target import placed_spec

    return placed_spec(target_spec, use_gpu, "data.use_gpu", "generation actors")


def _prompts_and_plan(work: Path, data: DataConfig, target, spec: TargetSpec, progress: bool) -> tuple[list[str], int]:
    """Prompts and shard size: read back from `work/prompts.json`, or made and recorded.

    A resumed run keeps the recorded shard size even if `data.shard_size` changed, so the
    finished shards still line up with the prompts.
    """
    plan = work / "prompts.json"
    if plan.is_file():
        saved = json.loads(plan.read_text())
        if saved["shard_size"] != data.shard_size:
            logger.info(
                "resuming with the recorded shard_size=%d (config says %d)", saved["shard_size"], data.shard_size
            )
        return saved["prompts"], saved["shard_size"]
    prompts = _cached_prompts(data, target, spec, progress)
    write_json_atomic(plan, {"shard_size": data.shard_size, "prompts": prompts})
    return prompts, data.shard_size


def _cached_prompts(data: DataConfig, target, spec: TargetSpec, progress: bool) -> list[str]:
    """The source's first `num_prompts` prompts: cut from the cached list, or collected (a
    shorter cached list is extended where its stream stopped) and cached. `target` (a
    `TargetInfo`) measures them; magpie prompts load the target from `spec` to write them,
    on the CPU of a CPU-only head node."""
    from draftlab.data.sources import collect_prompts
    from draftlab.models.target import load_target

    cached = stored_prompts(data, target.fingerprint)
    if cached is not None and len(cached.prompts) >= data.source.num_prompts:
        logger.info("prompts: reusing the cached list of %d", len(cached.prompts))
        return cached.prompts[: data.source.num_prompts]
    start = cached if cached is not None and cached.consumed is not None else None
    writes = data.source.kind == "magpie"  # the target writes magpie prompts
    if writes:
        target = load_target(spec if spec.device == "cpu" or torch.cuda.is_available() else spec.model_copy(update={"device": "cpu"}))
    with open_writer(data, target, data.prompt_generator) if writes else contextlib.nullcontext(None) as writer:
        got = collect_prompts(data.source, target, progress=progress, magpie_batch_size=data.batch_size,
                              writer=writer, start=start)
    save_prompts(data, target.fingerprint, got)
    return got.prompts


def _run_shards(
    todo: list[int], prompts: list[str], shard_size: int, num_shards: int,
    data: DataConfig, target_spec: TargetSpec, work: Path, progress: bool,
) -> None:
    """Generate the shards in `todo` with a Ray Data actor pool on the current Ray instance."""
    import ray

    if not ray.is_initialized():
        ray.init()
    rows = [{"shard": i, "prompts": prompts[i * shard_size : (i + 1) * shard_size]} for i in todo]
    ctx = ray.data.DataContext.get_current()
    ray_bars, ctx.enable_progress_bars = ctx.enable_progress_bars, not progress  # ours replaces Ray's
    try:
        mapped = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(  # one block per shard
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
        bar = tqdm(total=num_shards, initial=num_shards - len(todo), desc="self-distill shards", unit="shard",
                   disable=not progress)
        with bar:
            for r in mapped.iter_rows():  # one summary row per shard, as each finishes
                bar.update(1)
                logger.info(
                    "shard %d/%d done on %s: %d/%d samples, %d response tokens, %.1f s", r["shard"] + 1,
                    num_shards, r["device"], r["samples"], r["prompts"], r["response_tokens"], r["seconds"],
                )
    finally:
        ctx.enable_progress_bars = ray_bars


def _split(ds: datasets.Dataset, eval_fraction: float, seed: int) -> datasets.DatasetDict:
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


def _concat_shards(work: Path, num_shards: int) -> datasets.Dataset:
    shards = [datasets.load_from_disk(str(shard_dir(work, i))) for i in range(num_shards)]
    ds = datasets.concatenate_datasets(shards)  # memory-mapped, in prompt order
    if ds.num_rows == 0:
        raise ValueError(f"self-distillation produced no samples (every response was empty); see {work}")
    return ds


def _meta(
    ds: datasets.Dataset, dsd: datasets.DatasetDict, data: DataConfig, target_spec: TargetSpec,
    fingerprint: str, num_prompts: int, shard_size: int, reused: dict | None,
) -> dict:
    prompt_tokens, response_tokens = token_counts(ds)
    return {
        "key": dataset_key(data, fingerprint),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "inputs": key_inputs(data, fingerprint),
        "target": target_spec.model_dump(mode="json"),
        "num_prompts": num_prompts,
        "shard_size": shard_size,
        "reused_from": reused,  # {"key", "shards"}: shards copied from a cached data set of the same stream
        "num_samples": ds.num_rows,
        "num_dropped_empty": num_prompts - ds.num_rows,
        "num_train": dsd["train"].num_rows,
        "num_eval": dsd["eval"].num_rows,
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
    }


@contextlib.contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """One driver per key at a time; a second one waits, then finds the finished dataset."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(root) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another job generating the same data at %s", root)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _generate(root: Path, prompts: list[str], shard_size: int, data: DataConfig, target_spec: TargetSpec,
              fingerprint: str, progress: bool) -> None:
    """Generate the missing shards, then save the final DatasetDict + meta.json atomically."""
    work = root / "work"
    num_shards = -(-len(prompts) // shard_size)  # ceil
    (work / "shards").mkdir(parents=True, exist_ok=True)
    for stale in (work / "shards").glob(".*.tmp-*"):  # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    todo = [i for i in range(num_shards) if not shard_dir(work, i).is_dir()]
    logger.info(
        "self-distillation data at %s: %d prompts in %d shards, %d to generate",
        root, len(prompts), num_shards, len(todo),
    )
    todo, reused = reuse_donor_shards(root, todo, prompts, shard_size, data, fingerprint, progress)
    if todo:
        _run_shards(todo, prompts, shard_size, num_shards, data, target_spec, work, progress)
    ds = _concat_shards(work, num_shards)
    dsd = _split(ds, data.eval_fraction, data.source.seed)
    meta = _meta(ds, dsd, data, target_spec, fingerprint, len(prompts), shard_size, reused)
    save_atomic(dsd, root / "dataset", extra={"meta.json": meta})
    logger.info(
        "saved self-distillation data at %s (%d train, %d eval)", root / "dataset", meta["num_train"], meta["num_eval"]
    )


def training_view(ds: datasets.Dataset | datasets.DatasetDict):
    """Rows as training reads them: cached features as numpy arrays, the rest as Python
    values. Python lists of a (T, 4H) feature array cost more than the training step itself
    (measured for SmolLM2 + p-eagle, batch 8: fetch + collate 0.36 s -> 0.017 s a step)."""
    names = ds.column_names if isinstance(ds, datasets.Dataset) else next(iter(ds.values())).column_names
    if "hidden" not in names:
        return ds.with_format(None)
    return ds.with_format("numpy", columns=["hidden"], output_all_columns=True)


def _check_generator(data: DataConfig) -> None:
    """Fail before any work (and not inside an actor) when the chosen writer is missing."""
    if "vllm" in writers(data):
        from draftlab.vllm_offline import require_vllm

        field = "generator" if data.generator == "vllm" else "prompt_generator"
        try:
            require_vllm()
        except ImportError as e:
            raise ConfigError(f"data.{field}=vllm: {e}; or set data.{field}=hf") from None


def load_or_generate(
    data: DataConfig, target_spec: TargetSpec, progress: bool = True, *, keep_shards: bool = False
) -> datasets.DatasetDict:
    """The self-distillation DatasetDict ("train", "eval") for `data` and `target_spec`:
    loaded from the cache, or generated with Ray Data (resuming finished shards) and cached.

    Columns: `input_ids` (prompt ids from `Target.encode_prompt`, then the response, EOS
    kept), `prompt_len`, `prompt`, and with `data.store_features` also `hidden` (T, F)
    float16 (`target_features`). `keep_shards=False` deletes the work dir once the dataset is saved (the shards
    duplicate it on disk).
    """
    from draftlab.models.target import describe_target

    spec = generation_spec(target_spec, data.use_gpu)
    # The driver needs the fingerprint (cache key) and the tokenizer (prompt filters): both
    # come without the weights, read from the weight files' metadata. Only magpie prompts,
    # which the target writes itself, load it (`_cached_prompts`).
    target = describe_target(spec)
    fingerprint = target.fingerprint
    root = cache_path(data, fingerprint)
    final = root / "dataset"
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root):
        if (final / "dataset_dict.json").is_file():
            logger.info("reusing cached self-distillation data at %s", final)
        else:
            _check_generator(data)
            prompts, shard_size = _prompts_and_plan(root / "work", data, target, spec, progress)
            if torch.cuda.is_available():  # the actors load their own copies
                torch.cuda.empty_cache()
            _generate(root, prompts, shard_size, data, spec, fingerprint, progress)
            if not keep_shards:
                shutil.rmtree(root / "work", ignore_errors=True)
    return datasets.load_from_disk(str(final))
