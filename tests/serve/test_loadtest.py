"""`draftlab loadtest`'s schedule of timed runs: rounds in which the modes take turns, every
prompt sent in every mode, rounds pooled per mode. The HTTP requests themselves are replaced
by a recorder here (the real endpoint is loaded in test_serve_app.py and test_vllm_serve.py)."""

from __future__ import annotations

import asyncio

from draftlab.config import LoadtestConfig
from draftlab.data.prompts import load_prompts
from draftlab.serve import loadtest


def _record(monkeypatch) -> list[tuple[str, str]]:
    sent: list[tuple[str, str]] = []

    async def one(client, cfg, model, messages, mode):
        sent.append((mode, messages[-1]["content"]))
        await asyncio.sleep(0)
        return loadtest.Outcome(True, 0.01, 0.005, 4)

    monkeypatch.setattr(loadtest, "_one", one)
    return sent


def _levels(cfg: LoadtestConfig) -> list[dict]:
    async def run():
        return await loadtest._levels(None, cfg, "m", load_prompts(None), 1, progress=False)

    return asyncio.run(run())


def test_modes_take_turns_round_by_round_and_rounds_pool_per_mode(monkeypatch):
    sent = _record(monkeypatch)
    cfg = LoadtestConfig(speculation=["server", "off"], requests=5, rounds=3)
    rows = _levels(cfg)
    modes = [m for m, _ in sent]
    # rounds of 2, 2, 1 requests: A A B B, B B A A, A B
    assert modes == ["server"] * 2 + ["off"] * 4 + ["server"] * 3 + ["off"]
    assert [(r["speculation"], r["requests"], r["rounds"]) for r in rows] == [
        ("server", 5, 3),
        ("off", 5, 3),
    ]
    # each mode walks the prompts in order across its rounds: the same 5 prompts in both
    texts = [p.messages[-1]["content"] for p in load_prompts(None)][:5]
    for mode in ("server", "off"):
        assert [t for m, t in sent if m == mode] == texts


def test_one_round_runs_each_mode_once_in_order(monkeypatch):
    sent = _record(monkeypatch)
    _levels(LoadtestConfig(speculation=["on", "off"], requests=2, rounds=1))
    assert [m for m, _ in sent] == ["on", "on", "off", "off"]
