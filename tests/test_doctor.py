"""`draftlab doctor` on the CPU with tiny shapes: what CI can run of the GPU check.

The CUDA side (real shapes, cuDNN/flash kernels) runs only on a GPU machine; here every
check runs on a random-weight `tiny` Llama and its JSON lines are read back.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftlab.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor") / "doctor.jsonl"
    assert main(["doctor", "--device", "cpu", "--new-tokens", "24", "--json", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _by_check(lines: list[dict], name: str) -> list[dict]:
    return [line for line in lines if line["check"] == name]


def test_every_check_reports_and_none_fails(lines):
    assert [line["check"] for line in lines if "error" in line] == []
    assert {line["check"] for line in lines} == {
        "env",
        "identity",
        "verify",
        "decode",
        "profile",
        "search",
        "train",
    }
    assert _by_check(lines, "env")[0]["memory_gb_per_s"] > 0


def test_float32_identity_holds_for_every_attention_and_tree(lines):
    """CPU float32: row-exact and fused verification reproduce greedy decoding (a drafter
    replaying decoding's own output has every draft accepted), and HF `generate` agrees."""
    float32 = [line for line in _by_check(lines, "identity") if line["dtype"] == "float32"]
    assert {(line["attention"], line["method"]) for line in float32} == {
        (a, m)
        for a in ("fused", "row-exact")
        for m in ("hf_generate", "chain-4", "default", "wide-16")
    }
    for line in float32:
        assert line["identical"] == "4/4" and line["mismatches"] == [], line
        if line["method"] != "hf_generate":
            assert line["tau"] > 4.0, line  # 4 drafts + the bonus, nearly every round


def test_mismatches_carry_the_targets_margins(lines):
    """Where an output leaves decoding's (bf16 ties on some CPUs), the line says where and
    with what top-2 gap; the gap is never negative and no wider than the margin allows."""
    for line in _by_check(lines, "identity"):
        for m in line["mismatches"]:
            assert {"prompt", "position", "tokens"} <= set(m)
            if "top2_gap" in m:
                assert 0.0 <= m["top2_gap"] and m["margin"] >= 0.0


def test_speed_checks_report_costs_against_one_forward(lines):
    verify = _by_check(lines, "verify")[0]
    assert verify["ratio"]["1"] == 1.0 and set(verify["ms"]) == {
        "1",
        "2",
        "4",
        "8",
        "16",
        "32",
        "64",
    }
    decode = _by_check(lines, "decode")[0]
    for key in (
        "ours_ms_per_token",
        "hf_generate_ms_per_token",
        "forward_ms",
        "bandwidth_floor_ms",
    ):
        assert decode[key] > 0, key
    for spec in (
        "chain-4",
        "wide-16",
    ):  # every replayed draft is right: 4 drafts + the bonus most rounds
        assert decode[f"replay_{spec}"]["identical"] and decode[f"replay_{spec}"]["tau"] > 4.0, spec
    assert _by_check(lines, "train")[0]["response_tokens_per_s"] > 0


def test_search_prices_the_best_tree_of_each_budget_on_this_device(lines, tmp_path):
    """The packaged drafter's acceptance gives one candidate per distinct best tree, each with
    its timed verify and drafting; the chosen one is the best predicted speedup."""
    search = _by_check(lines, "search")[0]
    assert "SmolLM2-135M" in search["acceptance"]
    nodes = [c["nodes"] for c in search["candidates"]]
    assert nodes == sorted(set(nodes)) and nodes[0] == 1
    for c in search["candidates"]:
        assert c["verify_ms"] > 0 and c["draft_ms"] > 0 and c["expected_tau"] >= 1.0
    best = max(search["candidates"], key=lambda c: c["predicted_speedup"])
    assert (
        search["chosen"]["nodes"] == best["nodes"] and len(search["chosen_paths"]) == best["nodes"]
    )


def test_search_reads_a_drafters_tree_search_json(tmp_path, capsys):
    (tmp_path / "tree-search.json").write_text(
        json.dumps({"acceptance": [[0.9, 0.05], [0.9, 0.05]]})
    )
    assert (
        main(["doctor", "--device", "cpu", "--checks", "search", "--acceptance", str(tmp_path)])
        == 0
    )
    search = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert search["acceptance"] == str(tmp_path / "tree-search.json")
    assert (
        max(c["nodes"] for c in search["candidates"]) == 6
    )  # 2 depths x 2 ranks: 2 + 4 paths at most
    assert (
        main(
            [
                "doctor",
                "--device",
                "cpu",
                "--checks",
                "search",
                "--acceptance",
                str(tmp_path / "none"),
            ]
        )
        == 2
    )
    assert "acceptance table" in capsys.readouterr().err


def test_a_decoding_step_reads_one_value_back_from_the_device(lines):
    """The chosen token is the only device-to-host read of a target-only decoding step: the
    row plan and the verify attention decide their sizes on the host (on a GPU each read-back
    is a sync that stalls the launch queue)."""
    profile = _by_check(lines, "profile")[0]
    assert profile["device_to_host_copies_per_token"] <= 1.1, profile
    assert profile["top_host_ops"] and profile["steps"] > 0


def test_python_dash_m_draftlab_is_the_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "draftlab", "doctor", "--device", "cpu", "--checks", "env"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["check"] == "env"


def test_runs_from_the_source_tree_without_ray_mlflow_or_vllm():
    """On a GPU machine without draftlab installed: `PYTHONPATH=platform python -m draftlab
    doctor`; it imports none of the cluster, tracking or serving stacks."""
    code = (
        "import sys, runpy; sys.argv = ['draftlab', 'doctor', '--device', 'cpu', '--checks', "
        "'env,verify', '--contexts', '8'];from draftlab.cli import main; rc = main();heavy = [m "
        "for m in ('ray', 'mlflow', 'vllm', 'fastapi', 'datasets') if m in "
        "sys.modules];print('HEAVY', heavy); sys.exit(rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout
    assert json.loads(out.stdout.splitlines()[0])["check"] == "env"


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (
            ["--speed-shape", "llama-70b"],
            "unknown shape 'llama-70b'; shapes: tiny, small, llama-3.2-1b, llama-3.1-8b",
        ),
        (["--checks", "env,speed"], "checks"),
    ],
)
def test_bad_input_is_a_clear_error(args, msg, capsys):
    assert main(["doctor", "--device", "cpu", *args]) == 2
    assert msg in capsys.readouterr().err
