"""Prompt sources and self-distillation data (draftlab.data: sources, generation, dataset,
selfdistill).

Generation runs for real: Ray Data actors with the tiny target, 12 prompts in 3 shards.
"""

from __future__ import annotations

import json
import logging
import shutil

import datasets
import numpy as np
import pytest
import torch

from draftlab.config import (
    ConfigError,
    DataConfig,
    MixSource,
    PromptSourceConfig,
    SamplingParams,
    TargetSpec,
)
from draftlab.data import cache, selfdistill
from draftlab.data import sources as sources_module
from draftlab.data.cache import cache_path, dataset_key, key_inputs, prompts_cache_file, shard_dir
from draftlab.data.dataset import train_eval_split
from draftlab.data.generation import build_shard, generation_spec, target_features
from draftlab.data.responses import generate_responses
from draftlab.data.selfdistill import load_or_generate
from draftlab.data.sources import (
    collect_prompts,
    dedup_key,
    junk_reason,
    load_prompts_from_source,
    reject_reason,
)
from draftlab.decoding.engine import autoregressive_generate
from draftlab.models.target import cpu_has_fast_bf16
from ray_support import local_ray

PROMPTS = [
    "Write a poem about the sea.",
    "Explain how a rainbow forms.",
    "What is the capital of France?",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Summarise the plot of Hamlet.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "How do vaccines work?",
    "Describe a cat to a child.",
    "What does a compiler do?",
    "Name two planets with rings.",
]
MAX_NEW = 12
TIE = 0.125  # logits apart by a few bf16 ulps: a near-tie two numeric paths may break either way
TINY = TargetSpec(name="tiny-llama")


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """One Ray instance for the module, with draftlab's cache in a temp dir."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTLAB_CACHE", str(tmp_path_factory.mktemp("draftlab-cache")))
        with local_ray():
            yield


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def data_cfg(tmp_path_factory) -> DataConfig:
    path = write_jsonl(
        tmp_path_factory.mktemp("src") / "prompts.jsonl", [{"prompt": p} for p in PROMPTS]
    )
    source = PromptSourceConfig(kind="dataset", path=str(path), num_prompts=len(PROMPTS))
    return DataConfig(
        source=source, max_new_tokens=MAX_NEW, shard_size=4, batch_size=4, eval_fraction=0.25
    )


@pytest.fixture(scope="module")
def generated(ray_local, data_cfg):
    return load_or_generate(data_cfg, TINY, progress=False, keep_shards=True)


def samples(dsd: datasets.DatasetDict) -> list[dict]:
    """All samples of both splits, in prompt order."""
    rows = list(dsd["train"]) + list(dsd["eval"])
    return sorted(rows, key=lambda r: PROMPTS.index(r["prompt"]))


# --- filters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Write a short poem about the sea, please.",
        "请写一首关于大海的短诗。",
        "Напишите короткое стихотворение о море.",
        "اكتب قصيدة قصيرة عن البحر من فضلك.",
        "समुद्र के बारे में एक छोटी कविता लिखिए।",
        "def square(x): return x ** 2  # why?",
    ],
)
def test_junk_filter_keeps_text_in_any_script(text):
    assert junk_reason(text) is None
    assert reject_reason(text, PromptSourceConfig(min_chars=8)) is None


@pytest.mark.parametrize(
    "text,reason",
    [
        ("aaaaaaaaaaaaaaaaaaaa", "one repeated character"),
        ("哈哈哈哈哈哈哈哈哈哈", "one repeated character"),
        ("spam spam spam spam spam eggs", "one repeated word"),
        ("lolololololololololol hi", "repeated pattern"),
        ("What is \ufffd\ufffd here?", "replacement char"),
        ("!?!?!?!?!?!?!?!?", "too few letters/digits"),
        ("\x00\x01\x02\x03 abc \x04\x05\x06\x07", "not mostly text"),
    ],
)
def test_junk_filter_rejects_spam(text, reason):
    assert junk_reason(text) == reason


def test_length_filters(tiny):
    cfg = PromptSourceConfig(min_chars=8, max_prompt_tokens=10)
    assert reject_reason("Hi you", cfg, tiny.tokenizer) == "too short"
    assert (
        reject_reason("A question that is far too long", cfg, tiny.tokenizer) == "too many tokens"
    )
    assert reject_reason("Short one", cfg, tiny.tokenizer) is None  # 9 chars = 9 tokens


def test_features_come_back_in_order_whatever_the_batching(tiny):
    """`target_features` batches length-sorted sequences; each row is still its own
    sequence's states, as one unpadded forward gives them (float16, as cached)."""
    seqs = [[5, 9, 11, 20, 7, 3], [4], [8, 8, 2], [30, 31, 32, 33], [6, 1]]
    aux = [0, 1]
    got = target_features(tiny, seqs, 2, aux)
    for seq, feats in zip(seqs, got, strict=True):
        _, ref = tiny.forward(
            torch.tensor(seq), torch.arange(len(seq)), tiny.new_cache(), aux_layers=tuple(aux)
        )
        assert feats.shape == (len(seq), 3 * tiny.hidden_size) and feats.dtype == np.float16
        np.testing.assert_allclose(
            feats.astype(np.float32), ref.float().numpy(), atol=2e-3, rtol=2e-3
        )


