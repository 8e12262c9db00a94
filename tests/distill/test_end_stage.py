"""The end stage in a fresh process (`BenchSpec.fresh_process`): the child prices the saved
drafter's training curve and sends it back; a child that fails is a clear error. The whole
stage (search, bench, tree.json) in a child runs in tests/distill/test_distill_ray.py."""

import json

import pytest

from draftlab.config import BenchSpec, DistillConfig, DrafterSpec, TargetSpec
from draftlab.distill.finalize import run_fresh
from draftlab.models.drafters.build import init_drafter


def test_a_failing_child_is_an_error_that_quotes_it(tmp_path):
    cfg = DistillConfig(
        target=TargetSpec(name="tiny-llama"),
        drafter=DrafterSpec(family="parallel", k=2, depth=1),
        bench=BenchSpec(enabled=False),
    )
    with pytest.raises(RuntimeError, match="the end stage's process failed") as err:
        run_fresh(cfg, tmp_path / "no-drafter", str(tmp_path / "no-data"), "cpu", [])
    assert "no-drafter" in str(err.value)


def test_the_child_prices_the_curve_of_the_saved_drafter(tiny, tmp_path):
    init_drafter("parallel", tiny, k=2, depth=1).save(tmp_path / "drafter")
    cfg = DistillConfig(
        target=TargetSpec(name="tiny-llama"),
        drafter=DrafterSpec(family="parallel", k=2, depth=1),
        bench=BenchSpec(enabled=False, search_context=16),
    )
    evaluations = [{"step": 4, "sim_accept_len": 1.5}]
    done = run_fresh(cfg, tmp_path / "drafter", str(tmp_path / "unused"), "cpu", evaluations)
    assert done["report"] is None  # bench off: the curve only
    curve = done["curve"]
    assert (
        curve["k"] == 2
        and curve["context"] == 16
        and min(curve["decode_ms"], curve["draft_ms"]) > 0
    )
    row = curve["evaluations"][0]
    assert row["predicted_speedup"] == pytest.approx(
        1.5 * curve["decode_ms"] / (curve["verify_chain_ms"] + curve["draft_ms"])
    )
    json.dumps(done)  # what came back through the result file
