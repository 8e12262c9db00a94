"""The self-distillation data cache: keys, layout, and reuse across data set sizes.

Layout (`root` = `data.cache_dir` or `$DRAFTLAB_CACHE/data`)::

    root/<key>.lock                 serialises drivers working on the same key (`exclusive`)
    root/<key>/dataset/             final DatasetDict ("train", "eval"), + meta.json
    root/<key>/work/prompts.json    the prompts and shard size (a resumed run reuses them)
    root/<key>/work/shards/shard-00003/   one generated shard (Dataset.save_to_disk)
    root/prompts/<digest>.json      a source's prompt list, and where its stream stopped

`<key>` hashes everything that changes the samples: the target's weights fingerprint, the
prompt source (and the size/mtime of local source files), max_new_tokens, temperature,
top_p, store_features, aux_layers, eval_fraction and the writers of prompts and responses
(`hf` or `vllm`). Batch size, actor count, shard size and device are left out on purpose:
they change speed, not results, except that batched left-padded
generation can flip a near-tied greedy argmax through padding numerics (and GPU/CPU kernels
differ slightly too). We accept that rather than invalidate caches on a resource change.

Growing a data set costs only the new part: prompt sources are deterministic streams
(`draftlab.data.sources`), so a larger `source.num_prompts` resumes the cached prompt list
where it stopped, and the shards its first prompts fall in are copied from the cached data
set of the smaller size (`reuse_donor_shards`) instead of being generated again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import datasets
from filelock import FileLock, Timeout
from tqdm import tqdm

from draftlab.config import DataConfig, PromptSourceConfig
from draftlab.data.sources import Prompt, PromptList, prompt_key
from draftlab.models.presets import cache_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when the stored columns or their meaning change: old caches are then ignored."""


def _path_stamp(path: str | None) -> list | None:
    """Sizes and mtimes of a local file/dir, so editing it invalidates the cache (None: a hub
    name, or no path)."""
    if not path:
        return None
    path = Path(path).expanduser()
    if path.is_file():
        return [[path.name, path.stat().st_size, path.stat().st_mtime_ns]]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return [[str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return None


def _source_stamp(source: PromptSourceConfig) -> list | None:
    """`_path_stamp` of a dataset source's file, or of a magpie source's document corpus
    (under a key of its own: older keys stay valid)."""
    if source.kind == "dataset":
        return _path_stamp(source.path)
    docs = _path_stamp(source.documents)
    return None if docs is None else [["documents", docs]]


def _source_inputs(data: DataConfig) -> dict:
    """The prompt sources' part of the key: one source as before, a mix as its entries and
    total."""
    if not isinstance(data.source, list):
        return {
            "source": data.source.model_dump(mode="json"),
            "source_files": _source_stamp(data.source),
        }
    return {
        "source": [e.model_dump(mode="json") for e in data.source],
        "source_files": [_source_stamp(e) for e in data.source],
        "num_prompts": data.num_prompts,
    }


def key_inputs(data: DataConfig, target_fingerprint: str) -> dict:
    """Everything that determines the generated samples (see the module docstring)."""
    return (
        {
            "format": FORMAT_VERSION,
            "target": target_fingerprint,
            **_source_inputs(data),
            "max_new_tokens": data.max_new_tokens,
            "temperature": data.temperature,
            "top_p": data.top_p,
            "store_features": data.store_features,
            "eval_fraction": data.eval_fraction,
        }
        | ({"aux_layers": data.aux_layers} if data.aux_layers is not None else {})
        | (  # older keys stay valid
            {"generator": data.generator, "prompt_generator": _prompt_writers_key(data)}
            if writers(data) != {"hf"}
            else {}
        )
        | ({"magpie_turns": MAGPIE_TURNS} if _magpie(data) else {})
    )


MAGPIE_TURNS = 2
"""The magpie stream's layout in keys: 2 = turn i opens with seed i (1, unstamped: every
turn of a sampling batch with the batch's seed, so a large batch used few seeds)."""


def _magpie(data: DataConfig) -> bool:
    return any(s.kind == "magpie" for s in data.sources)


def prompt_writers(data: DataConfig) -> set[str]:
    """Who writes `data`'s magpie prompts (`DataConfig.prompt_writer` of each magpie source)."""
    return {data.prompt_writer(s) for s in data.sources} - {None}


def writers(data: DataConfig) -> set[str]:
    """The generators `data` starts (magpie prompts, then responses)."""
    return {data.generator} | prompt_writers(data)


def _prompt_writers_key(data: DataConfig) -> str:
    """The prompt writers in the data key: "hf", "vllm" or "hf+vllm" (without magpie sources,
    the setting as it was keyed before `auto`: older keys stay valid)."""
    used = prompt_writers(data) or {
        "hf" if data.prompt_generator == "auto" else data.prompt_generator
    }
    return "+".join(sorted(used))


def _digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def dataset_key(data: DataConfig, target_fingerprint: str) -> str:
    """Stable hex digest of `key_inputs`: the cache directory's name."""
    return _digest(key_inputs(data, target_fingerprint))


def cache_root(data: DataConfig) -> Path:
    return Path(data.cache_dir).expanduser() if data.cache_dir else cache_dir() / "data"


def cache_path(data: DataConfig, target_fingerprint: str) -> Path:
    """The key directory for these inputs (it may not exist yet)."""
    return cache_root(data) / dataset_key(data, target_fingerprint)


def shard_dir(work_dir: Path, index: int) -> Path:
    return Path(work_dir) / "shards" / f"shard-{index:05d}"


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """One driver per key at a time; a second one waits, then finds the finished dataset."""
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


def save_atomic(
    ds: datasets.Dataset | datasets.DatasetDict, dest: Path, extra: dict | None = None
) -> None:
    """`save_to_disk` into a temp dir beside `dest`, add `extra` json files, then os.replace.

    A reader sees the whole directory or none. If `dest` appeared meanwhile (a retried or
    concurrent writer finished first) theirs is kept: both hold the same samples.
    """
    dest = Path(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    # an empty split (`eval_fraction: 0`) would be saved in 0 shards, which `load_from_disk`
    # cannot read back: it gets one
    shards = (
        {k: 1 if not len(v) else None for k, v in ds.items()}
        if isinstance(ds, datasets.DatasetDict)
        else None
    )
    ds.save_to_disk(str(tmp), num_shards=shards)
    for name, obj in (extra or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=2))
    try:
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():
            raise


def write_json_atomic(dest: Path, obj) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, ensure_ascii=False))
    os.replace(tmp, dest)