# --- dataset sources -----------------------------------------------------------------------

SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Why is the sky blue?"},
            {"from": "gpt", "value": "Rayleigh."},
        ]
    },
    {
        "conversations": [
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Name two planets with rings."},
        ]
    },
    {"conversations": [{"from": "gpt", "value": "No user turn here."}]},
]
OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Why is the sky blue?"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Name two planets with rings."},
            {"role": "assistant", "content": "Saturn."},
        ]
    },
    {"messages": [{"role": "assistant", "content": "No user turn here."}]},
]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_dataset_source_field(tmp_path, tiny, fmt):
    rows = [
        {"id": 0, "text": "Why is the sky blue?"},
        {"id": 1, "text": "why is the   SKY blue?"},  # duplicate up to case and spaces
        {"id": 2, "text": "zzzzzzzzzzzzzzzz"},  # junk
        {"id": 3, "text": "Hi"},  # too short
        {"id": 4, "text": "Name two planets with rings."},
        {"id": 5, "text": "How do vaccines work?"},
    ]
    path = tmp_path / f"prompts.{fmt}"
    ds = datasets.Dataset.from_list(rows)
    {"jsonl": ds.to_json, "json": ds.to_json, "csv": ds.to_csv, "parquet": ds.to_parquet}[fmt](
        str(path)
    )
    cfg = PromptSourceConfig(kind="dataset", path=str(path), field="text", num_prompts=2)
    got = load_prompts_from_source(cfg, tiny, progress=False)
    assert got == ["Why is the sky blue?", "Name two planets with rings."]


@pytest.mark.parametrize(
    "rows,column", [(SHAREGPT, "conversations"), (OPENAI, "messages")], ids=["sharegpt", "openai"]
)
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dataset_source_conversations(tmp_path, tiny, rows, column, fmt):
    path = tmp_path / f"chats.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, rows)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = PromptSourceConfig(kind="dataset", path=str(path), conversations=column, num_prompts=10)
    got = load_prompts_from_source(cfg, tiny, progress=False)
    assert got == ["Why is the sky blue?", "Name two planets with rings."]


@pytest.mark.parametrize(
    "rows,column", [(SHAREGPT, "conversations"), (OPENAI, "messages")], ids=["sharegpt", "openai"]
)
def test_dataset_source_chats_keep_every_turn_up_to_the_last_users(tmp_path, tiny, rows, column):
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    cfg = PromptSourceConfig(
        kind="dataset", path=str(path), conversations=column, turns="chat", num_prompts=10
    )
    got = load_prompts_from_source(cfg, tiny, progress=False)
    first = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]  # ShareGPT's answer after the last user turn is left for the target to write
    second = [{"role": "user", "content": "Name two planets with rings."}]
    if column == "conversations":
        second = [{"role": "assistant", "content": "Hello!"}, *second]
    assert got == [first, second]
    with pytest.raises(ValueError, match="turns: chat reads a conversation column"):
        PromptSourceConfig(kind="dataset", path=str(path), turns="chat")


def test_a_chat_prompt_is_answered_with_its_earlier_turns(tiny):
    chat = [
        {"role": "user", "content": "Name a planet with rings."},
        {"role": "assistant", "content": "Saturn."},
        {"role": "user", "content": "And another?"},
    ]
    data = DataConfig(max_new_tokens=4, batch_size=2)
    ds = build_shard(tiny, [chat, "Why is the sky blue?"], data, seed=0)
    rendered = tiny.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    row = ds[0]
    assert row["input_ids"][: row["prompt_len"]] == rendered and len(rendered) > 20
    assert json.loads(row["prompt"]) == chat and ds[1]["prompt"] == "Why is the sky blue?"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_prompt_is_answered_to_its_own_length(tiny, temperature):
    """HF decodes a batch to its longest length and cuts each row to its own: the same tokens
    as decoding each to its own length (greedy; sampled with the same seed)."""
    ids = [tiny.encode_prompt(p) for p in PROMPTS[:3]]
    data = DataConfig(max_new_tokens=6, batch_size=3, temperature=temperature)
    full = generate_responses(tiny, ids, data, seed=3)
    got = generate_responses(tiny, ids, data, seed=3, lengths=[2, 6, 4])
    assert got == [full[0][:2], full[1], full[2][:4]] and len(full[0]) > 2


