"""Sweep definitions: strict validation against the base config, Tune spaces, training keys."""

import re
from pathlib import Path

import pytest
import yaml
from ray import tune

from draftlab.config import ConfigError, read_mapping
from draftlab.sweep.space import (
    load_sweep,
    max_concurrency,
    param_space,
    sweep_base,
    training_key,
    trial_config,
)

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, **doc) -> Path:
    doc = {"name": "t", "base": str(ROOT / "jobs/configs/smollm2-135m-parallel-k4.yaml"), **doc}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweeps_validate(path):
    sweep, base = load_sweep(path)
    assert path.read_text().startswith("# draftlab sweep -c sweeps/")
    if (
        path.name == "smollm2-135m-cpu.yaml"
    ):  # the embedded default: >= 8 trained configs x >= 4 trees
        trained = 1
        for dim in sweep.space.values():
            trained *= len(dim)
        assert trained >= 8 and len(sweep.trees) >= 4


@pytest.mark.parametrize(
    ("doc", "msg"),
    [
        ({"space": {"drafter.kk": [2, 3]}}, "drafter.kk"),
        (
            {"space": {"drafter.family": ["medusa"]}},
            "unknown drafter family 'medusa' (allowed: autoregressive, p-eagle, parallel)",
        ),
        ({"space": {"train.lr": {"loguniform": [1e-4, 1e-3]}}}, "grid search needs a list"),
        ({"space": {"train.lr": {"normal": [0, 1]}}}, "uniform"),
        ({"space": {"drafter.k": []}}, "empty"),
        ({"trees": ["bushy-99"]}, "unknown tree 'bushy-99'"),
        ({"trees": ["bushy-99@4+ngram"]}, "unknown tree 'bushy-99@4+ngram'"),
        ({"trees": ["chain-4@2"]}, "@n needs n >= 1 and a tree that is not a chain"),
        ({"search": {"algorithm": "bayes"}}, "'grid', 'random' or 'optuna'"),
        ({"overrides": {"train.epochs": 0}}, "train.epochs"),
        ({"colour": "blue"}, "colour: unknown key"),
        ({"space": {"data.max_new_tokens": [64, 96]}}, "trials share one target, dataset"),
        ({"asha": {"reduction_factor": 1}}, "asha.reduction_factor"),
        (
            {"objective": "vllm", "trees": ["chain", "searched-4"]},
            "objective vllm measures chains only",
        ),
        ({"objective": "sglang"}, "objective"),
    ],
)
def test_bad_sweeps_name_the_file_and_field(tmp_path, doc, msg):
    path = _write(tmp_path, **doc)
    with pytest.raises(ConfigError, match="sweep.yaml") as err:
        load_sweep(path)
    assert msg in str(err.value)


def test_a_tree_may_verify_part_of_itself_per_round(tmp_path):
    sweep, _ = load_sweep(_write(tmp_path, trees=["searched-16@8+ngram", "wide-16@6"]))
    assert sweep.trees == ["searched-16@8+ngram", "wide-16@6"]


def test_tune_space_grid_and_random(tmp_path):
    grid, _ = load_sweep(
        _write(tmp_path, space={"drafter.k": [2, 4]}, trees=["chain", "searched-8"])
    )
    assert param_space(grid) == {
        "drafter.k": tune.grid_search([2, 4]),
        "tree": tune.grid_search(["chain", "searched-8"]),
    }
    rnd, _ = load_sweep(
        _write(
            tmp_path,
            space={"train.lr": {"loguniform": [1e-4, 1e-2]}},
            search={"algorithm": "random", "num_samples": 4},
        )
    )
    lr = param_space(rnd)["train.lr"]
    assert isinstance(lr, tune.search.sample.Float) and lr.lower == 1e-4 and lr.upper == 1e-2


def test_the_base_is_composed_from_the_document_read_once(tmp_path):
    """`sweep_base` (what `draftlab sweep` and a pipeline's sweep compose through) takes the
    base file's mapping and leaves it as it was: a pipeline reads its distill file once."""
    path = _write(tmp_path, overrides={"train.lr": 0.01}, space={"drafter.k": [2, 4]})
    sweep, base = load_sweep(path)
    doc = read_mapping(sweep.base)
    before = yaml.safe_load(yaml.safe_dump(doc))
    assert sweep_base(sweep, doc, Path(sweep.base), str(path)) == base and doc == before
    assert base["train"]["lr"] == 0.01 != doc["train"].get("lr")
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}: space.drafter.k=0 (base {sweep.base}):")
    ):
        sweep_base(
            sweep.model_copy(update={"space": {"drafter.k": [0]}}), doc, Path(sweep.base), str(path)
        )


def test_training_key_ignores_tree_bench_and_names(tmp_path):
    _, base = load_sweep(_write(tmp_path))
    a = trial_config(base, {"drafter.k": 3}, name="trial-a")
    b = trial_config(
        base, {"drafter.k": 3, "bench.tree": "small-6", "bench.limit": 2}, name="trial-b"
    )
    assert training_key(a) == training_key(b)  # same drafter: train once, evaluate many
    assert training_key(trial_config(base, {"drafter.k": 4})) != training_key(a)
    assert training_key(trial_config(base, {"drafter.k": 3, "train.lr": 5e-4})) != training_key(a)
    # how verification attends and how batches are prefetched do not change the weights
    same = trial_config(base, {"drafter.k": 3, "target.attention": "fused", "train.prefetch": 0})
    assert training_key(same) == training_key(a)