def prompts_cache_file(
    data: DataConfig, target_fingerprint: str, source: PromptSourceConfig | None = None
) -> Path:
    """Where the prompt stream of `source` (one of `data.sources`; None = the only one) is
    cached, apart from any generation setting and from `source.num_prompts`: changing
    `max_new_tokens` or `temperature` reuses the prompts (magpie ones are costly), a larger
    `num_prompts` extends them, and a mix shares each entry's list with that source alone."""
    inputs = _prompt_inputs(data, _one(data, source), target_fingerprint)
    inputs["source"] = _without_count(inputs["source"])
    return cache_root(data) / "prompts" / f"{_digest(inputs)}.json"


def _one(data: DataConfig, source: PromptSourceConfig | None) -> PromptSourceConfig:
    if source is not None:
        return source
    if isinstance(data.source, list):
        raise ValueError("a mix caches a prompt list per source: name the source")
    return data.source


def _prompt_inputs(data: DataConfig, source: PromptSourceConfig, target_fingerprint: str) -> dict:
    inputs = {
        "format": FORMAT_VERSION,
        "target": target_fingerprint,
        "source": source.model_dump(mode="json"),
        "source_files": _source_stamp(source),
    }
    magpie = source.kind == "magpie"
    inputs["magpie_batch_size"] = data.batch_size if magpie else None
    if data.prompt_writer(source) == "vllm":  # older keys stay valid
        inputs["generator"] = "vllm"
    if magpie:
        inputs["magpie_turns"] = MAGPIE_TURNS
    return inputs


def _without_count(source: dict | list) -> dict | list:
    """A source's key inputs less `num_prompts`; a mix's list as it is (never a prefix of
    another stream)."""
    if isinstance(source, list):
        return source
    return {name: value for name, value in source.items() if name != "num_prompts"}


