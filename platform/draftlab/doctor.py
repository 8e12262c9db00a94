"""`draftlab doctor`: the engine checked on this machine's device, one JSON line per check.

Needs torch, transformers and pydantic alone (no Ray, MLflow, vLLM or model hub): targets are
random-weight Llamas of real shapes built in memory on the device (`models/shapes.py`), or a
local target directory. On a GPU machine without draftlab installed:
`PYTHONPATH=platform python -m draftlab doctor --gpu`. The checks, in order:

  env       versions, the device and its memory bandwidth (a timed copy)
  identity  greedy output of each verify attention, dtype and tree against target-only decoding,
            and HF `generate` against it, with the target's top-2 margin at every difference
            (a drafter replaying decoding's own output proposes, so every draft should pass)
  verify    t(k)/t(1): one target forward of k rows over a cached context
  decode    ms per token of target-only decoding (ours and HF `generate`) against one forward
            and the bandwidth floor (the weights read once per token)
  profile   where a decoding step's host time goes (torch.profiler): the top operators, and
            the kernel launches and host syncs per token
  search    the tree the tree search picks with this device's costs: the best tree per node
            budget under a drafter's measured rank acceptance (`--acceptance`, default a packaged
            SmolLM2-135M drafter's), each priced with its timed verify forward and drafting
  train     one bf16 (where supported) training step of a p-eagle drafter, K=4
"""

from __future__ import annotations

import json
import platform as std_platform  # the stdlib module (our source root has no __init__.py)
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from draftlab.config import DoctorConfig, SamplingParams, TargetSpec, TrainConfig
from draftlab.decoding.agreement import mismatches
from draftlab.decoding.baselines import hf_runner
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree_files import resolve_tree
from draftlab.decoding.tree_search import best_tree, expected_accepted
from draftlab.distill.batching import collate
from draftlab.distill.objective import DistillModule, loss_and_backward, teacher_states
from draftlab.distill.precision import autocast_context, precision_for
from draftlab.hardware import describe_device, sync
from draftlab.models.drafters.build import init_drafter
from draftlab.models.presets import numbered_tokenizer
from draftlab.models.shapes import SHAPES
from draftlab.models.target import Target, assemble_target, load_target, resolve_device
from draftlab.profiling import draft_ms, profile_target, verify_ms

# A trained drafter's held-out conditional rank acceptance (see its "source"): the search
# check's table when none is given.
PACKAGED_ACCEPTANCE = Path(__file__).parent / "decoding" / "rates" / "smollm2-135m-p-eagle-k4.json"
CPU_DEFAULTS = {
    "identity_shape": "tiny",
    "speed_shape": "tiny",
    "contexts": [64],
    "train_batch": 2,
    "train_seq": 64,
}
CUDA_DEFAULTS = {
    "identity_shape": "llama-3.2-1b",
    "speed_shape": "llama-3.1-8b",
    "contexts": [512, 2048],
    "train_batch": 8,
    "train_seq": 1024,
}


def with_defaults(cfg: DoctorConfig, device: torch.device) -> DoctorConfig:
    """`cfg` with the fields left unset filled in for `device`."""
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    return cfg.model_copy(update={k: v for k, v in defaults.items() if getattr(cfg, k) is None})


def build_target(
    cfg: DoctorConfig, shape: str, device: torch.device, dtype: torch.dtype, attention: str = "auto"
) -> Target:
    """The configured local target, or a random-weight Llama of `shape` built on `device`."""
    if cfg.target is not None:
        return load_target(
            TargetSpec(
                name=cfg.target,
                device=device.type,
                attention=attention,
                dtype=str(dtype).removeprefix("torch."),
            )
        )
    s = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=8192,
        initializer_range=s.init,
        tie_word_embeddings=False,
    )
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        torch.device(device),
    ):
        torch.manual_seed(0)  # the same weights for every dtype and attention
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return assemble_target(
        f"random-{shape}", model, numbered_tokenizer(s.vocab), device, dtype, attention
    )


def random_prompts(target: Target, count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.vocab_size, (count, length), generator=gen).tolist()