def test_max_concurrency_from_resources():
    assert max_concurrency({"CPU": 2.0}, cpus_per_trial=2) == 1
    assert max_concurrency({"CPU": 16.0, "GPU": 2.0}, cpus_per_trial=2, gpus_per_trial=1) == 2
    assert max_concurrency({"CPU": 1.0}, cpus_per_trial=4) == 1  # never zero


def test_search_setup_grid_random_optuna(tmp_path):
    from ray.tune.search.optuna import OptunaSearch

    from draftlab.sweep.runner import search_setup

    grid, _ = load_sweep(_write(tmp_path, space={"drafter.k": [2, 4]}))
    assert search_setup(grid, concurrency=4) == (None, 1)
    rnd, _ = load_sweep(
        _write(tmp_path, space={"drafter.k": [2, 4]}, search={"algorithm": "random"})
    )
    assert search_setup(rnd, concurrency=8) == (
        None,
        16,
    )  # num_samples unset: two waves of the cluster
    opt, _ = load_sweep(
        _write(
            tmp_path,
            space={"drafter.k": [2, 4], "train.lr": {"loguniform": [1e-4, 1e-2]}},
            trees=["chain", "searched-8"],
            search={"algorithm": "optuna", "num_samples": 3},
        )
    )
    alg, n = search_setup(opt, concurrency=1)
    assert isinstance(alg, OptunaSearch) and n == 3
    assert alg.set_search_properties(
        None, None, param_space(opt)
    )  # Tune's space converts to Optuna's
    suggested = alg.suggest("trial-1")
    assert suggested["drafter.k"] in (2, 4) and 1e-4 <= suggested["train.lr"] <= 1e-2
    assert suggested["tree"] in ("chain", "searched-8")


def test_speeds_within_the_tie_go_to_the_higher_tau():
    """A 1-minute trial once measured 4% faster than the 4-minute baseline, with less tau:
    within sweep.tie that is a short bench's noise and the higher tau wins; beyond it, speed."""
    from draftlab.sweep.runner import fastest

    baseline = {"source": "baseline", "speedup_vs_ar": 1.420, "tau": 1.607}
    trial = {"source": "sweep", "speedup_vs_ar": 1.473, "tau": 1.591}
    assert fastest([baseline, trial], 0.05) is baseline
    assert fastest([baseline, trial], 0.0) is trial
    assert fastest([baseline, trial | {"speedup_vs_ar": 1.55}], 0.05)["source"] == "sweep"
    assert fastest([baseline | {"speedup_vs_ar": None}, trial], 0.05) is trial


def test_a_challenger_replaces_the_incumbent_only_past_the_tie():
    """The README pipeline once promoted its sweep's 1-minute depth-2 trial (a 4-node tree, tau
    1.71) over the 4-minute baseline (1 node + lookups, tau 1.60) that measured faster, 1.480x
    against 1.453x ar: on the higher tau within the tie. In vLLM the baseline then ran 1.11x
    target-only alone, the promoted trial 1.04x. At promotion no tau decides."""
    from draftlab.sweep.runner import champion

    baseline = {"source": "baseline", "speedup_vs_ar": 1.480, "tau": 1.60}
    trial = {"source": "sweep", "speedup_vs_ar": 1.453, "tau": 1.71}
    assert champion(baseline, trial, 0.05) is baseline
    assert champion(baseline, trial | {"speedup_vs_ar": 1.54}, 0.05) is baseline  # within 5%
    assert champion(baseline, trial | {"speedup_vs_ar": 1.56}, 0.05)["source"] == "sweep"
    assert champion(baseline, trial | {"speedup_vs_ar": 1.49}, 0.0)["source"] == "sweep"
    assert champion(baseline | {"speedup_vs_ar": None}, trial, 0.05) is trial
    assert champion(baseline, trial | {"speedup_vs_ar": None}, 0.05) is baseline


def test_unfinished_trials_say_why_an_asha_stop_from_an_interruption(tmp_path):
    """ASHA stops only trials that reported a training step; a sweep stopped (Ctrl-C) before a
    trial's first report leaves it `interrupted`, not `stopped (ASHA)`."""
    from draftlab.sweep.runner import summarise

    sweep, _ = load_sweep(_write(tmp_path, space={"train.lr": [1e-3, 3e-3, 1e-2]}))
    grid = [
        tune.Result(metrics=m, checkpoint=None, error=e, path=str(tmp_path / name))
        for name, m, e in (
            ("asha", {"trial_id": "a", "step": 8, "eval/sim_accept_len": 1.1}, None),
            ("ctrl-c", {}, None),
            ("failed", {"trial_id": "f"}, RuntimeError("boom")),
        )
    ]
    summary = summarise(grid, sweep, tmp_path / "results")
    assert summary["trials_done"] == 0
    assert [(o["trial"], o["status"]) for o in summary["not_finished"]] == [
        ("a", "stopped (ASHA)"),
        ("ctrl-c", "interrupted"),
        ("f", "error"),
    ]