def test_dataset_source_missing_field_names_source_and_columns(tmp_path, tiny):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "Why is the sky blue?", "id": 1}])
    cfg = PromptSourceConfig(kind="dataset", path=str(path), field="prompt")
    with pytest.raises(ValueError) as err:
        load_prompts_from_source(cfg, tiny, progress=False)
    msg = str(err.value)
    assert "'prompt'" in msg and str(path) in msg and "question" in msg and "id" in msg


def test_dataset_source_unknown_file_type(tmp_path, tiny):
    path = tmp_path / "p.xml"
    path.write_text("<x/>")
    with pytest.raises(ValueError, match="unsupported file type '.xml'"):
        load_prompts_from_source(
            PromptSourceConfig(kind="dataset", path=str(path)), tiny, progress=False
        )


# --- magpie --------------------------------------------------------------------------------


def test_magpie_prompts_are_filtered_unique_and_seeded(tiny):
    # The tiny model writes random characters: short prompts keep the token budget small.
    cfg = PromptSourceConfig(
        kind="magpie", num_prompts=10, min_chars=4, max_prompt_tokens=16, seed=3
    )
    got = load_prompts_from_source(cfg, tiny, progress=False)
    assert len(got) == 10
    assert len({dedup_key(p) for p in got}) == 10
    assert all(p == p.strip() and reject_reason(p, cfg, tiny.tokenizer) is None for p in got)
    assert load_prompts_from_source(cfg, tiny, progress=False) == got
    assert load_prompts_from_source(cfg.model_copy(update={"seed": 4}), tiny, progress=False) != got


@pytest.mark.parametrize("kind", [pytest.param("magpie", marks=pytest.mark.slow), "dataset"])
def test_a_longer_prompt_list_resumes_the_stream_where_a_shorter_one_stopped(tiny, data_cfg, kind):
    if kind == "magpie":  # 3 turns a round: 5 prompts end inside a round, which is written again
        cfg = PromptSourceConfig(
            kind="magpie", num_prompts=9, min_chars=4, max_prompt_tokens=16, seed=5
        )
    else:
        cfg = data_cfg.source.model_copy(update={"num_prompts": 9})
    kw = dict(
        progress=False, magpie_batch_size=3, magpie_max_rounds=80
    )  # a round cap no run reaches
    fresh = collect_prompts(cfg, tiny, **kw)
    short = collect_prompts(cfg.model_copy(update={"num_prompts": 5}), tiny, **kw)
    assert (
        len(fresh.prompts) == 9
        and short.prompts == fresh.prompts[:5]
        and short.consumed < fresh.consumed
    )
    # seed 5 stops the magpie list inside a round on AMX/AVX512 CPUs (the round is then written
    # again and its earlier turns skipped); where float32 numerics end it on a round boundary
    # (AVX2: 24 texts), the resume below is checked from there
    assert collect_prompts(cfg, tiny, **kw, start=short) == fresh
    smaller = cfg.model_copy(update={"num_prompts": 2})  # a longer list is cut, nothing collected
    assert collect_prompts(smaller, None, start=fresh).prompts == fresh.prompts[:2]
    with pytest.raises(ValueError, match="stream position"):
        collect_prompts(
            cfg, tiny, progress=False, start=cache.PromptList(short.prompts, consumed=None)
        )


def test_a_collection_saves_its_list_so_far_and_resumes_from_any_save(tiny, monkeypatch):
    """Every save is a valid start: one taken inside a magpie round resumes to the list a
    collection from scratch gives."""
    cfg = PromptSourceConfig(
        kind="magpie", num_prompts=9, min_chars=4, max_prompt_tokens=16, seed=5
    )
    kw = dict(progress=False, magpie_batch_size=3, magpie_max_rounds=80)
    fresh = collect_prompts(cfg, tiny, **kw)
    monkeypatch.setattr(sources_module, "SAVE_EVERY_S", 0.0)  # a save after every prompt
    saves: list[cache.PromptList] = []
    assert collect_prompts(cfg, tiny, **kw, save=saves.append) == fresh
    assert [got.prompts for got in saves] == [fresh.prompts[:n] for n in range(1, 10)]
    assert all(a.consumed < b.consumed for a, b in zip(saves, saves[1:], strict=False))
    for got in (saves[1], saves[4]):  # 2 and 5 prompts: 5 end inside a round of 3
        assert collect_prompts(cfg, tiny, **kw, start=got) == fresh


