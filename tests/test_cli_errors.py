"""Every `draftlab` command ends a failure the user can act on (a device this machine lacks,
an MLflow server that does not answer, a directory that is not a drafter, a stale generated
file) with exit code 2 and one line naming the problem: never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftlab.cli import main
from mlflow_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, argv: list[str], expected: str, within_s: float = 60.0) -> None:
    t0 = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"draftlab {argv[0]}: "), err
    assert expected in err[0] and "Traceback" not in err[0], err
    assert time.monotonic() - t0 < within_s  # no minutes of retries


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_a_device_this_machine_lacks(capsys, command):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line_error(
        capsys, [command, "--target", "tiny-llama", "--device", "cuda"], "use --device cpu"
    )


@pytest.mark.parametrize("argv", [["runs"], ["promote", "0123abcd"]], ids=["runs", "promote"])
def test_an_mlflow_server_that_does_not_answer(capsys, argv):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    one_line_error(
        capsys, [*argv, "--tracking-uri", dead], f"MLflow at {dead} does not answer", within_s=30
    )


def test_select_tree_on_a_directory_that_is_not_a_drafter(capsys, tmp_path):
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"name": "x", "target": {"name": "tiny-llama"}, "storage_path": str(tmp_path)}
        )
    )
    (tmp_path / "empty").mkdir()
    one_line_error(
        capsys,
        ["select-tree", "-c", str(cfg), "--drafter", str(tmp_path / "empty")],
        "is not a drafter directory",
    )


def test_export_of_a_directory_that_is_not_a_drafter(capsys, tmp_path):
    one_line_error(
        capsys, ["export", str(tmp_path), str(tmp_path / "out")], "is not a drafter directory"
    )


def test_generate_check_names_the_stale_file(tmp_path):
    # a copy of the sources it renders from, run as a user runs it: `--check` names the stale
    # file, exits 2 and writes nothing
    for rel in ("platform", "docs", "serving", "infra", "README.md"):
        copy = shutil.copytree if (ROOT / rel).is_dir() else shutil.copy
        copy(ROOT / rel, tmp_path / rel)
    (tmp_path / "docs" / "configuration.md").write_text("stale\n")
    out = subprocess.run(
        [sys.executable, "-m", "draftlab.cli", "generate", "--check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "platform")},
        timeout=120,
    )
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert err[0] == (
        "draftlab generate: error: stale generated files (run `draftlab generate`): "
        "docs/configuration.md"
    )
    assert (tmp_path / "docs" / "configuration.md").read_text() == "stale\n"
