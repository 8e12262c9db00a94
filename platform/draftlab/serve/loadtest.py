"""`draftlab loadtest`: a closed-loop load generator for an OpenAI-compatible endpoint.

After an untimed warm-up of every speculation mode (`warmup`), for each concurrency level C
and each speculation mode, C clients each send a chat completion, wait for it to finish and
send the next, until the level's request count is done. The modes of a level take turns in
`rounds` rounds (A B, B A, ...), so a machine whose speed drifts weighs on each alike; each
mode's rounds are pooled. Reported per level and mode:
requests/s, output tokens/s, p50/p95 time to first token and latency, tau (tokens per
target forward, from the `usage.speculative` the server returns), draft tokens verified and
errors.

With `duration_s` (a soak) each level runs for that long instead, and the report adds a
timeline per `window_s`: requests, errors, latency p50/p95 and the resident memory of the
Serve replica processes on this machine (flat memory and stable latency = no leak, no
degradation).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from draftlab.config import LoadtestConfig
from draftlab.data.prompts import Prompt, load_prompts
from draftlab.vllm_scheduler import REQUEST_K


@dataclass
class Outcome:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    spec: dict | None = None
    error: str | None = None
    end_s: float = 0.0  # when it finished (perf_counter)
    kind: str = "default"  # the prompt's category


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def _one(
    client: httpx.AsyncClient, cfg: LoadtestConfig, model: str, messages: list[dict], mode: str
) -> Outcome:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": cfg.stream,
    }
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if mode != "server":
        body["speculation"] = mode  # draftlab's engine
    if (
        mode == "off"
    ):  # vLLM served by draftlab: this request's draft tokens capped at 0 (`vllm_scheduler`)
        body["vllm_xargs"] = {REQUEST_K: 0}
    t0 = time.perf_counter()
    ttft, usage = None, None
    try:
        if not cfg.stream:
            r = await client.post("/chat/completions", json=body)
            if r.status_code != 200:
                return Outcome(
                    False, time.perf_counter() - t0, error=f"HTTP {r.status_code}: {r.text[:200]}"
                )
            usage = r.json()["usage"]
        else:
            async with client.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return Outcome(
                        False,
                        time.perf_counter() - t0,
                        error=f"HTTP {r.status_code}: {r.text[:200]}",
                    )
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Outcome(
                            False, time.perf_counter() - t0, error=chunk["error"]["message"]
                        )
                    if (
                        ttft is None
                        and chunk["choices"]
                        and chunk["choices"][0]["delta"].get("content")
                    ):
                        ttft = time.perf_counter() - t0
                    usage = chunk.get("usage") or usage
    except (httpx.HTTPError, KeyError, json.JSONDecodeError) as e:
        return Outcome(False, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    if usage is None:
        return Outcome(False, time.perf_counter() - t0, error="no usage in the response")
    return Outcome(
        True, time.perf_counter() - t0, ttft, usage["completion_tokens"], usage.get("speculative")
    )


def replica_rss_mb() -> dict[str, float]:
    """Resident memory of this machine's Ray Serve replica processes, by pid."""
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "memory_info"]):
        title = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        if "ServeReplica:" in title and p.info["memory_info"]:
            out[str(p.info["pid"])] = round(p.info["memory_info"].rss / 2**20, 1)
    return out


@dataclass
class _Timed:
    """One timed run of requests at one concurrency in one mode."""

    outcomes: list[Outcome]
    wall_s: float
    soak: dict | None = None  # duration_s runs: replica memory and the per-window timeline


async def _timed(
    client,
    cfg: LoadtestConfig,
    model: str,
    prompts: Iterator[Prompt],
    concurrency: int,
    mode: str,
    n: int | None,
    progress: bool = False,
) -> _Timed:
    """`concurrency` clients send the next of `prompts` as soon as their last request ends:
    `n` requests in all, or for `cfg.duration_s` when `n` is None (a soak)."""
    todo = iter(range(n)) if n is not None else itertools.count()
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration_s if n is None else float("inf")
    rss: list[tuple[float, dict[str, float]]] = [(0.0, replica_rss_mb())]

    async def worker():
        for _ in todo:
            if time.perf_counter() >= deadline:
                return
            prompt = next(prompts)
            outcome = await _one(client, cfg, model, prompt.messages, mode)
            outcome.end_s, outcome.kind = time.perf_counter(), prompt.category
            outcomes.append(outcome)

    async def sample_memory():
        while True:
            await asyncio.sleep(cfg.window_s)
            rss.append((time.perf_counter() - t0, replica_rss_mb()))
            if progress:
                done = [o for o in outcomes if o.end_s >= t0 + rss[-1][0] - cfg.window_s]
                print(
                    f"  {rss[-1][0]:.0f} s: {len(done)} requests in the last window, "
                    f"{sum(not o.ok for o in done)} errors, replica RSS "
                    f"{sum(rss[-1][1].values()):.0f} MiB",
                    flush=True,
                )

    sampler = asyncio.create_task(sample_memory()) if n is None else None
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    if sampler is None:
        return _Timed(outcomes, wall)
    sampler.cancel()
    rss.append((wall, replica_rss_mb()))
    soak = {
        "rss_mb_start": rss[0][1],
        "rss_mb_end": rss[-1][1],
        "timeline": timeline(outcomes, t0, cfg.window_s, rss),
    }
    return _Timed(outcomes, wall, soak)