def test_a_run_killed_while_collecting_prompts_keeps_them_for_the_next(
    data_cfg, tiny, tmp_path, monkeypatch, caplog
):
    """A long magpie list takes ~40 minutes on 2 cores: a run killed meanwhile leaves the
    list so far in the cache, and the next run goes on from it."""
    data = data_cfg.model_copy(update={"cache_dir": str(tmp_path)})
    monkeypatch.setattr(sources_module, "SAVE_EVERY_S", 0.0)
    real = selfdistill.save_prompts

    class Killed(Exception):
        pass

    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        if len(cache.stored_prompts(data, tiny.fingerprint).prompts) == 3:
            raise Killed

    monkeypatch.setattr(selfdistill, "save_prompts", save_then_die)
    with pytest.raises(Killed):
        selfdistill._cached_prompts(data, tiny, TINY, progress=False)
    assert cache.stored_prompts(data, tiny.fingerprint) == cache.PromptList(PROMPTS[:3], 3)

    monkeypatch.setattr(selfdistill, "save_prompts", real)
    with caplog.at_level(logging.INFO, logger="draftlab.data.sources"):
        prompts, _ = selfdistill._cached_prompts(data, tiny, TINY, progress=False)
    assert prompts == PROMPTS and "(3 of them resumed from a shorter list)" in caplog.text
    assert cache.stored_prompts(data, tiny.fingerprint) == cache.PromptList(PROMPTS, len(PROMPTS))


def test_magpie_returns_what_it_has_when_rounds_run_out(tiny, caplog):
    cfg = PromptSourceConfig(kind="magpie", num_prompts=50, min_chars=4, max_prompt_tokens=16)
    with caplog.at_level(logging.WARNING, logger="draftlab.data.sources"):
        got = load_prompts_from_source(
            cfg, tiny, progress=False, magpie_batch_size=4, magpie_max_rounds=2
        )
    assert 0 < len(got) <= 8
    assert "only" in caplog.text


# --- self-distillation data ----------------------------------------------------------------


@pytest.mark.slow
def test_generated_columns_and_shapes(generated, tiny):
    assert set(generated) == {"train", "eval"}
    assert (generated["train"].num_rows, generated["eval"].num_rows) == (9, 3)
    feats = generated["train"].features
    assert feats["input_ids"].feature.dtype == "int32" and feats["prompt_len"].dtype == "int32"
    assert feats["hidden"] == datasets.Array2D(shape=(None, tiny.hidden_size), dtype="float16")
    for row in samples(generated):
        prompt_ids = tiny.encode_prompt(row["prompt"])
        assert row["prompt_len"] == len(prompt_ids)
        assert row["input_ids"][: row["prompt_len"]] == prompt_ids
        assert 1 <= len(row["input_ids"]) - row["prompt_len"] <= MAX_NEW
        assert np.asarray(row["hidden"]).shape == (len(row["input_ids"]), tiny.hidden_size)


@pytest.mark.slow
def test_responses_are_greedy_target_decoding(generated, tiny):
    """Every response token is the target's argmax given the text before it. Batched,
    left-padded HF `generate` and one-sequence decoding round differently, and this bf16
    target has exact ties ("List three prime numbers.": two tokens at 4.5625 after the
    first), so a token may also be within TIE of the best; most rows equal our decoding."""
    same = 0
    for row in samples(generated):
        ids, start = torch.tensor(row["input_ids"]), row["prompt_len"]
        logits, _ = tiny.forward(ids, torch.arange(len(ids)), tiny.new_cache())  # (T, V)
        step = logits[start - 1 : -1]  # (N, V): the logits each response token was chosen from
        gap = step.max(-1).values - step.gather(1, ids[start:, None])[:, 0]  # (N,)
        assert float(gap.max()) <= TIE, (row["prompt"], gap.tolist())
        ref = autoregressive_generate(
            tiny, row["input_ids"][:start], SamplingParams(max_new_tokens=MAX_NEW)
        )
        same += row["input_ids"][start:] == ref.tokens
    assert same >= len(samples(generated)) * 3 // 4


@pytest.mark.slow
def test_hidden_matches_target_forward(generated, tiny):
    for row in samples(generated)[:4]:
        ids = torch.tensor(row["input_ids"])
        _, hidden = tiny.forward(ids, torch.arange(len(ids)), tiny.new_cache())  # (T, H)
        torch.testing.assert_close(
            torch.tensor(np.asarray(row["hidden"]), dtype=torch.float32),
            hidden.float(),
            atol=1e-2,
            rtol=1e-2,
        )


@pytest.mark.slow
def test_split_is_deterministic_and_disjoint(generated):
    train, ev = set(generated["train"]["prompt"]), set(generated["eval"]["prompt"])
    assert not train & ev and train | ev == set(PROMPTS)
    assert (
        train_eval_split(generated["train"], 0.01, seed=0)["eval"].num_rows == 1
    )  # >= 1 when >= 2 rows
    assert train_eval_split(generated["train"].select([0]), 0.5, seed=0)["eval"].num_rows == 0


