"""Every Serve config in serving/ names an importable typed builder and validates against its
args model (`ServeArgs`, or `VllmServeArgs` for `*-vllm.yaml`); `draftlab serve` rejects bad
files and flag mixes with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from draftlab.cli import main
from draftlab.config import ConfigError
from draftlab.serve.app import build_app, engine_options
from draftlab.serve.control import load_serve_config
from draftlab.serve.vllm_app import build_vllm_app

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "serving").glob("*.yaml"))
VLLM = "draftlab.serve.vllm_app:build_vllm_app"


def test_there_are_serving_configs():
    assert {p.name for p in CONFIGS} >= {"smollm2-135m.yaml"}


def test_there_are_serving_configs_for_both_engines():
    assert {p.name for p in CONFIGS} >= {"smollm2-135m-vllm.yaml", "llama3-8b-vllm.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serving_config_validates_and_builds(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# draftlab serve -c serving/{path.name}"), (
        "every YAML starts with the command that runs it"
    )
    spec = load_serve_config(path)
    if spec["builder"] is build_vllm_app:
        pytest.importorskip("vllm", reason="Ray Serve LLM imports vLLM")
        from draftlab.serve.vllm_app import llm_config

        assert path.stem.endswith("-vllm")
        cfg = llm_config(
            spec["args"]
        )  # Ray Serve LLM's own validation (building the app would start Ray)
        auto = cfg.deployment_config["autoscaling_config"]
        bundles = cfg.get_engine_config().placement_bundles
        assert all(("GPU" in b) == (spec["args"].accelerator == "gpu") for b in bundles)
    else:
        assert spec["builder"] is build_app
        from ray import serve

        app = build_app(spec["args"])  # builds the graph without Ray: nothing is deployed
        assert isinstance(app, serve.Application), type(
            app
        )  # what `serve.run` / a Serve config deploys
        auto = engine_options(spec["args"])["autoscaling_config"]
    assert auto["max_replicas"] >= auto["min_replicas"]


@pytest.mark.parametrize(
    "doc,msg",
    [
        ({"applications": []}, "applications"),
        ({"applications": [{"import_path": "nope"}]}, "module:builder"),
        ({"applications": [{"import_path": "draftlab.serve.app:missing"}]}, "not importable"),
        (
            {
                "applications": [
                    {
                        "import_path": "draftlab.serve.app:build_app",
                        "args": {"engine": {"speculation": "always"}},
                    }
                ]
            },
            "engine.speculation",
        ),
        (
            {
                "applications": [
                    {"import_path": "draftlab.serve.app:build_app", "args": {"replicas": 3}}
                ]
            },
            "replicas",
        ),
        ({"applications": [{"import_path": VLLM, "args": {"speculation": "auto"}}]}, "speculation"),
        (
            {"applications": [{"import_path": VLLM, "args": {"engine_kwargs": {"dtype": "half"}}}]},
            "through `target.dtype`",
        ),
        (
            {"applications": [{"import_path": VLLM, "args": {"accelerator_type": "H100"}}]},
            "accelerator: gpu",
        ),
        (
            {
                "applications": [
                    {
                        "import_path": VLLM,
                        "args": {"accelerator": "gpu", "accelerator_type": "H1OO"},
                    }
                ]
            },
            "not one of Ray's",
        ),
    ],
)
def test_bad_serving_configs_name_the_problem(tmp_path, doc, msg):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=msg) as e:
        load_serve_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["serve", "--model-uri", "models:/x@champion", "--drafter", "init:parallel"], "not both"),
        (["serve", "-c", "serving/smollm2-135m.yaml", "--drafter", "d"], "not both"),
        (["serve", "--drafter", "init:parallel", "engine.max_active=0"], "engine.max_active"),
        (
            ["loadtest", "--concurrency", "1,x"],
            "--concurrency: expected a comma list of integers, got '1,x'",
        ),
        (
            ["serve", "--engine", "vllm", "--drafter", "d", "--tree", "small-6"],
            "--tree needs --engine draftlab",
        ),
        (["serve", "--engine", "vllm", "--drafter", "d", "--speculation", "auto"], "speculation"),
        (
            ["serve", "-c", "serving/smollm2-135m.yaml", "--engine", "vllm"],
            "serves with --engine draftlab",
        ),
    ],
)
def test_serve_cli_errors_are_one_line(argv, msg, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    try:
        code = main(argv)
    except SystemExit as e:  # a malformed option value: argparse's usage line and error, exit 2
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_serve_names_a_missing_champion_before_deploying(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["serve", "--target", "tiny-llama", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert (
        "models:/draftlab-tiny-llama-drafter@champion" in err
        and "not found" in err
        and "Traceback" not in err
    )
    assert main(["serve", "--model-uri", "runs:/abc/drafter"]) == 2
    assert "expected models:/<name>@<alias>" in capsys.readouterr().err
