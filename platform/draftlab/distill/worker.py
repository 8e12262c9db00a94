"""Tier 1: `train_fn_per_worker`, the loop every Ray Train worker runs.

Each worker loads the frozen target (embeddings, head, and the teacher when features are
not cached), reads the cached self-distillation data, trains its DDP replica (or FSDP shard,
`scaling.strategy`) on its share of the batches, and reports a checkpoint (drafter +
optimizer + step + data position) every N steps. Held-out evaluation is sharded across the
ranks too (every rank computes the same totals). Rank 0 then finishes the run
(`finalize.finish`: the drafter saved, its curve, its tree chosen and benched).
Rank 0 alone talks to MLflow: it tries to flush buffered metrics just before each
checkpoint and stores whatever MLflow has not received in that checkpoint, so an outage
never stalls training and a restart never duplicates or skips a logged step.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import datasets
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from draftlab.config import DistillConfig
from draftlab.data.selfdistill import training_view
from draftlab.distill.batching import collate
from draftlab.distill.checkpoint import restore_checkpoint, save_checkpoint
from draftlab.distill.finalize import finish
from draftlab.distill.loader import TrainStream, batch_stream, epoch_batches
from draftlab.distill.objective import DistillModule, Stats, loss_and_backward, teacher_states
from draftlab.distill.precision import (
    apply_matmul_precision,
    autocast_context,
    grad_scaler,
    precision_for,
)
from draftlab.distill.sharding import (
    full_weights,
    is_sharded,
    optimizer_state,
    unsharded_copy,
    wrap_model,
)
from draftlab.models.drafters.build import init_drafter, load_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.drafters.p_eagle import resolve_aux_layers
from draftlab.models.target import Target, load_target
from draftlab.tracking import Tracker

# A training step's phases, timed per step and logged as train/ms_<phase>: get the packed
# batch onto the device (waiting for the prefetching worker, or collating inline with
# `train.prefetch: 0`); read (or compute) the target's features; drafter forward (the group
# mask is built there, on the device), loss and backward; gradient clipping and the optimizer.
PHASES = ("collate", "features", "forward_backward", "optimizer")


def frequent_tokens(train: datasets.Dataset, n: int, vocab: int, always: frozenset[int]) -> torch.Tensor:
    """VocabTrim: the n most frequent response tokens (plus EOS), sorted by id.

    Slots left once every response token is in (small data sets use a few thousand distinct
    tokens) go to the most frequent prompt tokens, then to the lowest ids (BPE ids roughly
    follow merge order, i.e. corpus frequency), instead of arbitrary never-seen tokens."""
    resp = torch.zeros(vocab, dtype=torch.long)
    prompt = torch.zeros(vocab, dtype=torch.long)
    for row in train.select_columns(["input_ids", "prompt_len"]):
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        resp += torch.bincount(ids[row["prompt_len"] :], minlength=vocab)[:vocab]
        prompt += torch.bincount(ids[: row["prompt_len"]], minlength=vocab)[:vocab]
    # One sortable score: response count, then prompt count, then lower id first.
    rank = torch.arange(vocab, 0, -1, dtype=torch.float64) / (vocab + 1)  # (V,) in (0, 1)
    score = resp.double() * (prompt.max().double() + 1) + prompt.double() + rank
    score[list(always)] = float("inf")
    return score.topk(n).indices.sort().values  # (n,)


def build_drafter(cfg: DistillConfig, target: Target, train: datasets.Dataset) -> DrafterNet:
    spec = cfg.drafter
    if spec.init_from:
        drafter = load_drafter(spec.init_from, target)
    else:
        drafter = init_drafter(spec.family, target, k=spec.k, depth=spec.depth, seed=cfg.train.seed,
                               vocab_size=spec.vocab_size, aux_layers=spec.aux_layers)
        if spec.vocab_size:
            drafter.set_vocab(frequent_tokens(train, spec.vocab_size, target.vocab_size, target.eos_token_ids))
    return drafter.float().train()  # float32 master weights (autocast does the bf16 math)


def usable_features(data: datasets.Dataset, cfg: DistillConfig, target: Target, drafter: DrafterNet) -> datasets.Dataset:
    """`data` without its cached features when they are not the ones `drafter` fuses (another
    `aux_layers`): training then runs the target for them. A last-state family reads the
    last columns of any cache."""
    want = drafter.cfg.aux_layers or []
    cached = resolve_aux_layers(cfg.data.aux_layers, target.num_layers)
    if "hidden" in data.column_names and want and want != cached:
        return data.remove_columns("hidden")
    return data


def autocast(cfg: DistillConfig, device: torch.device):
    """The mixed-precision context for drafter compute (`train.autocast` on `device`)."""
    return autocast_context(precision_for(cfg.train.autocast, device), device)


def lr_factor(step: int, warmup: int, total: int, time_used: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak, driven by whichever runs out
    first: the steps (`total`) or the time budget (`time_used`, the fraction spent)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_used))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _all_ranks_max(x: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _gather(obj) -> list:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def weights_digest(drafter: DrafterNet) -> str:
    """Digest of the trainable weights: equal on every DDP replica after a correct step."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(drafter.named_parameters()):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()