@pytest.mark.slow
def test_cache_is_reused_without_generation(generated, data_cfg, tiny, monkeypatch, caplog):
    root = cache_path(data_cfg, tiny.fingerprint)
    meta = root / "dataset" / "meta.json"
    stamp = meta.stat().st_mtime_ns
    assert json.loads(meta.read_text())["num_samples"] == 12

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached dataset should have been reused")

    monkeypatch.setattr(selfdistill, "_run_shards", no_generation)
    other_resources = data_cfg.model_copy(
        update={"batch_size": 1, "num_actors": 3, "shard_size": 5}
    )
    with caplog.at_level(logging.INFO, logger="draftlab.data.selfdistill"):
        again = load_or_generate(other_resources, TINY, progress=False)
    assert "reusing cached self-distillation data" in caplog.text
    assert meta.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (root / "work" / "shards").iterdir()) == [
        "shard-00000",
        "shard-00001",
        "shard-00002",
    ]
    assert samples(again) == samples(generated)


def test_cache_key_tracks_results_not_resources(data_cfg, tmp_path):
    key = dataset_key(data_cfg, "fp-a")
    assert dataset_key(data_cfg, "fp-b") != key
    for change in [
        {"max_new_tokens": 7},
        {"temperature": 0.5},
        {"top_p": 0.9},
        {"store_features": False},
        {"eval_fraction": 0.1},
        {"generator": "vllm"},
    ]:
        assert dataset_key(data_cfg.model_copy(update=change), "fp-a") != key, change
    source = data_cfg.source.model_copy(update={"num_prompts": 5})
    assert dataset_key(data_cfg.model_copy(update={"source": source}), "fp-a") != key
    for change in [
        {"batch_size": 3},
        {"num_actors": 4},
        {"shard_size": 2},
        {"use_gpu": True},
        {"cpus_per_actor": 2.0},
        {"prompt_generator": "vllm"},
    ]:  # this source's prompts are read, not written
        assert dataset_key(data_cfg.model_copy(update=change), "fp-a") == key, change
    moved = data_cfg.model_copy(update={"cache_dir": str(tmp_path)})
    assert cache_path(moved, "fp-a") == tmp_path / key


def test_a_mix_entrys_answer_length_keys_its_data_but_not_its_prompts(data_cfg):
    listed = data_cfg.source.model_dump(exclude={"num_prompts"})

    def mix(**own) -> DataConfig:
        return DataConfig(source=[listed | own, {}], num_prompts=6, max_new_tokens=8)

    assert mix().response_lengths == [8, 8] and mix(max_new_tokens=32).response_lengths == [32, 8]
    assert dataset_key(mix(max_new_tokens=32), "fp") != dataset_key(mix(), "fp")
    assert mix(max_new_tokens=32).sources == mix().sources  # the prompt lists are shared
    assert prompts_cache_file(mix(max_new_tokens=32), "fp", mix().sources[0]) == (
        prompts_cache_file(mix(), "fp", mix().sources[0])
    )
    assert "max_new_tokens" not in mix().model_dump()["source"][0]  # older keys stay valid


def test_a_missing_vllm_writer_is_a_config_error_before_any_work(data_cfg, tmp_path, monkeypatch):
    from draftlab import vllm_offline

    def not_installed():  # this environment has vLLM: the import failure is simulated
        raise ImportError("vLLM is not installed (No module named 'vllm'); install the vllm extra")

    monkeypatch.setattr(vllm_offline, "require_vllm", not_installed)
    data = data_cfg.model_copy(update={"generator": "vllm", "cache_dir": str(tmp_path)})
    with pytest.raises(
        ConfigError, match=r"data.generator=vllm: vLLM is not installed.*data.generator=hf"
    ):
        load_or_generate(data, TINY, progress=False)
    magpie = data_cfg.source.model_copy(update={"kind": "magpie"})
    prompts = data_cfg.model_copy(
        update={"prompt_generator": "vllm", "source": magpie, "cache_dir": str(tmp_path)}
    )
    with pytest.raises(
        ConfigError, match=r"data.prompt_generator=vllm: vLLM is not installed.*prompt_generator=hf"
    ):
        load_or_generate(prompts, TINY, progress=False)
    assert not (cache_path(data, "x").parent / "prompts").exists()  # nothing written


def test_auto_writes_grounded_magpie_prompts_with_the_responses_writer():
    def mix(**update) -> DataConfig:
        entries = [{"kind": "magpie"}, {"kind": "magpie", "documents": "python-docs"}]
        return DataConfig(source=entries, num_prompts=4, **update)

    plain, grounded = mix().sources
    for responses in ("hf", "vllm"):
        data = mix(generator=responses)
        assert (data.prompt_writer(plain), data.prompt_writer(grounded)) == ("hf", responses)
        assert cache.prompt_writers(data) == {"hf", responses}
        # an auto-written list is the list of the writer it resolves to
        for source, resolved in ((plain, "hf"), (grounded, responses)):
            explicit = mix(generator=responses, prompt_generator=resolved)
            assert prompts_cache_file(data, "fp", source) == (
                prompts_cache_file(explicit, "fp", source)
            )
    assert prompts_cache_file(mix(generator="vllm"), "fp", grounded) != (
        prompts_cache_file(mix(generator="hf"), "fp", grounded)
    )
    assert mix(generator="vllm", prompt_generator="hf").prompt_writer(grounded) == "hf"
    assert mix(prompt_generator="vllm").prompt_writer(plain) == "vllm"
    # plain magpie alone: auto keys its data as the former default, HF, did
    alone = DataConfig(source={"kind": "magpie", "num_prompts": 4}, generator="vllm")
    hf = alone.model_copy(update={"prompt_generator": "hf"})
    assert dataset_key(alone, "fp") == dataset_key(hf, "fp")


