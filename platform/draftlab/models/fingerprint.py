"""Target weights fingerprints: from a loaded model, or from its safetensors files alone.

Both give the same digest (names, shapes and a strided bfloat16 sample of every tensor in
the model's state dict), so a job driver can key the data cache and check drafters
without building the model: it reads the safetensors headers and memory-maps only the
sampled values (a few pages per tensor, not the whole multi-GB checkpoint into RAM).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

SAMPLES_PER_TENSOR = 4096
# safetensors dtype tag -> (numpy dtype with the same bytes, torch dtype to view them as)
_DTYPES = {
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
    "F64": (np.float64, torch.float64),
}


def _digest(entries) -> str:
    """sha256 over (name, shape, sample) in name order; `entries` yields them sorted."""
    h = hashlib.sha256()
    for name, shape, sample in entries:
        h.update(f"{name}:{tuple(shape)}".encode())
        h.update(sample.to(torch.bfloat16).float().numpy().tobytes())
    return h.hexdigest()[:16]


def _strided(flat, samples: int):
    step = max(1, flat.shape[0] // samples)
    return flat[::step][:samples]


def weights_fingerprint(model: nn.Module, samples_per_tensor: int = SAMPLES_PER_TENSOR) -> str:
    """A cheap, stable digest of the weights: names, shapes and a strided sample of values.

    Hashing all bytes of a multi-GB model takes minutes; a strided sample of every tensor
    still changes when any checkpoint is swapped, which is what the drafter check needs.
    Samples are rounded to bfloat16 first, so the same weights loaded in float32, bfloat16
    or float16 share one fingerprint (a drafter trained against one precision loads on all).
    """
    return _digest(
        (name, t.shape, _strided(t.detach().reshape(-1), samples_per_tensor).to("cpu"))
        for name, t in sorted(model.state_dict().items())
    )


class NotFromFiles(Exception):
    """The files cannot reproduce `weights_fingerprint` (the caller loads the model instead)."""


def _headers(directory: Path) -> dict[str, tuple[Path, dict, int]]:
    """tensor name -> (file, header entry, data start) over model.safetensors or its shards."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise NotFromFiles(f"no safetensors weights in {directory}")
    out = {}
    for name in files:
        path = directory / name
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        out |= {k: (path, v, 8 + size) for k, v in header.items()}
    return out


def _file_sample(
    path: Path, entry: dict, start: int, load_dtype: torch.dtype, samples: int
) -> torch.Tensor:
    if entry["dtype"] not in _DTYPES:
        raise NotFromFiles(f"{path.name}: tensor dtype {entry['dtype']} is not a float type")
    np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    count = (end - begin) // np.dtype(np_dtype).itemsize
    if count == 0:
        return torch.empty(0)
    flat = np.memmap(path, dtype=np_dtype, mode="r", offset=start + begin, shape=(count,))
    picked = torch.from_numpy(np.array(_strided(flat, samples))).view(
        torch_dtype
    )  # a copy: memmaps are read-only
    # The loaded model holds the values in `load_dtype`: round through it as loading would.
    return picked.to(load_dtype)


def files_fingerprint(
    directory: Path, load_dtype: torch.dtype, samples_per_tensor: int = SAMPLES_PER_TENSOR
) -> str:
    """`weights_fingerprint` of the model `from_pretrained(directory, dtype=load_dtype)`
    gives, read from the safetensors files without loading it.

    The state dict's names and shapes come from the model built on the meta device (no
    memory); a name missing from the files must be tied to one that is there (e.g.
    `lm_head.weight` to the embeddings). Raises `NotFromFiles` when the files do not map
    one to one (renamed or fused tensors, quantised weights): load the model then.
    """
    headers = _headers(directory)
    config = AutoConfig.from_pretrained(directory)
    if getattr(config, "quantization_config", None):
        raise NotFromFiles(f"{directory} holds quantised weights")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    owner = {}  # id(parameter) -> a name the files hold it under
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        if name in headers:
            owner.setdefault(id(p), name)
    params = dict(skeleton.named_parameters(remove_duplicate=False))

    def entries():
        for name, t in sorted(skeleton.state_dict(keep_vars=True).items()):
            stored = name if name in headers else owner.get(id(params.get(name)))
            if stored is None:
                raise NotFromFiles(f"{name} is not in the safetensors files of {directory}")
            path, entry, start = headers[stored]
            if tuple(entry["shape"]) != tuple(t.shape):
                raise NotFromFiles(
                    f"{stored}: shape {entry['shape']} in the files, {tuple(t.shape)} in the model"
                )
            yield name, t.shape, _file_sample(path, entry, start, load_dtype, samples_per_tensor)

    return _digest(entries())