def stored_prompts(
    data: DataConfig, target_fingerprint: str, source: PromptSourceConfig | None = None
) -> PromptList | None:
    """The cached prompt list of `source` (None = the only one; possibly shorter or longer
    than asked).

    A list cached before lists could grow (keyed with its `num_prompts`, no record of
    where its stream stopped) is used when it is exactly the size asked.
    """
    source = _one(data, source)
    path = prompts_cache_file(data, target_fingerprint, source)
    if path.is_file():
        saved = json.loads(path.read_text())
        return PromptList(saved["prompts"], saved["consumed"])
    inputs = _prompt_inputs(data, source, target_fingerprint)
    legacy = cache_root(data) / "prompts" / f"{_digest(inputs)}.json"
    if legacy.is_file():
        prompts = json.loads(legacy.read_text())
        if len(prompts) == source.num_prompts:
            return PromptList(prompts, consumed=None)
    return None


def save_prompts(
    data: DataConfig, target_fingerprint: str, prompts: PromptList, source: PromptSourceConfig
) -> None:
    write_json_atomic(
        prompts_cache_file(data, target_fingerprint, source), dataclasses.asdict(prompts)
    )


# --- responses reused from a cached dataset of the same stream ----------------------------


def reuse_donor_shards(
    root: Path,
    todo: list[int],
    prompts: list[Prompt],
    shard_size: int,
    data: DataConfig,
    target_fingerprint: str,
    progress: bool = True,
) -> tuple[list[int], dict | None]:
    """Write the shards of `todo` that another cached dataset already answered; return the
    shards left to generate and where the others came from (None when none did).

    A donor is a finished dataset whose key inputs equal these apart from
    `source.num_prompts`: its prompts are the first `num_prompts` of the same stream, so
    every shard of ours that lies within them holds the same samples. Greedy responses
    depend on the prompt alone; sampled ones on the shard and the prompt's place in it,
    so then the donor must have been cut into shards of the same size.
    """
    donor = _best_donor(root, data, target_fingerprint, shard_size)
    if donor is None:
        return todo, None
    path, meta = donor
    covered = min(meta["num_prompts"], len(prompts))
    reuse = {i for i in todo if min((i + 1) * shard_size, len(prompts)) <= covered}
    if not reuse:
        return todo, None
    dsd = datasets.load_from_disk(str(path))
    rows = datasets.concatenate_datasets(list(dsd.values()))
    row_of = {prompt: i for i, prompt in enumerate(rows["prompt"])}
    keys = [prompt_key(p) for p in prompts]  # as the `prompt` column holds them
    missing = sum(k not in row_of for k in keys[:covered])
    if (
        missing > meta["num_dropped_empty"]
    ):  # more than its empty responses: another stream after all
        logger.warning(
            "cached dataset %s lacks %d of the first %d prompts; not reused", path, missing, covered
        )
        return todo, None
    for i in tqdm(
        sorted(reuse), desc=f"shards from {meta['key']}", unit="shard", disable=not progress
    ):
        shard = [row_of[k] for k in keys[i * shard_size : (i + 1) * shard_size] if k in row_of]
        save_atomic(rows.select(shard), shard_dir(root / "work", i))
    logger.info(
        "reused %d of %d shards to generate from the cached dataset %s (%d prompts)",
        len(reuse),
        len(todo),
        path,
        meta["num_prompts"],
    )
    return [i for i in todo if i not in reuse], {"key": meta["key"], "shards": len(reuse)}


def _best_donor(
    root: Path, data: DataConfig, target_fingerprint: str, shard_size: int
) -> tuple[Path, dict] | None:
    """The finished dataset of the same stream with the most prompts (see `reuse_donor_shards`);
    None for a mix, whose list is no prefix of a larger mix's."""
    if isinstance(data.source, list):
        return None
    inputs = key_inputs(data, target_fingerprint)
    want = inputs | {"source": _without_count(inputs["source"])}
    best = None
    for meta_file in cache_root(data).glob("*/dataset/meta.json"):
        if meta_file.parent.parent == root:
            continue
        meta = json.loads(meta_file.read_text())
        if meta["inputs"] | {"source": _without_count(meta["inputs"]["source"])} != want:
            continue
        if data.temperature > 0 and meta.get("shard_size") != shard_size:
            continue
        if best is None or meta["num_prompts"] > best[1]["num_prompts"]:
            best = (meta_file.parent, meta)
    return best
