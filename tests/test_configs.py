"""Every YAML config in the repo validates against its strict model, and errors name fields."""

from pathlib import Path

import pytest

from draftlab.config import BenchConfig, ConfigError, DistillConfig, load_yaml

ROOT = Path(__file__).resolve().parents[1]
JOB_CONFIGS = sorted((ROOT / "jobs" / "configs").glob("*.yaml"))


def model_for(path: Path):
    """bench-*.yaml are BenchConfigs; every other job config is a DistillConfig."""
    return BenchConfig if path.name.startswith("bench-") else DistillConfig


def test_there_are_configs():
    assert JOB_CONFIGS


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_job_config_validates_and_documents_its_command(path):
    assert path.read_text().startswith("# ray job submit"), "first line must give the command that runs it"
    script = path.read_text().split("python ", 1)[1].split()[0]
    assert (ROOT / script).is_file(), f"{path.name} runs {script}, which does not exist"
    load_yaml(model_for(path), path)


def test_unknown_and_invalid_fields_name_file_and_field(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("target: {name: tiny-llama, devcie: cpu}\nk: -1\ntemperature: hot\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(BenchConfig, f)
    msg = str(e.value)
    assert str(f) in msg
    assert "target.devcie: unknown key" in msg
    assert "k: Input should be greater than or equal to 1" in msg
    assert "temperature:" in msg


def test_overrides_and_missing_file(tmp_path):
    path = next(p for p in JOB_CONFIGS if p.name.startswith("bench-"))
    cfg = load_yaml(BenchConfig, path, {"max_new_tokens": 7, "target.device": "cpu"})
    assert cfg.max_new_tokens == 7 and cfg.target.device == "cpu"
    with pytest.raises(ConfigError, match="config file not found"):
        load_yaml(BenchConfig, tmp_path / "none.yaml")


def test_distill_config_errors_name_fields(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("drafter: {family: parallel, k: 0}\ntrain: {lr: -1, epohcs: 3}\nscaling: {placement_strategy: RANDOM}\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(DistillConfig, f)
    msg = str(e.value)
    assert "drafter.k: Input should be greater than or equal to 1" in msg
    assert "train.lr:" in msg and "train.epohcs: unknown key" in msg
    assert "scaling.placement_strategy: Input should be 'PACK', 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD'" in msg
