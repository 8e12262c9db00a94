"""Hub prompt sources: `data_files` picks one file of a multi-file repo, and gated hub repos
need a Hugging Face token, checked by the job driver before any Ray work.

A local directory stands in for the hub repo: `datasets.load_dataset(DIR)` resolves a
directory without a loading config exactly like a hub repo without one (every data file
in it, one split). No hub is reachable here.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
import ray

from draftlab.cli import main
from draftlab.config import ConfigError, DataConfig, PromptSourceConfig, TargetSpec
from draftlab.data.cache import dataset_key
from draftlab.data.sources import load_prompts_from_source
from draftlab.submit import check_hub_access

ROOT = Path(__file__).resolve().parents[2]
SHAREGPT = "ShareGPT_V3_unfiltered_cleaned_split.json"


def _conversation(text: str) -> dict:
    return {
        "id": text[:8],
        "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "Sure."}],
    }


@pytest.fixture
def sharegpt_repo(tmp_path) -> Path:
    """A ShareGPT_Vicuna_unfiltered-like repo: the cleaned split beside another JSON dump."""
    repo = tmp_path / "ShareGPT_Vicuna_unfiltered"
    repo.mkdir()
    (repo / SHAREGPT).write_text(
        json.dumps([_conversation(f"Cleaned prompt number {i}, please answer.") for i in range(4)])
    )
    (repo / "ShareGPT_V3_unfiltered_raw.json").write_text(
        json.dumps([_conversation(f"Raw dump prompt {i}, unfiltered.") for i in range(4)])
    )
    return repo


def test_data_files_reads_only_the_named_file_of_the_repo(sharegpt_repo, tiny):
    base = {
        "kind": "dataset",
        "path": str(sharegpt_repo),
        "conversations": "conversations",
        "num_prompts": 100,
    }
    everything = load_prompts_from_source(PromptSourceConfig(**base), tiny, progress=False)
    assert any(p.startswith("Raw dump") for p in everything)  # without data_files: every JSON file
    cleaned = load_prompts_from_source(
        PromptSourceConfig(**base, data_files=SHAREGPT), tiny, progress=False
    )
    assert cleaned == [f"Cleaned prompt number {i}, please answer." for i in range(4)]
    # unset, the new fields stay out of the dumps, so existing data caches keep their keys
    src = PromptSourceConfig(**base)
    assert "data_files" not in src.model_dump(mode="json") and "gated" not in src.model_dump(
        mode="json"
    )
    assert dataset_key_of(src) != dataset_key_of(src.model_copy(update={"data_files": SHAREGPT}))
    with pytest.raises(ValueError, match="data_files picks files of a hub repo or directory"):
        load_prompts_from_source(
            PromptSourceConfig(
                **{**base, "path": str(sharegpt_repo / SHAREGPT)}, data_files=SHAREGPT
            ),
            tiny,
            progress=False,
        )


def test_the_8b_config_reads_the_cleaned_sharegpt_split():
    from draftlab.config import DistillConfig, load_yaml

    cfg = load_yaml(DistillConfig, ROOT / "jobs/configs/llama3-8b-parallel-k5-2x8gpu.yaml")
    assert cfg.data.source.data_files == SHAREGPT


def dataset_key_of(source: PromptSourceConfig) -> str:
    from draftlab.config import DataConfig

    return dataset_key(DataConfig(source=source), "fingerprint")


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """No Hugging Face token anywhere: environment or token file."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert huggingface_hub.get_token() is None


def test_gated_hub_repos_need_a_token(no_token, monkeypatch, tmp_path):
    with pytest.raises(ConfigError) as e:
        check_hub_access(TargetSpec(name="meta-llama/Llama-3.1-8B-Instruct"))
    msg = str(e.value)
    assert (
        "\n" not in msg
        and "target.name 'meta-llama/Llama-3.1-8B-Instruct'" in msg
        and "HF_TOKEN" in msg
    )
    check_hub_access(
        TargetSpec(name="meta-llama/Llama-3.1-8B-Instruct", gated=False)
    )  # said not gated
    check_hub_access(TargetSpec(name="Qwen/Qwen2.5-0.5B-Instruct"))  # not a gated org
    check_hub_access(TargetSpec(name="smollm2-135m"))  # a preset
    local = tmp_path / "meta-llama" / "Llama-3.1-8B-Instruct"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    check_hub_access(
        TargetSpec(name="meta-llama/Llama-3.1-8B-Instruct")
    )  # a local copy of that name
    gated = PromptSourceConfig(kind="dataset", path="org/private-prompts", gated=True)
    gated_data = DataConfig(source=gated)
    gated_mix = DataConfig(source=[{}, gated.model_dump(exclude={"num_prompts"})], num_prompts=8)
    for data in (gated_data, gated_mix):
        with pytest.raises(
            ConfigError, match="data.source.path 'org/private-prompts' is a gated hub repo"
        ):
            check_hub_access(TargetSpec(name="smollm2-135m"), data)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    check_hub_access(TargetSpec(name="meta-llama/Llama-3.1-8B-Instruct"), gated_data)


@pytest.mark.parametrize(
    "argv",
    [
        ["distill", "-c", "jobs/configs/llama3-8b-parallel-k5-2x8gpu.yaml"],
        ["sweep", "-c", "sweeps/llama3-8b-gpu.yaml"],
    ],
    ids=["distill", "sweep"],
)
def test_jobs_without_a_token_stop_before_any_ray_work(no_token, monkeypatch, capsys, argv):
    """The job drivers (`jobs/distill.py` and `sweeps/run.py` run these CLI paths) refuse the
    8B config in one line, before Ray starts or any data is read."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "'meta-llama/Llama-3.1-8B-Instruct' is a gated hub repo" in err
    )
    assert not ray.is_initialized()
