"""`draftlab.serve.vllm_app` without vLLM or Ray: what a replica hands vLLM (the MLflow champion
exported to vLLM's layout, an export as it is, target only) and args errors that name the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from draftlab.config import ConfigError, NgramSpec
from draftlab.export import vllm_target_dir
from draftlab.models.drafters.build import init_drafter
from draftlab.serve.vllm_app import VllmServeArgs, resolve_engine, vllm_drafter
from draftlab.vllm_scheduler import LOOKUP_KEY, SCHEDULER, engine_kwargs

TARGET = "tiny-llama-vllm"


@pytest.fixture(scope="module")
def target():
    from draftlab.models.target import load_target

    return load_target(TARGET)


def test_the_champion_is_exported_for_vllm(target, tmp_path):
    from mlflow import MlflowClient

    from draftlab.tracking import promote

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(
        client.create_experiment("vllm", artifact_location=str(tmp_path / "artifacts")),
        tags={"draftlab.target": TARGET},
    )
    client.log_artifacts(
        run.info.run_id, str(init_drafter("p-eagle", target, k=3).save(tmp_path / "d")), "drafter"
    )
    client.set_terminated(run.info.run_id)
    champ = promote(run.info.run_id, tracking_uri=uri)

    args = VllmServeArgs(
        target={"name": TARGET}, tracking_uri=uri, export_dir=str(tmp_path / "export")
    )
    model, engine, source = resolve_engine(
        args
    )  # models:/draftlab-tiny-llama-vllm-drafter@champion
    assert model == vllm_target_dir(TARGET) and source["version"] == champ["version"]
    assert engine["speculative_config"] == {
        "method": "eagle3",
        "model": str(tmp_path / "export"),
        "num_speculative_tokens": 3,
        "parallel_drafting": True,
    }  # K = its k
    # our scheduler, for per-request draft lengths (`draftlab_k`), without lookups
    assert (
        engine["scheduler_cls"] == SCHEDULER
        and engine["additional_config"][LOOKUP_KEY]["spec"] is None
    )
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]

    # an export (or any EAGLE-3 checkpoint) is served as it is; it has no draftlab k, so K is given
    assert vllm_drafter(
        str(tmp_path / "export"), args.target, args.model_copy(update={"num_speculative_tokens": 2})
    ) == (str(tmp_path / "export"), 2, None)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        vllm_drafter(str(tmp_path / "export"), args.target, args)
    # speculation off: the target alone, no registry lookup
    assert resolve_engine(
        VllmServeArgs(target={"name": TARGET}, speculation="off", tracking_uri="sqlite:///nowhere")
    ) == (vllm_target_dir(TARGET), {}, {"speculation": "off"})


def test_vllm_drafts_as_deep_as_the_tree_the_drafter_is_served_with(target, tmp_path):
    saved = init_drafter("p-eagle", target, k=4).save(tmp_path / "d")
    args = VllmServeArgs(target={"name": TARGET}, export_dir=str(tmp_path / "export"))
    assert vllm_drafter(str(saved), args.target, args)[1] == 4  # no tree.json: its K
    (saved / "tree.json").write_text(
        json.dumps({"paths": [[0], [1], [0, 0]], "ngram": {"tokens": 5}})
    )
    assert vllm_drafter(str(saved), args.target, args)[1] == 2  # the tree's depth
    (saved / "tree.json").write_text(
        json.dumps([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]])
    )
    assert vllm_drafter(str(saved), args.target, args)[1] == 4  # never deeper than K
    assert (
        vllm_drafter(
            str(saved), args.target, args.model_copy(update={"num_speculative_tokens": 3})
        )[1]
        == 3
    )


@pytest.mark.parametrize(
    "args,msg",
    [
        ({"speculation": "auto"}, "speculation"),
        ({"engine_kwargs": {"speculative_config": {}}}, "through `speculation`"),
        ({"engine_kwargs": {"scheduler_cls": "x.Y"}}, "through `prompt_lookup`"),
        ({"prompt_lookup": "yes"}, "prompt_lookup"),
        ({"target": {"name": "x", "device": "cuda"}}, "contradicts accelerator 'cpu'"),
        ({"tensor_parallel_size": 2}, "need accelerator: gpu"),
        ({"accelerator": "gpu", "accelerator_type": "H1OO"}, "not one of Ray's: A100"),
    ],
)
def test_bad_args_name_the_field(args, msg):
    with pytest.raises(ValidationError, match=msg):
        VllmServeArgs.model_validate(args)


def test_prompt_lookups_are_merged_where_the_served_tree_grafts_them(target, tmp_path):
    saved = init_drafter("p-eagle", target, k=4).save(tmp_path / "d")
    (saved / "tree.json").write_text(
        json.dumps({"paths": [[0], [0, 0]], "ngram": {"tokens": 3, "grow_to": 6}})
    )
    args = VllmServeArgs(
        target={"name": TARGET}, drafter=str(saved), export_dir=str(tmp_path / "export")
    )
    lookups = NgramSpec(tokens=3, grow_to=6)
    assert vllm_drafter(str(saved), args.target, args)[1:] == (
        2,
        lookups,
    )  # the tree's depth and its lookups
    _, engine, _ = resolve_engine(args)
    # copies of the tree's `tokens` that do not grow in vLLM (every step is sized for the longest
    # chain)
    assert engine["scheduler_cls"] == SCHEDULER and engine["additional_config"][LOOKUP_KEY] == {
        "spec": NgramSpec(tokens=3, grow_to=3).model_dump(),
        "draft_tokens": 2,
    }
    # vLLM drafts as many tokens as the longer chain; the drafter's first 2 are kept where
    # nothing matches
    assert engine["speculative_config"]["num_speculative_tokens"] == 3
    assert (
        engine["speculative_config"]["draft_sample_method"] == "greedy"
    )  # lossless for copied drafts
    # a drafter deeper than the copies sets the step's size
    deep = engine_kwargs(NgramSpec(tokens=3), engine["speculative_config"], 4)
    assert deep["speculative_config"]["num_speculative_tokens"] == 4
    off = resolve_engine(args.model_copy(update={"prompt_lookup": "off"}))[1]
    assert (
        off["additional_config"][LOOKUP_KEY]["spec"] is None
        and off["speculative_config"]["num_speculative_tokens"] == 2
    )
    (saved / "tree.json").write_text(json.dumps({"paths": [[0], [0, 0]]}))  # a tree without lookups
    assert vllm_drafter(str(saved), args.target, args)[2] is None
    on = args.model_copy(update={"prompt_lookup": "on"})
    assert vllm_drafter(str(saved), args.target, on)[2] == NgramSpec()  # the defaults


def test_vllms_own_drafting_is_deployed_without_a_drafter_and_with_a_schedule(tmp_path):
    """`method: ngram|suffix` (what the pipeline deploys when one of them won): no MLflow, no
    drafter; the batch-size schedule lands in vLLM's speculative config."""
    sched = [(1, 2, 4), (3, 1024, 0)]
    args = VllmServeArgs(
        target={"name": TARGET},
        method="ngram",
        ngram_min=1,
        ngram_max=3,
        schedule=sched,
        tracking_uri="sqlite:////nonexistent/never-read.db",
    )
    model, engine, source = resolve_engine(args)
    assert model == vllm_target_dir(TARGET) and source == {"method": "ngram"}
    assert engine["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "num_speculative_tokens_per_batch_size": sched,
    }
    assert engine["scheduler_cls"] == SCHEDULER  # `draftlab_k` per request works here too
    suffix = resolve_engine(
        args.model_copy(
            update={"method": "suffix", "num_speculative_tokens": None, "schedule": None}
        )
    )[1]
    assert suffix["speculative_config"]["method"] == "suffix"
    assert suffix["speculative_config"]["suffix_decoding_max_cached_requests"] == 0
    assert "num_speculative_tokens" not in suffix["speculative_config"]  # vLLM's own default depth


@pytest.mark.parametrize(
    "schedule", [[(2, 8, 3)], [(1, 4, 3), (4, 8, 0)], [(1, 4, -1)], [(1, 0, 2)]]
)
def test_a_bad_schedule_is_refused(schedule):
    with pytest.raises(ValidationError, match="ranges must start at batch size 1"):
        VllmServeArgs(schedule=schedule)


def test_suffix_drafting_is_scheduled_by_draftlabs_scheduler():
    """vLLM 0.29's suffix proposer asserts every step drafts its k, so vLLM's schedule would fail
    it: the schedule goes to draftlab's scheduler instead (tests/test_vllm_bench.py runs it)."""
    sched = [(1, 8, 24), (9, 64, 0)]
    args = VllmServeArgs(
        target={"name": TARGET},
        method="suffix",
        schedule=sched,
        tracking_uri="sqlite:////nonexistent/never-read.db",
    )
    engine = resolve_engine(args)[1]
    assert "num_speculative_tokens_per_batch_size" not in engine["speculative_config"]
    assert (
        engine["additional_config"][LOOKUP_KEY]["schedule"] == sched
        and engine["scheduler_cls"] == SCHEDULER
    )
