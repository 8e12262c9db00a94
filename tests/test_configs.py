"""Every YAML config in the repo validates against its strict model, and errors name fields."""

import json
from pathlib import Path

import pytest
import yaml

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
    text = path.read_text()
    assert text.startswith(("# ray job submit", "# draftlab ")), (
        "first line must give the command that runs it"
    )
    assert path.name in text.splitlines()[0] or "--quick" in text.splitlines()[0]
    if "python " in text:
        script = text.split("python ", 1)[1].split()[0]
        assert (ROOT / script).is_file(), f"{path.name} runs {script}, which does not exist"
    if path.name.startswith("pipeline-") and "\ndistill:" in text:
        from draftlab.pipeline.compose import load_pipeline

        load_pipeline(path)
    else:
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
    f.write_text(
        "drafter: {family: parallel, k: 0}\ntrain: {lr: -1, epohcs: 3}\nscaling: "
        "{placement_strategy: RANDOM}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_yaml(DistillConfig, f)
    msg = str(e.value)
    assert "drafter.k: Input should be greater than or equal to 1" in msg
    assert "train.lr:" in msg and "train.epohcs: unknown key" in msg
    assert (
        "scaling.placement_strategy: Input should be 'PACK', 'SPREAD', 'STRICT_PACK' or "
        "'STRICT_SPREAD'" in msg
    )


def test_the_chain_of_the_final_bench_fits_the_drafter(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("drafter: {family: p-eagle, k: 2}\nbench: {chain_depth: 3}\n")
    with pytest.raises(ConfigError, match=r"bench.chain_depth=3 must lie in 1..drafter.k=2"):
        load_yaml(DistillConfig, f)
    f.write_text("drafter: {family: p-eagle, k: 2}\nbench: {chain_depth: spine}\n")
    with pytest.raises(ConfigError, match=r"bench.chain_depth"):
        load_yaml(DistillConfig, f)
    assert load_yaml(DistillConfig, f, {"bench.chain_depth": "tree"}).bench.chain_depth == "tree"


def test_streamed_features_are_not_cached(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("drafter: {family: p-eagle}\ntrain: {feature_stream: {actors: 2}}\n")
    cfg = load_yaml(DistillConfig, f)
    assert cfg.train.feature_stream.actors == 2 and not cfg.data.store_features
    assert cfg.data.aux_layers == "eagle3"  # the stream computes what the family fuses
    again = DistillConfig.model_validate(cfg.model_dump())  # the worker's payload round trip
    assert again == cfg
    with pytest.raises(ConfigError, match=r"data.store_features=true would cache them as well"):
        load_yaml(DistillConfig, f, {"data.store_features": "true"})
    with pytest.raises(ConfigError, match=r"train.feature_stream.buffer_mb"):
        load_yaml(DistillConfig, f, {"train.feature_stream.buffer_mb": "0"})

    from draftlab.distill.launch import check_feature_actors_fit

    two = load_yaml(DistillConfig, f, {"scaling.num_workers": "2", "scaling.cpus_per_worker": "2"})
    check_feature_actors_fit(two, {"CPU": 8.0})  # 2 x (2 + 2 x 1)
    with pytest.raises(ConfigError) as e:  # Ray Data would only warn, and the fit wait for ever
        check_feature_actors_fit(two, {"CPU": 6.0})
    assert "scaling.cpus_per_worker=2" in str(e.value) and "feature_stream.actors=2" in str(e.value)
    assert "8 CPUs where the Ray cluster has 6" in str(e.value)
    on_gpus = load_yaml(DistillConfig, f, {"train.feature_stream.gpus_per_actor": "1"})
    with pytest.raises(ConfigError, match="2 GPUs where the Ray cluster has 0"):
        check_feature_actors_fit(on_gpus, {"CPU": 8.0})


def _literal_fields(model, prefix=""):
    """(dotted field, allowed values) of every Literal field, nested sections included."""
    from typing import Literal, get_args, get_origin

    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        ann = field.annotation
        for tp in [ann, *get_args(ann)]:
            if get_origin(tp) is Literal:
                yield f"{prefix}{name}", get_args(tp), tp is not ann and get_origin(ann) is list
            elif isinstance(tp, type) and issubclass(tp, BaseModel):
                yield from _literal_fields(tp, f"{prefix}{name}.")


@pytest.mark.parametrize(
    "title,path", [(t, p) for t, p, _ in __import__("draftlab.docs").docs.MODELS]
)
def test_every_config_kind_names_file_field_and_allowed_values(tmp_path, title, path):
    """For each config model: an unknown key (top level and in each section) lists the
    allowed keys; every Literal field's bad value lists the allowed values; all name the file."""
    from pydantic import BaseModel

    from draftlab.config import apply_dotted
    from draftlab.docs import load_model

    model = load_model(path)
    required = {"name": "x", "distill": "d.yaml", "base": "b.yaml"}
    base = {
        k: v
        for k, v in required.items()
        if k in model.model_fields and model.model_fields[k].is_required()
    }
    sections = [
        n
        for n, f in model.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
    ]
    for where in ["", *(f"{s}." for s in sections)]:
        f = tmp_path / "c.yaml"
        f.write_text(
            yaml.safe_dump(apply_dotted(json.loads(json.dumps(base)), {f"{where}colour": "red"}))
        )
        with pytest.raises(ConfigError) as e:
            load_yaml(model, f)
        section = model if not where else model.model_fields[where[:-1]].annotation
        assert str(f) in str(e.value) and f"{where}colour: unknown key (allowed: " in str(
            e.value
        ), str(e.value)
        assert ", ".join(section.model_fields) in str(e.value)
    for dotted, allowed, in_list in _literal_fields(model):
        bad = ["no-such-value"] if in_list else "no-such-value"
        f = tmp_path / "c.yaml"
        f.write_text(yaml.safe_dump(apply_dotted(json.loads(json.dumps(base)), {dotted: bad})))
        with pytest.raises(ConfigError) as e:
            load_yaml(model, f)
        msg = str(e.value)
        assert str(f) in msg and f"{dotted}" in msg and all(repr(a) in msg for a in allowed), msg


# --- the catalogue: what is trained, swept and promoted is what is served -----------------


def _registrations() -> dict[str, set[str]]:
    """Registered drafter model -> the targets registering it, from every training config
    (distill and pipeline files in jobs/configs) and every sweep (its promotion), each loaded
    through its own loader and named by the library's `registered_name`."""
    from draftlab.distill.launch import registered_name
    from draftlab.pipeline.compose import load_pipeline
    from draftlab.sweep.space import load_sweep, trial_config

    trained: list[DistillConfig] = []
    for path in JOB_CONFIGS:
        if path.name.startswith("pipeline-") and "\ndistill:" in path.read_text():
            trained.append(load_pipeline(path).distill)
        elif model_for(path) is DistillConfig:
            trained.append(load_yaml(DistillConfig, path))
    for path in sorted((ROOT / "sweeps").glob("*.yaml")):
        trained.append(trial_config(load_sweep(path)[1], {}))
    out: dict[str, set[str]] = {}
    for cfg in trained:
        out.setdefault(registered_name(cfg), set()).add(cfg.target.name)
    return out


def _served_apps(tmp_path: Path) -> list[tuple[str, object]]:
    """(where, validated args) of every application of serving/*.yaml and of every infra
    manifest embedding a Serve config (RayService `serveConfigV2`), through `load_serve_config`."""
    from draftlab.serve.control import load_serve_config

    docs = [
        (p.relative_to(ROOT).as_posix(), yaml.safe_load(p.read_text()))
        for p in sorted((ROOT / "serving").glob("*.yaml"))
    ]
    for p in sorted((ROOT / "infra").rglob("*.yaml")):
        for d in yaml.safe_load_all(p.read_text()):
            if isinstance(d, dict) and "serveConfigV2" in (d.get("spec") or {}):
                docs.append(
                    (
                        f"{p.relative_to(ROOT).as_posix()}:serveConfigV2",
                        yaml.safe_load(d["spec"]["serveConfigV2"]),
                    )
                )
    apps = []
    for where, doc in docs:
        for i, app in enumerate(doc["applications"]):
            f = (
                tmp_path / f"app-{len(apps)}.yaml"
            )  # one application per file: the loader reads the first
            f.write_text(yaml.safe_dump({"applications": [app]}))
            apps.append((f"{where}: applications[{i}]", load_serve_config(f)["args"]))
    return apps


def test_catalogue_serves_what_it_trains(tmp_path):
    """Every served `models:/NAME@alias` (or the default for its target) is the model some
    training config or sweep registers, and an explicit serving target is the target that
    model was trained for (else the replica's fingerprint check fails)."""
    from draftlab.serve.pair import _parse_models_uri, default_model_uri

    registered = _registrations()
    for name, targets in registered.items():
        assert len(targets) == 1, f"{name} is registered for several targets: {sorted(targets)}"
    apps = _served_apps(tmp_path)
    assert any("rayservice" in where for where, _ in apps)
    problems = []
    for where, args in apps:
        if args.drafter is not None:
            continue  # an explicit drafter directory, not a catalogue entry
        name = _parse_models_uri(args.model_uri or default_model_uri(args))[0]
        if name not in registered:
            problems.append(
                f"{where}: {name} is registered by no config (registered: {sorted(registered)})"
            )
            continue
        (trained_for,) = registered[name]
        if (
            "target" in args.model_fields_set
            and "name" in args.target.model_fields_set
            and args.target.name != trained_for
        ):
            problems.append(
                f"{where}: target {args.target.name!r}, but {name} is trained for {trained_for!r}"
            )
    assert not problems, "\n".join(problems)
    # the pipelines' endpoints serve the target they distil
    from draftlab.pipeline.compose import load_pipeline

    for path in JOB_CONFIGS:
        if path.name.startswith("pipeline-") and "\ndistill:" in path.read_text():
            p = load_pipeline(path)
            served = p.serve_spec("models:/x@champion", "sqlite:///x.db")["args"]
            if "name" in served.target.model_fields_set:
                assert served.target.name == p.distill.target.name, path.name


def test_on_and_off_are_words_in_configs_and_overrides(tmp_path):
    """YAML 1.1 would read `on`/`off` as booleans, and `prompt_lookup=on` would fail with
    "Input should be 'tree', 'on' or 'off'"; boolean fields still take them."""
    from draftlab.config.base import parse_overrides
    from draftlab.serve.vllm_app import VllmServeArgs

    f = tmp_path / "args.yaml"
    f.write_text("drafter: init:p-eagle\nspeculation: off\nenforce_eager: yes\n")
    args = load_yaml(VllmServeArgs, f, parse_overrides(["prompt_lookup=on", "speculation=on"]))
    assert (args.prompt_lookup, args.speculation, args.enforce_eager) == ("on", "on", True)
    assert parse_overrides(["a=true", "b=False", "c=off"]) == {"a": True, "b": False, "c": "off"}