class ReplayDrafter:
    """A drafter that proposes a known greedy output (decoding's own): while the committed
    tokens follow it, its top-1 draft at every position is the next reference token, so a
    correct engine accepts every draft. Its other ranks are fixed wrong tokens (tree
    siblings). Satisfies the engine's drafter contract (`new_state`, `propose`, `check_k`)."""

    aux_layers = ()  # reads no target features

    def __init__(self, sequence: list[int], vocab: int, device: torch.device):
        self.sequence, self.vocab, self.device = (
            sequence,
            vocab,
            device,
        )  # prompt + reference output

    def check_k(self, k: int) -> None:
        pass

    def new_state(self) -> list[int]:
        return self.sequence[:1]  # the first prompt token is never pending

    def propose(
        self,
        state: list[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        k: int,
        pick: Callable[[int, torch.Tensor], int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state.extend(tokens.tolist())
        n = len(state)
        on_track = state == self.sequence[:n]
        nxt = self.sequence[n : n + k] if on_track else []
        nxt = nxt + [(state[-1] + 1 + j) % self.vocab for j in range(len(nxt), k)]
        logits = torch.zeros(k, self.vocab, device=self.device)  # (k, V)
        for j, tok in enumerate(nxt):
            for rank in range(4):  # ranks 0..3: the reference token, then its neighbours
                logits[j, (tok + rank) % self.vocab] = 10.0 - rank
        drafts = torch.tensor([pick(j, logits[j]) for j in range(k)], device=self.device)
        return drafts, logits


def check_env(device: torch.device) -> dict:
    return {
        "check": "env",
        "device": describe_device(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": std_platform.python_version(),
        "cuda": torch.version.cuda,
        "memory_gb_per_s": round(copy_bandwidth(device) / 1e9, 1),
    }


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + written: the memory's traffic),
    median of 5; 1 GiB on a GPU, 256 MiB on a CPU (past its caches either way)."""
    megabytes = 1024 if device.type == "cuda" else 256
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times[1:])


def check_identity(cfg: DoctorConfig, device: torch.device) -> Iterator[dict]:
    """Per dtype and attention: HF `generate` and every tree against `ar` (greedy)."""
    params = SamplingParams(max_new_tokens=cfg.new_tokens)
    for dtype_name in cfg.dtypes:
        for attention in cfg.attentions:
            dtype = getattr(torch, dtype_name)
            target = build_target(cfg, cfg.identity_shape, device, dtype, attention)
            prompts = random_prompts(target, cfg.prompts, cfg.prompt_tokens)
            ref = [autoregressive_generate(target, p, params).tokens for p in prompts]
            hf = hf_runner(target, params)
            outputs = {"hf_generate": ([hf(p).tokens for p in prompts], None)}
            for spec in cfg.trees:
                tree = resolve_tree(spec, None, k=4, cut=False)
                results = [
                    SpeculativeDecoder(
                        target, ReplayDrafter(p + r, target.vocab_size, device), tree
                    ).generate(p, params)
                    for p, r in zip(prompts, ref, strict=True)
                ]
                tau = sum(r.stats.tau for r in results) / len(results)
                outputs[tree.name] = ([r.tokens for r in results], tau)
            for method, (outs, tau) in outputs.items():
                found = mismatches(target, prompts, ref, outs)
                yield {
                    "check": "identity",
                    "target": target.name,
                    "dtype": dtype_name,
                    "attention": attention,
                    "method": method,
                    "identical": f"{len(prompts) - len(found)}/{len(prompts)}",
                    "tau": tau,
                    "mismatches": found,
                }
            del target


def check_verify(cfg: DoctorConfig, target: Target) -> Iterator[dict]:
    for context in cfg.contexts:
        ms = profile_target(target, context, cfg.rows, cfg.repeats)  # {k: ms}
        base = ms[str(cfg.rows[0])]
        yield {
            "check": "verify",
            "target": target.name,
            "context": context,
            "ms": ms,
            "ratio": {k: v / base for k, v in ms.items()},
        }


def check_decode(cfg: DoctorConfig, target: Target, bandwidth: float) -> Iterator[dict]:
    """Target-only decoding, ours and HF's (its prefill included), against one forward and the
    bandwidth floor; and speculative decoding with every draft right (a drafter replaying
    decoding's own output: the most a drafter can buy on this device, the engine's round
    overhead included). A deep random-weight model has nearly flat logits: at a bf16 tie the
    speculative output may leave decoding's path, after which the replayed drafts are wrong
    (`identical` false, tau near 1) and the figure says nothing."""
    params = SamplingParams(max_new_tokens=cfg.new_tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    for context in cfg.contexts:
        prompt = random_prompts(target, 1, context, seed=1)[0]
        forward_ms = profile_target(target, context, [1], cfg.repeats)["1"]
        hf = hf_runner(target, params)
        autoregressive_generate(target, prompt, params)  # warm-up: allocations, lazy inits
        hf(prompt)
        ours = autoregressive_generate(target, prompt, params)
        theirs = hf(prompt)
        line = {
            "check": "decode",
            "target": target.name,
            "context": context,
            "new_tokens": len(ours.tokens),
            "ours_ms_per_token": _ms_per_token(ours),
            "hf_generate_ms_per_token": 1e3 * theirs.seconds / len(theirs.tokens),
            "forward_ms": forward_ms,
            "bandwidth_floor_ms": 1e3 * weight_bytes / bandwidth,
        }  # every weight read once
        for spec in ("chain-4", "wide-16"):
            decoder = SpeculativeDecoder(
                target,
                ReplayDrafter(prompt + ours.tokens, target.vocab_size, target.device),
                resolve_tree(spec, None, k=4, cut=False),
            )
            decoder.generate(prompt, params)
            replayed = decoder.generate(prompt, params)
            line[f"replay_{spec}"] = {
                "ms_per_token": _ms_per_token(replayed),
                "tau": replayed.stats.tau,
                "identical": replayed.tokens == ours.tokens,
            }
        yield line


def _ms_per_token(result) -> float:
    """Decoding ms per token after the prefill's first (a `GenerationResult`)."""
    return 1e3 * (result.stats.total_s - result.stats.prefill_s) / max(len(result.tokens) - 1, 1)


def check_profile(cfg: DoctorConfig, target: Target, top: int = 12) -> Iterator[dict]:
    """torch.profiler over target-only decoding: host time by operator, launches and syncs."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 -- only this check

    params = SamplingParams(max_new_tokens=min(cfg.new_tokens, 32))
    prompt = random_prompts(target, 1, cfg.contexts[0], seed=2)[0]
    autoregressive_generate(target, prompt, params)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if target.device.type == "cuda" else []
    )
    with profile(activities=activities) as prof:
        out = autoregressive_generate(target, prompt, params)
    steps = max(out.stats.rounds, 1)
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    yield {
        "check": "profile",
        "target": target.name,
        "steps": steps,
        "ms_per_token": 1e3 * (out.stats.total_s - out.stats.prefill_s) / steps,
        "launches_per_token": count.get("cudaLaunchKernel", 0) / steps,
        "syncs_per_token": (
            count.get("cudaStreamSynchronize", 0) + count.get("cudaDeviceSynchronize", 0)
        )
        / steps,
        "device_to_host_copies_per_token": count.get("aten::_local_scalar_dense", 0) / steps,
        "top_host_ops": [
            {
                "op": e.key,
                "self_ms_per_token": e.self_cpu_time_total / 1e3 / steps,
                "calls_per_token": e.count / steps,
            }
            for e in by_host
        ],
    }


def load_acceptance(source: str | None) -> tuple[list[list[float]], str]:
    """Conditional rank acceptance rates (depth x rank) and where they came from: a
    `tree-search.json` (or the drafter directory holding one), or the packaged table."""
    path = Path(source) if source else PACKAGED_ACCEPTANCE
    if path.is_dir():
        path = path / "tree-search.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"acceptance table {path} not found: give a drafter's tree-search.json or its directory"
        )
    data = json.loads(path.read_text())
    return data["acceptance"], data.get("source", str(path))


def check_search(cfg: DoctorConfig, target: Target) -> Iterator[dict]:
    """The best tree per node budget (`tree_search.best_tree`), priced on this device: one
    timed verify forward per tree and a p-eagle drafter's timed drafting to its depth;
    predicted speedup = expected tau x t_decode / (t_verify + t_draft), the positional model's."""
    acc, source = load_acceptance(cfg.acceptance)
    trees: dict[tuple, object] = {}
    for n in cfg.search_budgets:
        tree = best_tree(acc, n)
        trees.setdefault(tree.paths, tree)  # budgets past the useful paths give the same tree
    context = cfg.contexts[0]
    decode, *verify = verify_ms(target, [None, *trees.values()], context, cfg.repeats)
    deepest = max(t.depth for t in trees.values())
    drafter = init_drafter("p-eagle", target, k=deepest, depth=1).to(target.device)
    drafting = {
        d: draft_ms(drafter, d, context, cfg.repeats)
        for d in sorted({t.depth for t in trees.values()})
    }
    rows = []
    for tree, v in zip(trees.values(), verify, strict=True):
        tau = 1.0 + expected_accepted(tree, acc)
        rows.append(
            {
                "nodes": tree.num_nodes,
                "depth": tree.depth,
                "expected_tau": tau,
                "verify_ms": v,
                "draft_ms": drafting[tree.depth],
                "predicted_speedup": tau * decode / (v + drafting[tree.depth]),
                "paths": [list(p) for p in tree.paths],
            }
        )
    best = max(rows, key=lambda r: r["predicted_speedup"])
    yield {
        "check": "search",
        "target": target.name,
        "context": context,
        "acceptance": source,
        "decode_ms": decode,
        "chosen": {
            "nodes": best["nodes"],
            "depth": best["depth"],
            "predicted_speedup": best["predicted_speedup"],
        },
        "candidates": [{k: v for k, v in r.items() if k != "paths"} for r in rows],
        "chosen_paths": best["paths"],
    }


def check_train(cfg: DoctorConfig, device: torch.device) -> Iterator[dict]:
    """A p-eagle K=4 drafter's training step against the identity shape (autocast as
    `train.autocast: auto` resolves on this device)."""
    target = build_target(
        cfg, cfg.identity_shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    k = 4
    drafter = init_drafter("p-eagle", target, k=k, depth=1).to(device).train()
    ids = random_prompts(target, cfg.train_batch, cfg.train_seq, seed=3)
    batch = collate(
        [{"input_ids": x, "prompt_len": cfg.train_seq // 4} for x in ids],
        k,
        cfg.train_seq,
        False,
        None,
    )
    batch = batch.to(device)
    feats = teacher_states(target, batch, drafter.cfg.aux_layers)
    module, train = DistillModule(drafter), TrainConfig()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    precision = precision_for("auto", device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(4):
        sync(device)
        t0 = time.perf_counter()
        with autocast_context(precision, device):
            loss_and_backward(module, drafter, batch, feats, train, k)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    yield {
        "check": "train",
        "target": target.name,
        "batch": cfg.train_batch,
        "seq": cfg.train_seq,
        "autocast": str(precision.dtype).removeprefix("torch.") if precision.dtype else "none",
        "step_ms": 1e3 * step_s,
        "response_tokens_per_s": batch.response_tokens / step_s,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
    }


def run_doctor(cfg: DoctorConfig, emit: Callable[[dict], None]) -> list[dict]:
    """Run the configured checks, passing each JSON line to `emit` as it is ready."""
    device = resolve_device(cfg.device)
    cfg = with_defaults(cfg, device)
    if "search" in cfg.checks:
        load_acceptance(cfg.acceptance)  # a wrong path fails before minutes of checks
    lines: list[dict] = []
    speed_target, bandwidth = None, None

    def speed() -> Target:
        nonlocal speed_target
        if speed_target is None:
            speed_target = build_target(
                cfg,
                cfg.speed_shape,
                device,
                torch.bfloat16 if device.type == "cuda" else torch.float32,
            )
        return speed_target

    for name in cfg.checks:
        t0 = time.perf_counter()
        try:
            if name == "env":
                line = check_env(device)
                bandwidth = line["memory_gb_per_s"] * 1e9
                found = [line]
            elif name == "identity":
                found = check_identity(cfg, device)
            elif name == "verify":
                found = check_verify(cfg, speed())
            elif name == "decode":
                found = check_decode(cfg, speed(), bandwidth or copy_bandwidth(device))
            elif name == "profile":
                found = check_profile(cfg, speed())
            elif name == "search":
                found = check_search(cfg, speed())
            else:
                found = check_train(cfg, device)
            for line in found:
                line["seconds"] = round(time.perf_counter() - t0, 2)
                lines.append(line)
                emit(line)
        except Exception as e:  # one failed check is reported, the others still run
            line = {"check": name, "error": f"{type(e).__name__}: {e}"}
            lines.append(line)
            emit(line)
    return lines
