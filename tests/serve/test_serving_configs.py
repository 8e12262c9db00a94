"""Every Serve config in serving/ validates against ServeArgs and names an importable
builder; `draftlab serve` rejects bad files and flag mixes with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from draftlab.cli import main
from draftlab.config import ConfigError
from draftlab.serve.app import build_app, engine_options
from draftlab.serve.control import load_serve_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "serving").glob("*.yaml"))


def test_there_are_serving_configs():
    assert {p.name for p in CONFIGS} >= {"smollm2-135m.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serving_config_validates_and_builds(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# draftlab serve -c serving/"), "every YAML starts with the command that runs it"
    spec = load_serve_config(path)
    assert spec["builder"] is build_app
    app = build_app(spec["args"])  # builds the graph without Ray: nothing is deployed
    assert app is not None
    opts = engine_options(spec["args"])
    assert opts["autoscaling_config"]["max_replicas"] >= opts["autoscaling_config"]["min_replicas"]


@pytest.mark.parametrize("doc,msg", [
    ({"applications": []}, "applications"),
    ({"applications": [{"import_path": "nope"}]}, "module:builder"),
    ({"applications": [{"import_path": "draftlab.serve.app:missing"}]}, "not importable"),
    ({"applications": [{"import_path": "draftlab.serve.app:build_app", "args": {"engine": {"speculation": "always"}}}]},
     "engine.speculation"),
    ({"applications": [{"import_path": "draftlab.serve.app:build_app", "args": {"replicas": 3}}]}, "replicas"),
])
def test_bad_serving_configs_name_the_problem(tmp_path, doc, msg):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=msg) as e:
        load_serve_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("argv,msg", [
    (["serve", "--model-uri", "models:/x@champion", "--drafter", "init:parallel"], "not both"),
    (["serve", "-c", "serving/smollm2-135m.yaml", "--drafter", "d"], "not both"),
    (["serve", "--drafter", "init:parallel", "engine.max_active=0"], "engine.max_active"),
    (["loadtest", "--concurrency", "1,x"], "invalid literal"),
])
def test_serve_cli_errors_are_one_line(argv, msg, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_serve_names_a_missing_champion_before_deploying(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["serve", "--target", "tiny-llama", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert "models:/draftlab-tiny-llama-drafter@champion" in err and "not found" in err and "Traceback" not in err
    assert main(["serve", "--model-uri", "runs:/abc/drafter"]) == 2
    assert "expected models:/<name>@<alias>" in capsys.readouterr().err