@pytest.mark.slow
def test_changed_settings_or_source_file_generate_anew(ray_local, data_cfg, tiny, tmp_path):
    copy = tmp_path / "prompts.jsonl"
    shutil.copy(data_cfg.source.path, copy)
    source = data_cfg.source.model_copy(update={"path": str(copy), "num_prompts": 4})
    data = data_cfg.model_copy(
        update={"source": source, "max_new_tokens": 5, "cache_dir": str(tmp_path / "c")}
    )
    old_key = dataset_key(data, tiny.fingerprint)
    dsd = load_or_generate(data, TINY, progress=False)
    root = cache_path(data, tiny.fingerprint)
    assert root.name == old_key and root != cache_path(data_cfg, tiny.fingerprint)
    assert (root / "dataset" / "meta.json").is_file() and not (
        root / "work"
    ).exists()  # shards dropped
    assert all(
        len(ids) - n <= 5
        for ids, n in zip(dsd["train"]["input_ids"], dsd["train"]["prompt_len"], strict=True)
    )
    write_jsonl(copy, [{"prompt": p} for p in reversed(PROMPTS)])  # edited in place
    assert dataset_key(data, tiny.fingerprint) != old_key


@pytest.mark.slow
def test_prompts_are_cached_apart_from_generation_settings(
    ray_local, data_cfg, tiny, tmp_path, monkeypatch
):
    from draftlab.data import sources

    data = data_cfg.model_copy(update={"max_new_tokens": 4, "cache_dir": str(tmp_path)})
    first = load_or_generate(data, TINY, progress=False)
    cached = prompts_cache_file(data, tiny.fingerprint)
    assert json.loads(cached.read_text()) == {"prompts": PROMPTS, "consumed": len(PROMPTS)}

    def no_source(*args, **kwargs):
        raise AssertionError("the cached prompt list should have been reused")

    monkeypatch.setattr(sources, "collect_prompts", no_source)
    longer = data.model_copy(update={"max_new_tokens": 6})  # a new dataset key, the same prompts
    assert prompts_cache_file(longer, tiny.fingerprint) == cached
    assert cache_path(longer, tiny.fingerprint) != cache_path(data, tiny.fingerprint)
    again = load_or_generate(longer, TINY, progress=False)
    assert samples(again) != samples(first)  # longer responses
    assert [r["prompt"] for r in samples(again)] == [r["prompt"] for r in samples(first)]
    other_source = data.source.model_copy(update={"seed": 4})
    assert (
        prompts_cache_file(data.model_copy(update={"source": other_source}), tiny.fingerprint)
        != cached
    )


@pytest.mark.slow
def test_a_larger_data_set_reuses_the_smaller_ones_shards(
    ray_local, generated, data_cfg, tiny, tmp_path, monkeypatch, caplog
):
    def sized(n):
        return data_cfg.model_copy(
            update={
                "source": data_cfg.source.model_copy(update={"num_prompts": n}),
                "cache_dir": str(tmp_path),
            }
        )

    load_or_generate(sized(8), TINY, progress=False)  # 2 shards of 4
    with caplog.at_level(logging.INFO, logger="draftlab.data"):
        grown = load_or_generate(sized(12), TINY, progress=False)
    assert "reused 2 of 3 shards to generate" in caplog.text
    meta = json.loads(
        (cache_path(sized(12), tiny.fingerprint) / "dataset" / "meta.json").read_text()
    )
    assert meta["reused_from"] == {"key": dataset_key(sized(8), tiny.fingerprint), "shards": 2}
    assert (
        json.loads(prompts_cache_file(sized(12), tiny.fingerprint).read_text())["prompts"]
        == PROMPTS
    )
    # the same samples as a generation from scratch (the `generated` fixture: 12 prompts)
    for split in ("train", "eval"):
        assert grown[split]["prompt"] == generated[split]["prompt"]
        assert grown[split]["input_ids"] == generated[split]["input_ids"]
        np.testing.assert_array_equal(
            np.concatenate(grown[split].with_format("numpy")["hidden"]),
            np.concatenate(generated[split].with_format("numpy")["hidden"]),
        )

    def no_generation(*args, **kwargs):
        raise AssertionError("every shard of a smaller set lies within a cached one")

    monkeypatch.setattr(selfdistill, "_run_shards", no_generation)
    shrunk = load_or_generate(
        sized(6), TINY, progress=False
    )  # from the 12-prompt set: 1 full shard, 1 half
    assert sorted(r["prompt"] for r in samples(shrunk)) == sorted(PROMPTS[:6])
    assert samples(shrunk) == [r for r in samples(generated) if r["prompt"] in PROMPTS[:6]]


