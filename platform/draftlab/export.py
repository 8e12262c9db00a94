"""`draftlab export DRAFTER --format vllm OUT`: a `p-eagle` drafter as vLLM loads it.

vLLM 0.29+ runs it with `speculative_config={"method": "eagle3", "model": OUT,
"num_speculative_tokens": k, "parallel_drafting": true}` (`vllm_speculative_config`); k defaults
to the depth of the tree our engine serves the drafter with (`served_draft_length`).
The layout is vLLM's EAGLE-3 checkpoint (`model_executor/models/llama_eagle3.py`):

    config.json        LlamaForCausalLMEagle3: the decoder's sizes, target vocab and hidden
                       size, draft_vocab_size, ptd_token_id, eagle_config (aux layer ids)
    model.safetensors  fc.weight (H, n*H) | layers.{i}.* (layer 0: q/k/v over 2H inputs +
                       hidden_norm) | norm.weight | lm_head.weight (Vt, H): the target's head
                       rows the drafter scores | d2t (Vt,): target id = draft id + d2t |
                       mask_hidden (1, n*H)
    draftlab.json      the drafter's own config (provenance; vLLM ignores it)

No embedding is written: vLLM shares the target's, as our drafter does. The head rows are
copied from the target because our drafter references (never trains) them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftlab.config import NgramSpec, TargetSpec
from draftlab.decoding.tree import load_tree
from draftlab.decoding.tree_search import static_equivalent
from draftlab.models.drafters.build import load_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.presets import PRESETS, cache_dir
from draftlab.models.target import Target, load_target
from draftlab.storage import local_copy

FORMATS = ("vllm",)
VLLM_FAMILIES = ("p-eagle",)  # families whose math vLLM implements


def vllm_config(drafter: DrafterNet, target: Target) -> dict:
    """config.json of the exported drafter (vLLM reads it with transformers' LlamaConfig)."""
    dec, tc = drafter.cfg.decoder, target.model.config
    rope = dict(dec["rope_parameters"])
    vt = drafter.cfg.vocab_size or target.vocab_size
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": dec["hidden_size"],
        "intermediate_size": dec["intermediate_size"],
        "num_attention_heads": dec["num_attention_heads"],
        "num_key_value_heads": dec["num_key_value_heads"],
        "head_dim": dec["head_dim"],
        "num_hidden_layers": drafter.cfg.depth,
        "max_position_embeddings": getattr(
            tc, "max_position_embeddings", dec["max_position_embeddings"]
        ),
        "rms_norm_eps": dec["rms_norm_eps"],
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": vt,
        "target_hidden_size": target.hidden_size,
        "ptd_token_id": drafter.cfg.mask_token_id,
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": list(drafter.aux_layers),
        },
        "torch_dtype": str(target.dtype).removeprefix("torch."),
        "bos_token_id": getattr(tc, "bos_token_id", None),
        "eos_token_id": getattr(tc, "eos_token_id", None),
    }