def _all_ranks_sum(x: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sum_over_ranks(stats: Stats) -> Stats:
    """`stats` summed over every rank (each rank gets the totals)."""
    if _rank_world()[1] == 1:
        return stats
    k = stats.k
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([stats.loss, *stats.nodes, *stats.agree, *stats.kl], dtype=torch.float64, device=device)  # (1 + 3k,)
    dist.all_reduce(t)
    v = t.tolist()
    return Stats(k, loss=v[0], nodes=[round(x) for x in v[1 : 1 + k]], agree=[round(x) for x in v[1 + k : 1 + 2 * k]],
                 kl=v[1 + 2 * k :])


@torch.no_grad()
def evaluate(model: torch.nn.Module, target: Target, evalset: datasets.Dataset, cfg: DistillConfig, k: int) -> Stats:
    """Held-out per-position top-1 agreement (no drop-token: every depth of every anchor).

    `model`: the DistillModule as trained (DDP- or FSDP-wrapped). Sharded over the ranks:
    rank r evaluates batches r, r + W, ... of the batches a single worker would make, and the
    sums are all-reduced, so every rank returns the single-worker totals. Every rank runs the
    same number of forwards (an FSDP forward gathers weights from all ranks): a rank out of
    batches in the last round re-runs batch 0 and discards it."""
    rank, world = _rank_world()
    drafter = getattr(model, "module", model).drafter  # DDP keeps the DistillModule in .module
    size = cfg.train.batch_size
    n_batches = -(-len(evalset) // size)  # ceil
    stats = Stats(k)
    model.eval()
    for j in range(rank, -(-n_batches // world) * world, world):
        lo = j * size if j < n_batches else 0
        rows = [evalset[i] for i in range(lo, min(lo + size, len(evalset)))]
        batch = collate(rows, k, cfg.train.max_seq_len, False, None).to(target.device)
        with autocast(cfg, target.device):
            feats = teacher_states(target, batch, drafter.cfg.aux_layers)
            batch_stats = loss_and_backward(model, drafter, batch, feats, cfg.train, k, backward=False)
        if j < n_batches:
            stats.add(batch_stats)
    model.train()
    return _sum_over_ranks(stats)


def train_fn_per_worker(config: dict) -> dict:
    cfg = DistillConfig.model_validate(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    device = ray.train.torch.get_device()
    precision = precision_for(cfg.train.autocast, device)
    apply_matmul_precision(precision)
    target = load_target(cfg.target.model_copy(update={"device": device.type}))
    data = training_view(datasets.load_from_disk(config["data_path"]))
    train, evalset = data["train"], data["eval"]
    tracker = Tracker(
        tracking_uri=config.get("tracking_uri"),
        experiment=cfg.tracking.experiment,
        run_id=config.get("mlflow_run_id"),
        enabled=rank == 0 and config.get("mlflow_run_id") is not None,
        max_buffer_seconds=cfg.tracking.max_outage_s,
        max_outage_s=cfg.tracking.max_outage_s,
    )

    wrapped: dict[str, torch.nn.Module] = {}

    def make_optimizer(d: DrafterNet) -> torch.optim.Optimizer:
        """Wrap `d` for data parallelism (FSDP shards it in place), then AdamW over the
        wrapped parameters (under FSDP: this rank's shards)."""
        wrapped["model"] = wrap_model(DistillModule(d, cfg.train.feature_noise), cfg.scaling.strategy, world)
        params = [p for p in wrapped["model"].parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95))

    ckpt = ray.train.get_checkpoint()
    if ckpt:
        drafter, optimizer, state = restore_checkpoint(ckpt, target, make_optimizer)
    else:
        drafter = build_drafter(cfg, target, train)
        optimizer = make_optimizer(drafter)
        state = {"step": 0, "epoch": 0, "batch": 0, "elapsed_s": 0.0, "tokens": 0}
    model = wrapped["model"]
    k = drafter.groups  # training groups per packed position
    sharded = is_sharded(model)
    scaler = grad_scaler(precision, device)
    scaler_state = state.pop("grad_scaler", None)
    if scaler_state and scaler.is_enabled():
        scaler.load_state_dict(scaler_state)
    state.setdefault("evaluations", [])  # the training curve; older checkpoints lack it
    train, evalset = (usable_features(d, cfg, target, drafter) for d in (train, evalset))
    resumed_from = state["step"]
    # Metrics MLflow had not received when the checkpoint was saved (an outage) go out first.
    tracker.restore(state.pop("tracking", None))
    # A restarted attempt (with or without a checkpoint) must not re-log steps already sent.
    tracker.resume_after("loss")

    per_epoch = len(epoch_batches(len(train), cfg.train.batch_size, 0, cfg.train.seed, rank, world))
    total_steps = max(1, per_epoch * cfg.train.epochs)
    budget_s = cfg.train.time_budget_minutes * 60 if cfg.train.time_budget_minutes else float("inf")
    gen = torch.Generator().manual_seed(cfg.train.seed * 7919 + rank * 104729 + state["step"])
    steps = batch_stream(TrainStream(train, k, cfg.train, rank, world, state["epoch"], state["batch"], gen),
                         device, cfg.train.prefetch)
    tokens0 = state["tokens"]
    t_start, elapsed0 = time.perf_counter(), state["elapsed_s"]
    elapsed = elapsed0  # training seconds so far (all ranks agree)
    window = {"t": time.perf_counter(), "tokens": 0, "stats": Stats(k), "phases": dict.fromkeys(PHASES, 0.0)}
    phase_totals = dict.fromkeys(PHASES, 0.0)  # seconds per step phase, this attempt
    # the last held-out evaluation (its metrics go with each report: Tune's ASHA reads them)
    latest = {"step": -1, "stats": Stats(k), "metrics": {}}

    def evaluate_now(step: int) -> None:  # every rank: sharded, same totals everywhere
        stats = evaluate(model, target, evalset, cfg, k)
        latest.update(step=step, stats=stats, metrics=stats.metrics("eval"))
        state["evaluations"].append({"step": step, "minutes": (elapsed0 + time.perf_counter() - t_start) / 60,
                                     "tokens": state["tokens"], "sim_accept_len": stats.sim_accept_len,
                                     "accuracy": stats.accuracy})
        tracker.buffer_metrics(latest["metrics"], step)

    def report(final: bool = False) -> dict[str, torch.Tensor] | None:
        """Flush metrics, then commit a checkpoint (all ranks report; rank 0 attaches files).
        Returns the gathered weights under FSDP (full on rank 0), else None.

        The flush is one bounded attempt (the final one waits, within
        `tracking.max_outage_s`): during an MLflow outage training goes on, and the metrics
        not delivered yet are saved in the checkpoint, so every step up to a committed
        checkpoint is in MLflow or in that checkpoint (none lost). Steps re-run after a crash
        between flush and commit are dropped by `tracker.resume_after` (none logged twice).
        """
        state["elapsed_s"] = elapsed0 + time.perf_counter() - t_start
        metrics = {"step": state["step"], "epoch": state["epoch"], "tokens": state["tokens"], "final": final, **latest["metrics"]}
        if final:
            tracker.drain()
        else:
            tracker.try_flush()
        weights = full_weights(drafter) if sharded else None  # every rank: gathers the shards
        opt_state = optimizer_state(drafter, optimizer)  # every rank; full tensors on rank 0
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if rank == 0:
                extra = {"tracking": tracker.snapshot(), "grad_scaler": scaler.state_dict()}
                path = save_checkpoint(Path(tmp) / "checkpoint", drafter, opt_state, {**state, **extra}, weights=weights)
                checkpoint = ray.train.Checkpoint.from_directory(str(path))
            ray.train.report(metrics, checkpoint=checkpoint)
        return weights

    params = [p for p in model.parameters() if p.requires_grad]  # what the optimizer steps (FSDP: shards)
    stop = False
    while not stop:
        clock = [time.perf_counter()]
        item = next(steps, None)  # the next batch of this rank's stream, on the device
        if item is None:
            break
        batch = item.batch
        state["epoch"], state["batch"] = item.epoch, item.index
        for g in optimizer.param_groups:
            g["lr"] = cfg.train.lr * lr_factor(state["step"], cfg.train.warmup_steps, total_steps, elapsed / budget_s)
        with autocast_context(precision, device):
            clock.append(time.perf_counter())
            feats = teacher_states(target, batch, drafter.cfg.aux_layers)
            clock.append(time.perf_counter())
            stats = loss_and_backward(model, drafter, batch, feats, cfg.train, k, scaler=scaler if scaler.is_enabled() else None)
            clock.append(time.perf_counter())
        scaler.unscale_(optimizer)  # fp16: true gradients before clipping (otherwise a no-op)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)  # FSDP: the global norm
        scaler.step(optimizer)  # fp16: skipped when a gradient overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        clock.append(time.perf_counter())
        for name, t0, t1 in zip(PHASES, clock[:-1], clock[1:], strict=True):  # on GPU: launch times unless synced
            window["phases"][name] += t1 - t0
            phase_totals[name] += t1 - t0
        state["step"] += 1
        state["batch"] += 1
        state["tokens"] += batch.response_tokens
        window["tokens"] += batch.response_tokens
        window["stats"].add(stats)
        step = state["step"]
        if step % cfg.train.log_every == 0:
            dt = time.perf_counter() - window["t"]
            tps = window["tokens"] / dt if dt else 0.0
            s = window["stats"]
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
            tracker.buffer_metrics(
                {"loss": s.loss / cfg.train.log_every, "lr": optimizer.param_groups[0]["lr"],
                 "grad_norm": float(norm), "train/tokens_per_s_worker": tps,
                 "train/tokens_per_s_total": _all_ranks_sum(tps, device), **s.metrics("train"),
                 **{f"train/ms_{n}": 1000 * v / cfg.train.log_every for n, v in window["phases"].items()}},
                step,
            )
            window = {"t": time.perf_counter(), "tokens": 0, "stats": Stats(k), "phases": dict.fromkeys(PHASES, 0.0)}
        if step % cfg.train.eval_every == 0 and len(evalset):
            evaluate_now(step)
        tracker.poll()  # step complete: during an MLflow outage, retry delivery now and then
        # The slowest rank's clock: every rank takes the same lr and stop decisions.
        elapsed = _all_ranks_max(elapsed0 + time.perf_counter() - t_start, device)
        stop = elapsed >= budget_s
        if step % cfg.train.checkpoint_every == 0 and not stop:
            report()
        if stop:
            break
        if item.index + 1 == item.count:  # the epoch is done
            state["epoch"] += 1
            state["batch"] = 0
    steps.close()  # stops the prefetching worker
    if not stop:  # every epoch done (including epochs this rank had no batch in)
        state["epoch"], state["batch"] = cfg.train.epochs, 0
    # -- end: final evaluation and checkpoint (all ranks); export and benchmark (rank 0) ------
    if len(evalset) and latest["step"] != state["step"]:  # not evaluated at this step yet
        evaluate_now(state["step"])
    final_eval = latest["stats"]
    weights = report(final=True)
    # DDP replicas must agree; FSDP keeps one sharded copy (nothing to compare)
    digests = None if sharded else _gather(weights_digest(drafter))
    nodes = _gather(ray.get_runtime_context().get_node_id())
    if rank != 0:
        return {}
    exported = unsharded_copy(drafter, weights, target) if sharded else drafter
    loop_s = sum(phase_totals.values())  # the steps themselves: no evaluation, logging or checkpoints
    summary = {
        "steps": state["step"],
        "resumed_from_step": resumed_from,
        "epochs_done": state["epoch"],
        "tokens": state["tokens"],
        "train_seconds": state["elapsed_s"],
        "train_tokens_per_s": state["tokens"] / state["elapsed_s"] if state["elapsed_s"] else 0.0,
        "train_step_ms": {n: 1000 * v / max(1, state["step"] - resumed_from) for n, v in phase_totals.items()},
        "train_steps_per_s": (state["step"] - resumed_from) / loop_s if loop_s else 0.0,
        "train_loop_tokens_per_s": (state["tokens"] - tokens0) / loop_s if loop_s else 0.0,
        "stopped_by_budget": stop,
        "eval_sim_accept_len": final_eval.sim_accept_len,
        "eval_accuracy": final_eval.accuracy,
        "drafter_parameters": exported.num_parameters(),
        "world_size": world,
        "worker_nodes": nodes,
        "replica_weights_equal": None if digests is None else len(set(digests)) == 1,
        "strategy": "fsdp" if sharded else ("ddp" if world > 1 else "single"),
    }
    out_dir = Path(config["output_dir"])
    summary |= finish(cfg, exported, target, train, evalset, state["evaluations"], out_dir, tracker)
    final_metrics = {k_: float(v) for k_, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    final_metrics |= {f"eval/final_acc_pos{d + 1}": a for d, a in enumerate(final_eval.accuracy)}
    final_metrics |= {f"train/step_ms_{n}": v for n, v in summary["train_step_ms"].items()}
    tracker.log_metrics_now(final_metrics, state["step"])
    tracker.log_artifacts(str(out_dir), "drafter")
    tracker.log_text(json.dumps(cfg.model_dump(), indent=2), "config.json")
    return summary
