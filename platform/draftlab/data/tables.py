"""Tables of prompts or documents: a hub dataset, a local file (its `datasets` builder from
the extension) or a saved `datasets` directory, as a source config names them."""

from __future__ import annotations

import re
from pathlib import Path

import datasets

from draftlab.config import PromptSourceConfig

# Local files: extension -> `datasets` packaged builder.
_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}


def describe_source(cfg: PromptSourceConfig) -> str:
    subset = f", subset {cfg.subset!r}" if cfg.subset else ""
    files = f", data_files {cfg.data_files!r}" if cfg.data_files is not None else ""
    return f"prompt source {cfg.path!r} (split {cfg.split!r}{subset}{files})"


def open_dataset(cfg: PromptSourceConfig):
    """A `datasets.Dataset` for a hub name, a local file (builder from its extension), a
    `save_to_disk` directory, or any other directory `datasets` understands."""
    if not cfg.path:
        raise ValueError(
            "prompt source kind 'dataset' needs source.path (hub name or local file/dir)"
        )
    path = Path(cfg.path).expanduser()
    builder = _BUILDERS.get(path.suffix.lower()) if path.is_file() else None
    if path.is_file() and builder is None:
        raise ValueError(
            f"{describe_source(cfg)}: unsupported file type {path.suffix!r}; "
            f"use one of {sorted(_BUILDERS)} or a directory"
        )
    if path.is_file() and cfg.data_files is not None:
        raise ValueError(
            f"{describe_source(cfg)}: source.data_files picks files of a hub repo or "
            "directory, not of a file"
        )
    try:
        if builder is not None:
            # The file *is* the split named in the config, so slices like `train[:100]` work.
            files = {re.match(r"\w*", cfg.split).group(0) or "train": str(path)}
            return datasets.load_dataset(builder, data_files=files, split=cfg.split)
        if path.is_dir() and (
            (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
        ):
            loaded = datasets.load_from_disk(str(path))
            return loaded[cfg.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(
            str(path) if path.is_dir() else cfg.path,
            cfg.subset,
            split=cfg.split,
            data_files=cfg.data_files,
        )
    except (
        Exception
    ) as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError...)
        raise ValueError(
            f"{describe_source(cfg)}: could not load it: {type(e).__name__}: {e}"
        ) from e