def test_a_prompt_list_cached_before_lists_could_grow_serves_its_own_size(data_cfg, tmp_path):
    data = data_cfg.model_copy(update={"cache_dir": str(tmp_path)})
    old = (
        cache.cache_root(data)
        / "prompts"
        / f"{cache._digest(cache._prompt_inputs(data, data.source, 'fp'))}.json"
    )  # num_prompts in it
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps(PROMPTS))
    assert cache.stored_prompts(data, "fp") == cache.PromptList(PROMPTS, consumed=None)
    larger = data.model_copy(update={"source": data.source.model_copy(update={"num_prompts": 13})})
    assert (
        cache.stored_prompts(larger, "fp") is None
    )  # its key differs, and it could not be extended anyway


def test_sampled_responses_are_reused_only_from_shards_of_the_same_size(data_cfg, tmp_path):
    data = data_cfg.model_copy(update={"temperature": 0.8, "cache_dir": str(tmp_path)})
    small = data.model_copy(update={"source": data.source.model_copy(update={"num_prompts": 8})})
    donor = tmp_path / "donor" / "dataset"
    donor.mkdir(parents=True)
    meta = {"key": "donor", "inputs": key_inputs(small, "fp"), "num_prompts": 8, "shard_size": 4}
    (donor / "meta.json").write_text(json.dumps(meta))
    root = cache_path(data, "fp")
    assert cache._best_donor(root, data, "fp", shard_size=4)[0] == donor
    assert (
        cache._best_donor(root, data, "fp", shard_size=2) is None
    )  # prompt i samples by shard and place in it
    greedy = data.model_copy(update={"temperature": 0.0})
    assert cache._best_donor(root, greedy, "fp", shard_size=4) is None  # other key inputs


def test_a_cached_mix_is_no_donor_and_no_obstacle(data_cfg, tmp_path):
    """A mix's dataset in the cache (its source a list) is skipped when a single source looks
    for a donor, beside a donor of the same stream."""
    data = data_cfg.model_copy(update={"cache_dir": str(tmp_path)})
    small = data.model_copy(update={"source": data.source.model_copy(update={"num_prompts": 8})})
    one = data.source.model_dump(exclude={"num_prompts"}) | {"weight": 1}
    mix = type(data).model_validate(
        data.model_dump() | {"num_prompts": 8, "source": [one, one | {"seed": 1}]}
    )
    for name, d in [("mix", mix), ("donor", small)]:
        meta = {"key": name, "inputs": key_inputs(d, "fp"), "num_prompts": 8, "shard_size": 4}
        (tmp_path / name / "dataset").mkdir(parents=True)
        (tmp_path / name / "dataset" / "meta.json").write_text(json.dumps(meta))
    assert isinstance(key_inputs(mix, "fp")["source"], list)
    found = cache._best_donor(cache_path(data, "fp"), data, "fp", shard_size=4)
    assert found[0] == tmp_path / "donor" / "dataset"


@pytest.mark.slow
def test_resume_regenerates_only_missing_shards(generated, data_cfg, tiny, tmp_path, caplog):
    # A copy of the finished key dir, as a job killed after shards 0 and 2 would leave it.
    data = data_cfg.model_copy(update={"cache_dir": str(tmp_path)})
    root = cache_path(data, tiny.fingerprint)
    shutil.copytree(cache_path(data_cfg, tiny.fingerprint), root)
    shutil.rmtree(root / "dataset")
    work = root / "work"
    shutil.rmtree(shard_dir(work, 1))

    def stamps(i):
        return sorted(
            (p.name, p.stat().st_mtime_ns)
            for p in [shard_dir(work, i), *shard_dir(work, i).iterdir()]
        )

    kept = {i: stamps(i) for i in (0, 2)}
    with caplog.at_level(logging.INFO, logger="draftlab.data.selfdistill"):
        resumed = load_or_generate(
            data.model_copy(update={"shard_size": 6}), TINY, progress=False, keep_shards=True
        )
    assert "12 prompts in 3 shards, 1 to generate" in caplog.text  # recorded shard size wins
    assert {i: stamps(i) for i in (0, 2)} == kept
    assert shard_dir(work, 1).is_dir()
    for split in ("train", "eval"):
        assert resumed[split]["prompt"] == generated[split]["prompt"]
        assert resumed[split]["input_ids"] == generated[split]["input_ids"]
        np.testing.assert_array_equal(
            np.concatenate(resumed[split].with_format("numpy")["hidden"]),
            np.concatenate(generated[split].with_format("numpy")["hidden"]),
        )