def vllm_tensors(drafter: DrafterNet) -> dict[str, torch.Tensor]:
    """The drafter's weights under vLLM's names (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("decoder.layers."):
            out[name.removeprefix("decoder.")] = t
        elif name == "decoder.norm.weight":
            out["norm.weight"] = t
        elif name in ("fc.weight", "mask_hidden"):
            out[name] = t
        elif name != "vocab_ids":
            raise ValueError(f"{name}: no vLLM counterpart (is this a {VLLM_FAMILIES} drafter?)")
    head = drafter.target_head_weight  # (V, H)
    if drafter.cfg.vocab_size:
        ids = drafter.vocab_ids  # (Vt,) sorted target ids
        out["lm_head.weight"] = head[ids]
        out["d2t"] = ids - torch.arange(
            ids.numel(), device=ids.device
        )  # (Vt,) target = draft + d2t
    else:
        out["lm_head.weight"] = head
        out["d2t"] = torch.zeros(head.shape[0], dtype=torch.long, device=head.device)
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def export_vllm(drafter_dir: str | Path, out_dir: str | Path, target: Target | None = None) -> Path:
    """Write `drafter_dir` (a saved `p-eagle` drafter) to `out_dir` in vLLM's layout.

    `target` defaults to the drafter's own (loaded by the name in its config). Re-exporting
    to the same directory replaces it; the files appear together (written beside, then moved).
    """
    drafter_dir, out_dir = local_copy(drafter_dir), Path(out_dir)  # s3://...: its local mirror
    cfg_file = drafter_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter directory (no config.json)")
    family = json.loads(cfg_file.read_text()).get("family")
    if family not in VLLM_FAMILIES:
        raise ValueError(
            f"drafter {drafter_dir} is a {family!r} drafter; vLLM runs {list(VLLM_FAMILIES)} "
            f"(train one with drafter.family=p-eagle)"
        )
    if target is None:
        target = load_target(TargetSpec(name=json.loads(cfg_file.read_text())["target_name"]))
    drafter = load_drafter(drafter_dir, target)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(vllm_tensors(drafter), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(vllm_config(drafter, target), indent=2) + "\n")
    (tmp / "draftlab.json").write_text(
        json.dumps({"source": str(drafter_dir.resolve()), **drafter.cfg.model_dump()}, indent=2)
        + "\n"
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def served_draft_length(drafter_dir: str | Path) -> int:
    """vLLM's default `num_speculative_tokens` for a saved drafter: the depth of the tree our
    engine serves it with (`tree.json`, chosen from its held-out acceptance and the measured
    verify costs), at most its trained K; K when it has none. vLLM drafts and verifies every
    position up to `num_speculative_tokens`, so positions that tree search left out (a deep
    slot accepted a few times in a hundred) would cost a verified row each for nothing. A
    `per_round` tree counts as the best static tree of its node count (its `tree-search.json`)."""
    drafter_dir = Path(drafter_dir)
    k = json.loads((drafter_dir / "config.json").read_text())["k"]
    saved, search = drafter_dir / "tree.json", drafter_dir / "tree-search.json"
    if not saved.is_file():
        return k
    tree = load_tree(str(saved))
    if search.is_file():  # a per-round tree is deep only in the rounds the drafter is sure of
        tree = static_equivalent(tree, json.loads(search.read_text())["acceptance"])
    return min(k, tree.depth)


def served_lookups(drafter_dir: str | Path) -> NgramSpec | None:
    """The prompt lookups our engine grafts onto the tree it serves a saved drafter with (its
    `tree.json`, `+ngram`), None when that tree has none or there is no `tree.json`. vLLM
    merges them into the drafter's drafts (`draftlab.vllm_scheduler`)."""
    saved = Path(drafter_dir) / "tree.json"
    return load_tree(str(saved)).ngram if saved.is_file() else None


def vllm_speculative_config(export_dir: str | Path, k: int) -> dict:
    """vLLM's `speculative_config` for an exported drafter drafting k tokens per round."""
    return {
        "method": "eagle3",
        "model": str(export_dir),
        "num_speculative_tokens": k,
        "parallel_drafting": True,
    }


def vllm_target_dir(target: Target | TargetSpec | str) -> str:
    """What vLLM loads as the target: the HF directory of a preset (tiny test presets are
    saved once under the cache), a local HF directory, or a hub id as given."""
    name = target if isinstance(target, str) else target.name
    if name not in PRESETS:
        if name.endswith(".gguf"):
            raise ValueError(
                f"target {name!r}: export to vLLM needs an HF directory or hub id, not a GGUF file"
            )
        return name
    dest = cache_dir() / "models" / name
    if not (dest / "config.json").is_file():
        model, tokenizer = PRESETS[name](
            torch.float32
        )  # the preset's exact weights (cached presets write dest)
        if not (dest / "config.json").is_file():
            tmp = dest.parent / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
    return str(dest)
