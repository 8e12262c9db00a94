"""Security defaults: safetensors only (no pickle from checkpoints, caches or targets),
`trust_remote_code` off unless asked per model, Ray's token auth never switched off,
credentials redacted from MLflow params, API keys from a file or the environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from draftlab.config import ConfigError, DistillConfig, ServeArgs, TargetSpec
from draftlab.models.target import load_target
from draftlab.tracking import REDACTED, prepare_params

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "platform" / "draftlab").rglob("*.py")) + sorted(
    (ROOT / "jobs").glob("*.py")
)
PICKLE_MODULES = {"pickle", "cPickle", "dill", "joblib", "cloudpickle", "shelve", "marshal"}


def _calls_and_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (("import", a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield "import", node.module.split(".")[0]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        ):
            yield "call", f"{node.func.value.id}.{node.func.attr}"


def test_no_pickle_anywhere_in_the_package():
    found = [
        (p.relative_to(ROOT), what)
        for p in SOURCES
        for kind, what in _calls_and_imports(p)
        if (kind == "import" and what in PICKLE_MODULES)
        or (kind == "call" and what in ("torch.load", "np.load"))
    ]
    assert found == []


def test_a_pickled_target_checkpoint_is_refused(tmp_path, tiny):
    import torch

    tiny.model.config.save_pretrained(tmp_path)  # a pickled checkpoint: pytorch_model.bin only
    torch.save(tiny.model.state_dict(), tmp_path / "pytorch_model.bin")
    tiny.tokenizer.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(OSError, match="could not load target"):
        load_target(TargetSpec(name=str(tmp_path)))


def test_a_drafter_dir_without_safetensors_is_refused(tmp_path, tiny):
    from draftlab.models.drafters.build import init_drafter, load_drafter

    drafter = init_drafter("parallel", tiny, k=2, depth=1)
    drafter.save(tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(FileNotFoundError, match="needs config.json and model.safetensors"):
        load_drafter(tmp_path / "d", tiny)


def test_remote_code_is_off_unless_enabled_per_model():
    assert TargetSpec().trust_remote_code is False
    for path in [
        *ROOT.glob("jobs/configs/*.yaml"),
        *ROOT.glob("serving/*.yaml"),
        *ROOT.glob("sweeps/*.yaml"),
    ]:
        assert "trust_remote_code: true" not in path.read_text().lower(), path


def test_ray_token_auth_is_never_switched_off():
    texts = [p.read_text() for p in SOURCES] + [
        p.read_text() for p in (ROOT / "infra").rglob("*") if p.is_file()
    ]
    for text in texts:
        assert "RAY_AUTH_MODE=disabled" not in text.replace('"', "").replace("'", "").replace(
            ": ", "="
        )
        assert "--disable-auth" not in text


def test_credentials_are_redacted_from_mlflow_params():
    params = prepare_params(
        {
            "serve": {"overrides": {"api_keys": ["sk-live-1"], "autoscaling.max_replicas": 2}},
            "tracking": {"aws_secret_access_key": "abc", "tracking_uri": "http://mlflow:5000"},
            "hfToken": "hf_123",
            "data": {"source": {"path": "prompts.jsonl"}},
        }
    )
    assert (
        params["serve.overrides.api_keys"] == REDACTED
        and params["tracking.aws_secret_access_key"] == REDACTED
    )
    assert params["hfToken"] == REDACTED
    assert (
        params["tracking.tracking_uri"] == "http://mlflow:5000"
        and params["data.source.path"] == "prompts.jsonl"
    )
    assert "sk-live-1" not in str(params) and "hf_123" not in str(params)


def test_api_keys_from_a_file_and_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# rotated 2026-11\nkey-a\n\n  key-b  \n")
    monkeypatch.setenv("DRAFTLAB_TEST_KEYS", "key-c, key-d")
    args = ServeArgs(api_keys=["key-0"], api_keys_env="DRAFTLAB_TEST_KEYS", api_keys_file=str(keys))
    assert (
        args.accepted_keys() == ["key-0", "key-c", "key-d", "key-a", "key-b"] and args.auth_enabled
    )
    missing = ServeArgs(api_keys_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="api_keys_file .* cannot be read"):
        missing.accepted_keys()
    assert not ServeArgs().auth_enabled


def test_secret_looking_fields_never_reach_a_shipped_config():
    """Shipped YAMLs reference secrets by env var or file, never inline."""
    for path in [*ROOT.glob("serving/*.yaml"), *ROOT.glob("jobs/configs/*.yaml")]:
        doc = yaml.safe_load(path.read_text())
        for app in doc.get("applications", []):
            assert not app.get("args", {}).get("api_keys"), path
    assert "api_keys" not in DistillConfig.model_fields