def test_generation_spec_resolves_device_from_use_gpu():
    cpu_dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    assert generation_spec(TINY, use_gpu=False).model_dump() == {
        **TINY.model_dump(),
        "device": "cpu",
        "dtype": cpu_dtype,
    }
    assert generation_spec(TINY, use_gpu=True).model_dump() == {
        **TINY.model_dump(),
        "device": "cuda",
        "dtype": "bfloat16",
    }
    with pytest.raises(ValueError, match="use_gpu"):
        generation_spec(TINY.model_copy(update={"device": "cuda"}), use_gpu=False)


# --- a mix of sources ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_mix_takes_each_sources_share_interleaved_and_caches_each_list(
    ray_local, data_cfg, tiny, tmp_path, monkeypatch
):
    docs = write_jsonl(
        tmp_path / "docs.jsonl",
        [
            {"body": f"Report {i}. " + "The pumps ran all year and the reservoir stayed full. " * 6}
            for i in range(4)
        ],
    )
    grounded = MixSource(
        kind="magpie",
        documents=str(docs),
        document_field="body",
        document_tokens=64,
        max_prompt_tokens=8,
        min_chars=4,
        weight=1,
        max_new_tokens=7,  # its own answer length; the listed prompts take data.max_new_tokens
    )
    listed = MixSource(kind="dataset", path=data_cfg.source.path, weight=2)
    mix = DataConfig(
        source=[listed, grounded],
        num_prompts=9,
        max_new_tokens=4,
        shard_size=3,
        batch_size=4,
        eval_fraction=0.25,
        cache_dir=str(tmp_path),
    )
    assert [s.num_prompts for s in mix.sources] == [6, 3]
    dsd = load_or_generate(mix, TINY, progress=False, keep_shards=True)
    got = [r["prompt"] for r in list(dsd["train"]) + list(dsd["eval"])]
    assert len(got) == 9 and sorted(p for p in got if p in PROMPTS) == sorted(PROMPTS[:6])
    grounded_prompts = [p for p in got if p not in PROMPTS]
    assert all("The pumps ran all year" in p for p in grounded_prompts)
    answers = {
        r["prompt"]: len(r["input_ids"]) - r["prompt_len"]
        for r in list(dsd["train"]) + list(dsd["eval"])
    }
    assert max(answers[p] for p in got if p in PROMPTS) <= 4
    assert max(answers[p] for p in grounded_prompts) == 7
    plan = json.loads((cache_path(mix, tiny.fingerprint) / "work" / "prompts.json").read_text())
    order = ["grounded" if p not in PROMPTS else "listed" for p in plan["prompts"]]
    assert order == ["listed", "grounded", "listed"] * 3  # each shard of 3 holds both kinds
    assert plan["lengths"] == [4, 7, 4] * 3
    for source in mix.sources:  # each list cached on its own, as that source alone would be
        cached = json.loads(prompts_cache_file(mix, tiny.fingerprint, source).read_text())
        assert len(cached["prompts"]) == source.num_prompts
    with pytest.raises(ValueError, match="name the source"):
        prompts_cache_file(mix, tiny.fingerprint)

    def no_source(*args, **kwargs):
        raise AssertionError("the cached prompt lists should have been reused")

    monkeypatch.setattr(sources_module, "collect_prompts", no_source)
    longer = mix.model_copy(update={"max_new_tokens": 5})
    again = load_or_generate(longer, TINY, progress=False)
    assert sorted(r["prompt"] for r in list(again["train"]) + list(again["eval"])) == sorted(got)


@pytest.mark.slow
def test_chat_prompts_travel_to_the_generation_actors_and_back(ray_local, tiny, tmp_path):
    """Chats and texts in one mix: the actors get both (JSON rows: Arrow would not mix them)."""
    chats = MixSource(
        kind="dataset",
        path=str(write_jsonl(tmp_path / "chats.jsonl", SHAREGPT)),
        conversations="conversations",
        turns="chat",
    )
    texts = MixSource(kind="dataset", path=str(write_jsonl(tmp_path / "t.jsonl", OPENAI[:1])))
    texts = texts.model_copy(update={"field": None, "conversations": "messages"})
    data = DataConfig(
        source=[chats, texts],
        num_prompts=3,
        max_new_tokens=3,
        shard_size=2,
        batch_size=2,
        eval_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
    )
    rows = list(load_or_generate(data, TINY, progress=False)["train"])
    texts = [r for r in rows if not r["prompt"].startswith("[")]
    assert [r["prompt"] for r in texts] == ["Why is the sky blue?"]  # its first user turn
    chats = {
        tuple(m["content"] for m in json.loads(r["prompt"])): r for r in rows if r not in texts
    }
    assert set(chats) == {
        ("Be brief.", "Why is the sky blue?"),
        ("Hello!", "Name two planets with rings."),
    }
    for row in chats.values():
        assert row["input_ids"][: row["prompt_len"]] == tiny.encode_prompt(
            json.loads(row["prompt"])
        )
