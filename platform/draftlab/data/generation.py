"""Self-distillation responses: the frozen target answers a shard of prompts (HF `generate`
or a vLLM engine, `data.generator`) and, with `data.store_features`, its features are kept
for every position: the residual states after `data.aux_layers` (for `p-eagle`) then the last
hidden state, (T, (n_aux + 1) * H) float16.

These are pure functions of a loaded target; `ShardGenerator` is the Ray Data actor that
runs them, one shard per call, and saves each shard itself (`draftlab.data.selfdistill`
drives the pool).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import datasets
import numpy as np
import torch

from draftlab.config import DataConfig, TargetSpec
from draftlab.data.cache import save_atomic, shard_dir
from draftlab.data.dataset import token_counts
from draftlab.data.responses import generate_responses
from draftlab.data.sources import Prompt, prompt_key
from draftlab.export import vllm_target_dir
from draftlab.models.drafters.p_eagle import resolve_aux_layers
from draftlab.models.target import load_target, placed_spec
from draftlab.vllm_offline import VllmEngine

_FP16_MAX = 65504.0  # float16's largest finite value; bf16/fp32 features are clamped to it


# --- pure functions of a loaded target (they run inside the actors) ----------------------


def sample_features(feature_size: int, store_features: bool) -> datasets.Features:
    cols = {
        "input_ids": datasets.List(datasets.Value("int32")),
        "prompt_len": datasets.Value("int32"),
        "prompt": datasets.Value("string"),
    }
    if store_features:
        cols["hidden"] = datasets.Array2D(shape=(None, feature_size), dtype="float16")
    return datasets.Features(cols)


def open_writer(
    data: DataConfig, target, generator: str, sampled: bool = True
) -> contextlib.AbstractContextManager:
    """The vLLM engine on `target`'s weights when `generator` (`data.generator` for the
    responses, `data.prompt_writer` for magpie prompts) is `vllm`; None for `hf` (the
    target's own `generate` writes them). An engine that may sample with seeds (`sampled`)
    schedules whole prefills (`VllmEngine.whole_prefills`); a greedy one keeps vLLM's
    chunked prefill."""
    if generator == "hf":
        return contextlib.nullcontext(None)

    # Room for the longest chat-formatted prompt plus its response: prompts are cut to
    # max_prompt_tokens of text, the chat template adds its header and system turn.
    length = max(s.prompt_token_limit for s in data.sources) + max(data.response_lengths) + 256
    return VllmEngine(
        vllm_target_dir(target),
        dtype=target.dtype,
        max_model_len=length,
        memory_fraction=data.vllm_memory_fraction,
        max_num_seqs=data.batch_size,
        reserved_cpus=0,
        memory_setting="data.vllm_memory_fraction",
        whole_prefills=sampled,
    )


@torch.inference_mode()
def target_features(
    target, sequences: list[list[int]], batch_size: int, aux_layers: list[int]
) -> list[np.ndarray]:
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
        ids = torch.full(
            (len(chunk), max(len(sequences[i]) for i in chunk)), pad, dtype=torch.long
        )  # (B, W)
        for row, i in enumerate(chunk):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
        hidden = target.run_decoder(
            tuple(aux_layers), input_ids=ids.to(target.device), use_cache=False
        )  # (B, W, F)
        hidden = hidden.float().clamp(-_FP16_MAX, _FP16_MAX).half().cpu()
        for row, i in enumerate(chunk):
            out[i] = hidden[row, : len(sequences[i])].numpy()  # (T, F)
    return out


def build_shard(
    target,
    prompts: list[Prompt],
    data: DataConfig,
    seed: int,
    writer=None,
    lengths: list[int] | None = None,
) -> datasets.Dataset:
    """Generate (`writer`, `lengths`: see `generate_responses`), cut and (optionally)
    featurise one shard; empty responses are dropped. A chat prompt is rendered with its
    earlier turns by the target's chat template and stored as JSON in the `prompt` column
    (`prompt_key`)."""
    prompt_ids = [target.encode_prompt(p) for p in prompts]
    responses = generate_responses(target, prompt_ids, data, seed, writer, lengths)
    keep = [i for i, r in enumerate(responses) if r]
    seqs = [prompt_ids[i] + responses[i] for i in keep]
    cols = {
        "input_ids": seqs,
        "prompt_len": [len(prompt_ids[i]) for i in keep],
        "prompt": [prompt_key(prompts[i]) for i in keep],
    }
    aux = resolve_aux_layers(data.aux_layers, target.num_layers)
    if data.store_features:
        cols["hidden"] = target_features(target, seqs, data.batch_size, aux)
    width = (len(aux) + 1) * target.hidden_size
    return datasets.Dataset.from_dict(cols, features=sample_features(width, data.store_features))


# --- the actor, and the target spec it loads ---------------------------------------------


class ShardGenerator:
    """Ray Data actor: loads the target (and, for `generator: vllm`, starts its engine)
    once, then generates and saves one shard per row.

    Rows are `{"shard": int, "prompts": <JSON list of prompts>, "lengths": <JSON list of
    answer lengths, or null for data.max_new_tokens>}` (JSON: a chat prompt is a list of
    messages, which Arrow would not mix with texts); each output row is a small summary
    (the samples themselves go to disk, so a killed job keeps the finished shards).
    """

    def __init__(self, target_spec: dict, data: dict, work_dir: str):

        # per-shard "Saving the dataset" bars would flood the driver
        datasets.disable_progress_bars()
        self.data = DataConfig.model_validate(data)
        self.work_dir = Path(work_dir)
        self.target = load_target(TargetSpec.model_validate(target_spec))
        self._stack = contextlib.ExitStack()
        self.writer = self._stack.enter_context(
            open_writer(
                self.data, self.target, self.data.generator, sampled=self.data.temperature > 0
            )
        )

    def __del__(self):
        stack = getattr(self, "_stack", None)
        if stack is not None:  # the vLLM engine's processes end with it
            stack.close()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        (index,) = batch["shard"].tolist()  # batch_size=1: one shard per call
        prompts = json.loads(batch["prompts"][0])
        dest = shard_dir(self.work_dir, index)
        t0 = time.perf_counter()
        if not dest.is_dir():  # a retried task may find its shard already saved
            ds = build_shard(
                self.target,
                prompts,
                self.data,
                seed=self.data.seed * 1_000_003 + index,
                writer=self.writer,
                lengths=json.loads(batch["lengths"][0]),
            )
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


def generation_spec(target_spec: TargetSpec, use_gpu: bool) -> TargetSpec:
    """The spec the generation actors load: no "auto" left in device or dtype.

    The device follows `use_gpu`, not CUDA availability: Ray 2.60 leaves
    CUDA_VISIBLE_DEVICES alone for actors that reserved no GPU, so "auto" would grab an
    unreserved GPU on a GPU node.
    """
    return placed_spec(target_spec, use_gpu, "data.use_gpu", "generation actors")
