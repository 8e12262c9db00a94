"""Issue [3/4] item 9: a job driver reads the target's fingerprint from its safetensors
files (headers + a memory-mapped sample) instead of loading the model; the result must
equal what `load_target` computes on the loaded weights, or drafters and cached data
would stop matching their target."""

import json
import struct

import pytest
import torch

from draftlab.config import TargetSpec
from draftlab.models.fingerprint import NotFromFiles, files_fingerprint
from draftlab.models.presets import PRESETS
from draftlab.models.target import TargetInfo, describe_target, load_target


def _save(tmp_path, tie: bool, dtype: torch.dtype, shard: str | None = None):
    model, tokenizer = PRESETS["tiny-llama"](dtype)
    if tie:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    out = tmp_path / f"tiny-tie{tie}-{dtype}".replace("torch.", "")
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_files_fingerprint_equals_the_loaded_models(tmp_path, tie, saved):
    out = _save(tmp_path, tie, saved, shard="20KB")  # several shards + an index
    assert (out / "model.safetensors.index.json").is_file()
    for dtype in ("float32", "bfloat16", "float16"):
        loaded = load_target(TargetSpec(name=str(out), device="cpu", dtype=dtype))
        assert files_fingerprint(out, getattr(torch, dtype)) == loaded.fingerprint, dtype


def test_describe_target_reads_files_only_and_matches_load_target(tmp_path):
    out = _save(tmp_path, tie=False, dtype=torch.float32)
    spec = TargetSpec(name=str(out), device="cpu", dtype="float32")
    info, loaded = describe_target(spec), load_target(spec)
    assert isinstance(info, TargetInfo) and not hasattr(info, "model")
    assert (info.fingerprint, info.eos_token_ids) == (loaded.fingerprint, loaded.eos_token_ids)
    assert info.tokenizer("Hi").input_ids == loaded.tokenizer("Hi").input_ids


def test_changed_weights_change_the_files_fingerprint(tmp_path):
    out = _save(tmp_path, tie=False, dtype=torch.float32)
    before = files_fingerprint(out, torch.float32)
    model, _ = PRESETS["tiny-llama"](torch.float32)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    model.save_pretrained(out)
    assert files_fingerprint(out, torch.float32) != before


def test_tensors_the_files_do_not_hold_are_refused(tmp_path):
    out = _save(tmp_path, tie=False, dtype=torch.float32)
    path = out / "model.safetensors"
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header["lm_head.weighs"] = header.pop("lm_head.weight")  # as a renamed/fused checkpoint would
    blob = (
        json.dumps(header, separators=(",", ":")).encode().ljust(size)
    )  # same length: the data offsets stay valid
    assert len(blob) == size
    path.write_bytes(raw[:8] + blob + raw[8 + size :])
    with pytest.raises(NotFromFiles, match="lm_head.weight"):
        files_fingerprint(out, torch.float32)


def test_in_memory_presets_are_described_by_loading():
    info = describe_target("tiny-llama")
    assert info.fingerprint == load_target("tiny-llama").fingerprint
