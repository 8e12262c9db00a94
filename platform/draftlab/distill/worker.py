"""Tier 1: `train_fn_per_worker`, the loop every Ray Train worker runs, as a recipe with
named phases (`DistillRecipe`): setup, then step after step with evaluate and checkpoint at
their cadences, then finalize.

Each worker loads the frozen target (embeddings, head, and the teacher when features are
neither cached nor streamed from feature actors, `train.feature_stream`), reads the cached
self-distillation data, trains its DDP replica (or FSDP shard,
`scaling.strategy`) on its share of the batches, and reports a checkpoint (drafter +
optimizer + step + data position) every N steps. Held-out evaluation is sharded across the
ranks too (every rank computes the same totals; `distill.evaluation`). Rank 0 then finishes
the run (`finalize.finish`: the drafter saved, its curve, its tree chosen and benched).
Rank 0 alone talks to MLflow: it tries to flush buffered metrics just before each
checkpoint and stores whatever MLflow has not received in that checkpoint, so an outage
never stalls training and a restart never duplicates or skips a logged step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import datasets
import ray.train
import ray.train.torch
import torch

from draftlab.data.selfdistill import training_view
from draftlab.distill.checkpoint import restore_checkpoint, save_checkpoint
from draftlab.distill.drafter_setup import build_drafter, training_samples, usable_features
from draftlab.distill.evaluation import (
    all_ranks_gather,
    all_ranks_max,
    all_ranks_sum,
    evaluate,
    weights_digest,
)
from draftlab.distill.feature_stream import streamed_steps
from draftlab.distill.finalize import finish
from draftlab.distill.loader import Step, TrainStream, batch_stream, epoch_batches
from draftlab.distill.objective import DistillModule, Stats, loss_and_backward, teacher_states
from draftlab.distill.payload import WorkerPayload
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
from draftlab.distill.train_state import PHASES, Evaluation, LogWindow, TrainState
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import load_target
from draftlab.tracking import Tracker

log = logging.getLogger(__name__)


def lr_factor(step: int, warmup: int, total: int, time_used: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak, driven by whichever runs out
    first: the steps (`total`) or the time budget (`time_used`, the fraction spent)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_used))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class DistillRecipe:
    """One worker's training run in phases: `setup`, then `step` after `step` with `evaluate`
    and `checkpoint` at their cadences until the data or the time budget runs out (`train`),
    then `finalize`. Every rank runs every phase; rank 0 alone saves files and logs to MLflow.

    What the phases change: `state` (checkpointed), `window` (the metrics since the last
    logged step), `last_eval` (its metrics go with each report: Tune's ASHA reads them),
    `step_seconds` (seconds per step phase, this attempt) and `elapsed` (the slowest rank's
    training seconds: every rank takes the same lr and stop decisions).
    """

    def __init__(self, payload: WorkerPayload):
        self.payload = payload
        self.cfg = payload.cfg
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()

    def run(self) -> dict:
        self.setup()
        self.train()
        return self.finalize()

    # -- setup: target, data, drafter and optimizer (resumed from Ray's checkpoint), batches --

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        self.device = ray.train.torch.get_device()
        self.precision = precision_for(cfg.train.autocast, self.device)
        apply_matmul_precision(self.precision)
        self.target = load_target(cfg.target.model_copy(update={"device": self.device.type}))
        data = training_view(datasets.load_from_disk(self.payload.data_path))
        self.tracker = Tracker(
            tracking_uri=self.payload.tracking_uri,
            experiment=cfg.tracking.experiment,
            run_id=self.payload.mlflow_run_id,
            enabled=self.rank == 0 and self.payload.mlflow_run_id is not None,
            max_buffer_seconds=cfg.tracking.max_outage_s,
            max_outage_s=cfg.tracking.max_outage_s,
        )
        train, evalset = training_samples(data["train"], cfg.train.max_samples), data["eval"]
        self._setup_drafter(train)
        self.train_set, self.evalset = (
            usable_features(d, cfg, self.target, self.drafter) for d in (train, evalset)
        )
        self._setup_batches()

    def _make_optimizer(self, drafter: DrafterNet) -> torch.optim.Optimizer:
        """Wrap `drafter` for data parallelism (FSDP shards it in place), then AdamW over the
        wrapped parameters (under FSDP: this rank's shards)."""
        cfg = self.cfg
        self.model = wrap_model(
            DistillModule(drafter, cfg.train.feature_noise), cfg.scaling.strategy, self.world
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95)
        )

    def _setup_drafter(self, train: datasets.Dataset) -> None:
        """The drafter, its wrapped model and optimizer, the grad scaler and the trainer state:
        restored from Ray's latest checkpoint when there is one (the resume), else new."""
        ckpt = ray.train.get_checkpoint()
        if ckpt:
            self.drafter, self.optimizer, saved = restore_checkpoint(
                ckpt, self.target, self._make_optimizer
            )
        else:
            self.drafter = build_drafter(self.cfg, self.target, train)
            self.optimizer = self._make_optimizer(self.drafter)
            saved = {}
        self.params = [
            p for p in self.model.parameters() if p.requires_grad
        ]  # what the optimizer steps (FSDP: shards)
        self.k = self.drafter.groups  # training groups per packed position
        self.sharded = is_sharded(self.model)
        self.scaler = grad_scaler(self.precision, self.device)
        scaler_state = saved.pop("grad_scaler", None)
        if scaler_state and self.scaler.is_enabled():
            self.scaler.load_state_dict(scaler_state)
        tracking = saved.pop("tracking", None)
        self.state = TrainState(**saved)
        self.resumed_from = self.state.step
        # Metrics MLflow had not received when the checkpoint was saved (an outage) go out first.
        self.tracker.restore(tracking)
        # A restarted attempt (with or without a checkpoint) must not re-log steps already sent.
        self.tracker.resume_after("loss")

    def _setup_batches(self) -> None:
        """This rank's batch stream from the saved data position, the step and time budgets,
        and the clocks."""
        cfg, state = self.cfg.train, self.state
        per_epoch = len(
            epoch_batches(len(self.train_set), cfg.batch_size, 0, cfg.seed, self.rank, self.world)
        )
        self.total_steps = max(1, per_epoch * cfg.epochs)
        self.budget_s = cfg.time_budget_minutes * 60 if cfg.time_budget_minutes else float("inf")
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.rank * 104729 + state.step)
        stream = TrainStream(
            self.train_set, self.k, cfg, self.rank, self.world, state.epoch, state.batch, gen
        )
        if cfg.feature_stream:  # the target's features from Ray Data actors, not a cache
            self.batches = streamed_steps(
                stream,
                cfg.feature_stream,
                self.cfg.target,
                self.payload.data_path,
                self.drafter.cfg.aux_layers or [],
                self.device,
            )
        else:
            self.batches = batch_stream(stream, self.device, cfg.prefetch)
        self.tokens0 = state.tokens
        self.t_start, self.elapsed0 = time.perf_counter(), state.elapsed_s
        self.elapsed = self.elapsed0
        self.stopped = False  # by the time budget
        self.window = LogWindow(Stats(self.k))
        self.step_seconds = dict.fromkeys(PHASES, 0.0)
        self.last_eval = Evaluation(-1, Stats(self.k), {})

    def _clock(self) -> float:
        """This rank's training seconds over every attempt."""
        return self.elapsed0 + time.perf_counter() - self.t_start

    # -- the loop ------------------------------------------------------------------------

    def train(self) -> None:
        """Steps until this rank's batches or the time budget run out."""
        cfg, state = self.cfg.train, self.state
        while (item := self.step()) is not None:
            if state.step % cfg.eval_every == 0 and len(self.evalset):
                self.evaluate()
            # step complete: during an MLflow outage, retry delivery now and then
            self.tracker.poll()
            self.elapsed = all_ranks_max(self._clock(), self.device)
            self.stopped = self.elapsed >= self.budget_s
            if state.step % cfg.checkpoint_every == 0 and not self.stopped:
                self.checkpoint()
            if self.stopped:
                break
            if item.index + 1 == item.count:  # the epoch is done
                state.epoch += 1
                state.batch = 0
        self.batches.close()  # stops the prefetching worker
        if not self.stopped:  # every epoch done (including epochs this rank had no batch in)
            state.epoch, state.batch = cfg.epochs, 0

    def step(self) -> Step | None:
        """One optimisation step on the next batch of this rank's stream (None when there is
        none left); its metrics are logged every `train.log_every` steps."""
        cfg, state, window = self.cfg.train, self.state, self.window
        clock = [time.perf_counter()]
        item = next(self.batches, None)  # the next batch of this rank's stream, on the device
        if item is None:
            return None
        batch = item.batch
        state.epoch, state.batch = item.epoch, item.index
        for g in self.optimizer.param_groups:
            g["lr"] = cfg.lr * lr_factor(
                state.step, cfg.warmup_steps, self.total_steps, self.elapsed / self.budget_s
            )
        scaler = self.scaler
        with autocast_context(self.precision, self.device):
            clock.append(time.perf_counter())
            feats = teacher_states(self.target, batch, self.drafter.cfg.aux_layers)
            clock.append(time.perf_counter())
            stats = loss_and_backward(
                self.model,
                self.drafter,
                batch,
                feats,
                cfg,
                self.k,
                scaler=scaler if scaler.is_enabled() else None,
            )
            clock.append(time.perf_counter())
        scaler.unscale_(self.optimizer)  # fp16: true gradients before clipping (otherwise a no-op)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, cfg.grad_clip
        )  # FSDP: the global norm
        scaler.step(self.optimizer)  # fp16: skipped when a gradient overflowed
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        clock.append(time.perf_counter())
        for name, t0, t1 in zip(
            PHASES, clock[:-1], clock[1:], strict=True
        ):  # on GPU: launch times unless synced
            window.seconds[name] += t1 - t0
            self.step_seconds[name] += t1 - t0
        state.step += 1
        state.batch += 1
        state.tokens += batch.response_tokens
        window.tokens += batch.response_tokens
        window.stats.add(stats)
        if state.step % cfg.log_every == 0:
            self._log_window(grad_norm)
        return item

    def _log_window(self, grad_norm: torch.Tensor) -> None:
        """Buffer the window's metrics (means per step, throughput) for MLflow; start a new one."""
        cfg, window = self.cfg.train, self.window
        dt = time.perf_counter() - window.started
        tps = window.tokens / dt if dt else 0.0
        norm = (
            grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        )  # FSDP: a DTensor
        self.tracker.buffer_metrics(
            {
                "loss": window.stats.loss / cfg.log_every,
                "lr": self.optimizer.param_groups[0]["lr"],
                "grad_norm": float(norm),
                "train/tokens_per_s_worker": tps,
                "train/tokens_per_s_total": all_ranks_sum(tps, self.device),
                **window.stats.metrics("train"),
                **{f"train/ms_{n}": 1000 * v / cfg.log_every for n, v in window.seconds.items()},
            },
            self.state.step,
        )
        self.window = LogWindow(Stats(self.k))

    def evaluate(self) -> None:
        """Held-out evaluation at this step, on every rank (sharded, same totals everywhere):
        a point of the training curve, buffered for MLflow."""
        state = self.state
        stats = evaluate(self.model, self.target, self.evalset, self.cfg, self.k)
        self.last_eval = Evaluation(state.step, stats, stats.metrics("eval"))
        minutes = self._clock() / 60
        state.evaluations.append(
            {
                "step": state.step,
                "minutes": minutes,
                "tokens": state.tokens,
                "sim_accept_len": stats.sim_accept_len,
                "accuracy": stats.accuracy,
            }
        )
        self.tracker.buffer_metrics(self.last_eval.metrics, state.step)
        if (
            self.rank == 0
        ):  # the run's progress line: Ray Train's worker log, forwarded to the driver's console
            budget = f" of {self.budget_s / 60:.0f}" if math.isfinite(self.budget_s) else ""
            log.info(
                "%s: step %d, %.1f%s min, %.2f M tokens: held-out sim. accept len %.3f, agreement "
                "%s",
                self.cfg.name,
                state.step,
                minutes,
                budget,
                state.tokens / 1e6,
                stats.sim_accept_len,
                " / ".join(f"{a:.3f}" for a in stats.accuracy),
            )

    def checkpoint(self, final: bool = False) -> dict[str, torch.Tensor] | None:
        """Flush metrics, then commit a checkpoint (all ranks report; rank 0 attaches files).
        Returns the gathered weights under FSDP (full on rank 0), else None.

        The flush is one bounded attempt (the final one waits, within
        `tracking.max_outage_s`): during an MLflow outage training goes on, and the metrics
        not delivered yet are saved in the checkpoint, so every step up to a committed
        checkpoint is in MLflow or in that checkpoint (none lost). Steps re-run after a crash
        between flush and commit are dropped by `tracker.resume_after` (none logged twice).
        """
        state = self.state
        state.elapsed_s = self._clock()
        metrics = {
            "step": state.step,
            "epoch": state.epoch,
            "tokens": state.tokens,
            "final": final,
            **self.last_eval.metrics,
        }
        if final:
            self.tracker.drain()
        else:
            self.tracker.try_flush()
        weights = (
            full_weights(self.drafter) if self.sharded else None
        )  # every rank: gathers the shards
        opt_state = optimizer_state(
            self.drafter, self.optimizer
        )  # every rank; full tensors on rank 0
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if self.rank == 0:
                saved = {
                    **dataclasses.asdict(state),
                    "tracking": self.tracker.snapshot(),
                    "grad_scaler": self.scaler.state_dict(),
                }
                path = save_checkpoint(
                    Path(tmp) / "checkpoint", self.drafter, opt_state, saved, weights=weights
                )
                checkpoint = ray.train.Checkpoint.from_directory(str(path))
            ray.train.report(metrics, checkpoint=checkpoint)
        return weights

    # -- the end: final evaluation and checkpoint (all ranks); export and summary (rank 0) --

    def finalize(self) -> dict:
        """Evaluate (unless this step was) and commit the final checkpoint; then rank 0
        exports the drafter (`finalize.finish`), logs the summary to MLflow and returns it
        (the other ranks return {})."""
        if (
            len(self.evalset) and self.last_eval.step != self.state.step
        ):  # not evaluated at this step yet
            self.evaluate()
        weights = self.checkpoint(final=True)
        # DDP replicas must agree; FSDP keeps one sharded copy (nothing to compare)
        digests = None if self.sharded else all_ranks_gather(weights_digest(self.drafter))
        nodes = all_ranks_gather(ray.get_runtime_context().get_node_id())
        if self.rank != 0:
            return {}
        exported = (
            unsharded_copy(self.drafter, weights, self.target) if self.sharded else self.drafter
        )
        summary = self._summary(exported, digests, nodes)
        out_dir = Path(self.payload.output_dir)
        summary |= finish(
            self.cfg,
            exported,
            self.target,
            self.train_set,
            self.evalset,
            self.state.evaluations,
            out_dir,
            self.tracker,
            self.payload.data_path,
        )
        final_eval = self.last_eval.stats
        final_metrics = {
            name: float(v)
            for name, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        final_metrics |= {
            f"eval/final_acc_pos{d + 1}": a for d, a in enumerate(final_eval.accuracy)
        }
        final_metrics |= {f"train/step_ms_{n}": v for n, v in summary["train_step_ms"].items()}
        self.tracker.log_metrics_now(final_metrics, self.state.step)
        self.tracker.log_artifacts(str(out_dir), "drafter")
        self.tracker.log_text(json.dumps(self.cfg.model_dump(), indent=2), "config.json")
        return summary

    def _summary(self, exported: DrafterNet, digests: list[str] | None, nodes: list[str]) -> dict:
        """The run's summary, before `finalize.finish` adds the export's and bench's results."""
        state, final_eval = self.state, self.last_eval.stats
        loop_s = sum(
            self.step_seconds.values()
        )  # the steps themselves: no evaluation, logging or checkpoints
        steps_run = state.step - self.resumed_from
        return {
            "steps": state.step,
            "resumed_from_step": self.resumed_from,
            "epochs_done": state.epoch,
            "tokens": state.tokens,
            "train_seconds": state.elapsed_s,
            "train_tokens_per_s": state.tokens / state.elapsed_s if state.elapsed_s else 0.0,
            "train_step_ms": {
                n: 1000 * v / max(1, steps_run) for n, v in self.step_seconds.items()
            },
            "train_steps_per_s": steps_run / loop_s if loop_s else 0.0,
            "train_loop_tokens_per_s": (state.tokens - self.tokens0) / loop_s if loop_s else 0.0,
            "stopped_by_budget": self.stopped,
            "eval_sim_accept_len": final_eval.sim_accept_len,
            "eval_accuracy": final_eval.accuracy,
            "drafter_parameters": exported.num_parameters(),
            "world_size": self.world,
            "worker_nodes": nodes,
            "replica_weights_equal": None if digests is None else len(set(digests)) == 1,
            "strategy": "fsdp" if self.sharded else ("ddp" if self.world > 1 else "single"),
        }


def train_fn_per_worker(config: dict) -> dict:
    """Ray Train's per-worker function: validate the driver's `train_loop_config` (a dumped
    `WorkerPayload`), run the recipe; returns the run's summary on rank 0, {} on the others."""
    return DistillRecipe(WorkerPayload.model_validate(config)).run()
