"""A pipeline file resolved in one pass (`pipeline/compose.py`): the baseline, the sweep with
its trials' base and the Serve spec equal what the standalone loaders give for the same
files (`draftlab distill`, `draftlab sweep`, `draftlab serve -c`), nothing is read again at
run time, and a bad field or reference names the pipeline file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from draftlab.config import ConfigError, DistillConfig, apply_dotted, load_yaml
from draftlab.pipeline.compose import dotted, load_pipeline
from draftlab.serve.control import load_serve_config
from draftlab.sweep.space import load_sweep

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = [
    p
    for p in sorted((ROOT / "jobs/configs").glob("pipeline-*.yaml"))
    if "\ndistill:" in p.read_text()
]


def _named(path: Path, ref: str) -> Path:
    return (path.parent / ref).resolve()


def test_there_are_pipelines():
    assert len(PIPELINES) >= 2


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_one_pass_equals_the_standalone_loaders(path, tmp_path):
    p = load_pipeline(path)
    doc = yaml.safe_load(path.read_text())
    distill_file = _named(path, doc["distill"])
    overrides = dotted(doc.get("overrides", {}))
    # the baseline: `draftlab distill -c` of the distill file with the pipeline's overrides
    assert p.distill == load_yaml(
        DistillConfig,
        distill_file,
        overrides | {"name": f"{doc['name']}-baseline", "tracking.experiment": p.cfg.experiment},
    )
    # the sweep: `draftlab sweep -c` of the equivalent sweep file
    stage = dict(doc["sweep"])
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            stage
            | {
                "name": doc["name"],
                "base": str(distill_file),
                "experiment": p.cfg.experiment,
                "promote": False,
                "overrides": overrides | dotted(stage.get("overrides", {})),
            }
        )
    )
    sweep, base = load_sweep(sweep_file)
    assert p.sweep == sweep
    tracking = {
        **base.get("tracking", {}),
        "experiment": p.cfg.experiment,
        "parent_run_id": "run-1",
    }
    assert p.sweep_base("run-1") == base | {"tracking": tracking}
    # the endpoint: `draftlab serve -c` of the Serve file with the champion and the overrides
    serve_doc = yaml.safe_load(_named(path, doc["serve"]["config"]).read_text())
    app = serve_doc["applications"][0]
    app["args"] = apply_dotted(
        app.get("args") or {},
        {"model_uri": "models:/m@champion", "tracking_uri": "sqlite:///t.db"}
        | dotted(doc["serve"].get("overrides", {})),
    )
    serve_file = tmp_path / "serve.yaml"
    serve_file.write_text(yaml.safe_dump(serve_doc))
    expected = load_serve_config(serve_file) | {
        k: doc["serve"][k] for k in ("host", "port") if k in doc["serve"]
    }
    spec = p.serve_spec("models:/m@champion", "sqlite:///t.db")
    assert spec.keys() == expected.keys()
    assert {k: v for k, v in spec.items() if k != "args"} == {
        k: v for k, v in expected.items() if k != "args"
    }
    assert spec["args"].model_dump() == expected["args"].model_dump()


def test_the_files_are_read_once(tmp_path):
    """The stages' configs come from the load: the distill and Serve files may be gone by run
    time."""
    for name in ("pipeline-tiny-quick.yaml", "pipeline-tiny-distill.yaml"):
        shutil.copy(ROOT / "jobs/configs" / name, tmp_path / name)
    (tmp_path / "serving").mkdir()
    shutil.copy(ROOT / "serving/smollm2-135m.yaml", tmp_path / "serving/smollm2-135m.yaml")
    path = tmp_path / "pipeline-tiny-quick.yaml"
    path.write_text(path.read_text().replace("../../serving/", "serving/"))
    p = load_pipeline(path)
    base, spec = p.sweep_base("run-1"), p.serve_spec("models:/m@champion", "sqlite:///t.db")
    (tmp_path / "pipeline-tiny-distill.yaml").unlink()
    (tmp_path / "serving/smollm2-135m.yaml").unlink()
    assert p.sweep_base("run-1") == base and p.sweep_base("run-1") is not base
    assert p.serve_spec("models:/m@champion", "sqlite:///t.db") == spec
    assert (
        base["tracking"]["parent_run_id"] == "run-1"
        and p.sweep_base(None)["tracking"]["parent_run_id"] is None
    )


def test_references_resolve_from_the_pipeline_file_then_the_cwd(tmp_path, monkeypatch):
    doc = yaml.safe_load((ROOT / "jobs/configs/pipeline-tiny-quick.yaml").read_text())
    monkeypatch.chdir(ROOT)
    doc |= {
        "distill": "jobs/configs/pipeline-tiny-distill.yaml",
        "serve": {**doc["serve"], "config": "serving/smollm2-135m.yaml"},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = load_pipeline(path)  # neither is next to the pipeline file: found from the cwd
    assert p.sweep.base == str(ROOT / "jobs/configs/pipeline-tiny-distill.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_pipeline(path)
    assert (
        str(e.value) == f"{path}: distill: file not found: jobs/configs/pipeline-tiny-distill.yaml"
    )


def test_bad_pipeline_files_name_the_file_and_field(tmp_path):
    good = yaml.safe_load((ROOT / "jobs/configs/pipeline-tiny-quick.yaml").read_text())
    good["distill"] = str(ROOT / "jobs/configs/pipeline-tiny-distill.yaml")
    good["serve"]["config"] = str(ROOT / "serving/smollm2-135m.yaml")
    distill_file = good["distill"]
    cases = {
        "colour": ({"colour": "red"}, "colour: unknown key"),
        "distill": ({"distill": "nope.yaml"}, "distill: file not found: nope.yaml"),
        "override": (
            {"overrides": {"train": {"lr": -1}}},
            f"overrides (distill {distill_file}):\n  train.lr",
        ),
        "space": ({"sweep": {"space": {"target.name": ["x"]}}}, "space.target.name"),
        "space-value": (
            {"sweep": {"space": {"drafter.k": [0, 2]}}},
            f"sweep: space.drafter.k=0 (base {distill_file})",
        ),
        "sweep-override": (
            {"sweep": {"overrides": {"train.epochs": 0}}},
            f"sweep: overrides (base {distill_file})",
        ),
        "grid-range": (
            {"sweep": {"space": {"train.lr": {"uniform": [0.1, 0.2]}}}},
            "sweep: space.train.lr: grid search",
        ),
        "tree": ({"sweep": {"trees": ["bushy"]}}, "unknown tree 'bushy'"),
        "serve-config": (
            {"serve": {**good["serve"], "config": "nope-serve.yaml"}},
            "serve.config: file not found: nope-serve.yaml",
        ),
        "serve": (
            {"serve": {**good["serve"], "overrides": {"autoscaling.max_replicas": 0}}},
            "serve.overrides:\n  autoscaling.max_replicas",
        ),
    }
    for name, (change, expected) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(good | change))
        with pytest.raises(ConfigError) as e:
            load_pipeline(path)
        assert str(path) in str(e.value) and expected in str(e.value), (name, str(e.value))


def test_the_vllm_verdict_is_deployed_on_the_vllm_serve_config():
    """The compare stage's verdict (method, k, lookups, schedule, dtype) lands on
    `serve.vllm_config`'s args (VllmServeArgs) with the pipeline's serve overrides; without a
    verdict our engine's config is deployed; a bad verdict field names the config."""
    from draftlab.serve.vllm_app import VllmServeArgs

    p = load_pipeline(ROOT / "jobs/configs/pipeline-smollm2-135m-cpu.yaml")
    deploy = {
        "speculation": "on",
        "method": "ngram",
        "num_speculative_tokens": 4,
        "ngram_min": 2,
        "schedule": [[1, 8, 4], [9, 1024, 0]],
        "speculate_up_to": 8,
        "target.dtype": "float32",
        "enforce_eager": False,  # serve.vllm_overrides come last: the user's word wins
    }
    spec = p.serve_spec("models:/d@champion", "sqlite:///m.db", deploy)
    args = spec["args"]
    assert isinstance(args, VllmServeArgs) and spec["name"] == "draftlab-vllm"
    assert (args.method, args.schedule, args.target.dtype) == (
        "ngram",
        [(1, 8, 4), (9, 1024, 0)],
        "float32",
    )
    assert (
        args.model_uri == "models:/d@champion" and args.autoscaling.max_replicas == 1
    )  # serve.overrides
    assert args.enforce_eager  # serve.vllm_overrides: on the vLLM config alone
    assert args.speculate_up_to == 8
    one_engine = load_pipeline(
        ROOT / "jobs/configs/pipeline-smollm2-135m-cpu.yaml",
        {"serve.vllm_overrides.speculate_up_to": None},
    )
    assert one_engine.serve_spec("m", "sqlite:///m.db", deploy)["args"].speculate_up_to is None
    assert (
        type(p.serve_spec("models:/d@champion", "sqlite:///m.db")["args"]).__name__ == "ServeArgs"
    )
    # the compare stage measures vLLM in the environment it is served with (both cores here)
    assert p.compare_vllm("m", "sqlite:///m.db").env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    own = load_pipeline(
        ROOT / "jobs/configs/pipeline-smollm2-135m-cpu.yaml",
        {
            "serve.vllm_overrides.env": {"VLLM_CPU_OMP_THREADS_BIND": "0", "X": "1"},
            "compare.vllm.env": {"X": "2"},
        },
    )
    assert own.compare_vllm("m", "sqlite:///m.db").env == {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "X": "2",
    }  # the deployed environment, under the compare stage's own
    with pytest.raises(ConfigError, match=r"(?s)serve.vllm_overrides.*enforce_eagre: unknown key"):
        load_pipeline(
            ROOT / "jobs/configs/pipeline-smollm2-135m-cpu.yaml",
            {"serve.vllm_overrides.enforce_eagre": "true"},
        )
    with pytest.raises(ConfigError, match="schedule"):
        p.serve_spec("models:/d@champion", "sqlite:///m.db", deploy | {"schedule": [[2, 8, 3]]})
    tiny = load_pipeline(ROOT / "jobs/configs/pipeline-tiny-quick.yaml")  # compare.engine: draftlab
    assert tiny.serve_vllm is None
    with pytest.raises(ConfigError, match="compare.engine is draftlab"):
        tiny.serve_spec("models:/d@champion", "sqlite:///m.db", deploy)


def test_compare_engine_falls_back_to_ours_without_vllm_and_says_why(monkeypatch):
    from draftlab.pipeline import stages
    from draftlab.pipeline.config import CompareStage

    def missing():
        raise ImportError("No module named 'vllm'")

    assert stages.compare_engine(CompareStage(engine="draftlab")) == ("draftlab", [], None)
    monkeypatch.setattr(stages, "require_vllm", missing)
    engine, methods, note = stages.compare_engine(CompareStage())
    assert (engine, methods) == ("draftlab", []) and "vLLM is not installed" in note
    with pytest.raises(ConfigError, match="compare.engine: vllm: No module named 'vllm'"):
        stages.compare_engine(CompareStage(engine="vllm"))
    monkeypatch.setattr(stages, "require_vllm", lambda: "0.29.0")
    monkeypatch.setattr(
        stages, "require_arctic", lambda: (_ for _ in ()).throw(ImportError("no arctic"))
    )
    engine, methods, note = stages.compare_engine(CompareStage())
    assert engine == "vllm" and "vllm_suffix" not in methods and "vllm_draftlab" in methods
    assert note == "vllm_suffix left out: no arctic"