async def _levels(
    client, cfg: LoadtestConfig, model: str, chats: list[Prompt], concurrency: int, progress: bool
) -> list[dict]:
    """Every mode at one concurrency level: `cfg.rounds` timed rounds, the modes' order
    reversed every other round (A B, B A, ...), each mode's rounds pooled into its figures."""
    if cfg.duration_s is not None:  # a soak: one run per mode, for its duration
        runs = {
            m: [
                await _timed(
                    client, cfg, model, itertools.cycle(chats), concurrency, m, None, progress
                )
            ]
            for m in cfg.speculation
        }
    else:
        n = cfg.requests or max(len(chats), 2 * concurrency)
        shares = [n // cfg.rounds + (i < n % cfg.rounds) for i in range(cfg.rounds)]
        prompts = {m: itertools.cycle(chats) for m in cfg.speculation}  # each mode: every prompt
        runs = {m: [] for m in cfg.speculation}
        for i, share in enumerate(s for s in shares if s):
            for m in cfg.speculation if i % 2 == 0 else cfg.speculation[::-1]:
                runs[m].append(await _timed(client, cfg, model, prompts[m], concurrency, m, share))
    out = []
    for m, timed in runs.items():
        outcomes = [o for t in timed for o in t.outcomes]
        row = summarise(outcomes, sum(t.wall_s for t in timed))
        out.append(
            row
            | {"concurrency": concurrency, "speculation": m, "rounds": len(timed)}
            | (timed[0].soak or {})
        )
    return out


def timeline(
    outcomes: list[Outcome], t0: float, window_s: float, rss: list[tuple[float, dict]]
) -> list[dict]:
    """Per window (by finish time): requests, errors, latency p50/p95, replica RSS (MiB, total)
    at the sample closest to the window's end."""
    windows: dict[int, list[Outcome]] = {}
    for o in outcomes:
        windows.setdefault(int((o.end_s - t0) // window_s), []).append(o)
    rows = []
    for w, items in sorted(windows.items()):
        lats = [o.latency_s for o in items if o.ok]
        end = (w + 1) * window_s
        mem = min(rss, key=lambda r: abs(r[0] - end))[1]
        rows.append(
            {
                "window_end_s": end,
                "requests": len(items),
                "errors": sum(not o.ok for o in items),
                "latency_p50_s": _percentile(lats, 50),
                "latency_p95_s": _percentile(lats, 95),
                "replica_rss_mb": round(sum(mem.values()), 1),
            }
        )
    return rows


def summarise(outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens for o in ok)
    specs = [o.spec for o in ok if o.spec]
    forwards = sum(s["target_forwards"] for s in specs)
    ttfts, lats = [o.ttft_s for o in ok if o.ttft_s is not None], [o.latency_s for o in ok]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p95_s": _percentile(ttfts, 95),
        "latency_p50_s": _percentile(lats, 50),
        "latency_p95_s": _percentile(lats, 95),
        "tau": (forwards + sum(s["accepted"] for s in specs)) / forwards if forwards else None,
        "drafted": sum(s["drafted"] for s in specs),  # draft tokens the target verified
        "mean_completion_tokens": tokens / len(ok) if ok else 0.0,
        "error_samples": sorted({o.error for o in outcomes if not o.ok})[:3],
        # per prompt kind: each request's own output tokens/s (completion tokens / latency),
        # averaged
        "by_kind": {
            kind: {
                "requests": len(rows),
                "request_tokens_per_s": statistics.fmean(
                    o.completion_tokens / o.latency_s for o in rows
                ),
            }
            for kind, rows in _by_kind(ok).items()
        },
    }


def _by_kind(outcomes: list[Outcome]) -> dict[str, list[Outcome]]:
    out: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.latency_s > 0:
            out.setdefault(o.kind, []).append(o)
    return dict(sorted(out.items()))


async def _run(cfg: LoadtestConfig, progress: bool) -> dict:
    chats = load_prompts(cfg.prompts)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4)
    async with httpx.AsyncClient(
        base_url=cfg.url.rstrip("/"), headers=headers, timeout=cfg.timeout_s, limits=limits
    ) as client:
        model = cfg.model
        if model is None:
            r = await client.get("/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        warm = min(len(chats), 16) if cfg.warmup is None else cfg.warmup
        for mode in cfg.speculation if warm else ():
            await _timed(
                client,
                cfg,
                model,
                itertools.cycle(chats),
                min(max(cfg.concurrency), warm),
                mode,
                warm,
            )
        levels = []
        for c in cfg.concurrency:
            for res in await _levels(client, cfg, model, chats, c, progress):
                levels.append(res)
                if progress:
                    print(format_row(res), flush=True)
    return {
        "url": cfg.url,
        "model": model,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": cfg.stream,
        "levels": levels,
    }


def run_loadtest(cfg: LoadtestConfig, progress: bool = True) -> dict:
    try:
        report = asyncio.run(_run(cfg, progress))
    except httpx.ConnectError as e:
        raise ConnectionError(
            f"cannot reach {cfg.url} ({e}): is `draftlab serve` running?"
        ) from None
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_row(r: dict) -> str:
    def s(v):
        return "-" if v is None else f"{v:.2f}"

    return (
        f"c={r['concurrency']:<3} spec={r['speculation']:<6} req/s {s(r['requests_per_s'])}  tok/s "
        f"{s(r['output_tokens_per_s'])}  ttft p50/p95 {s(r['ttft_p50_s'])}/{s(r['ttft_p95_s'])} s  "
        f"latency p50/p95 {s(r['latency_p50_s'])}/{s(r['latency_p95_s'])} s  tau {s(r['tau'])}  "
        f"errors {r['errors']}"
        + (
            "\n      per request tok/s by kind: "
            + ", ".join(f"{k} {v['request_tokens_per_s']:.1f}" for k, v in r["by_kind"].items())
            if r.get("by_kind")
            else ""
        )
    )
