"""What `draftlab` tells a user before any work runs: `--version`, the top-level help (a
description and examples, not notes to developers), each command's help, and argparse's own
refusal of a value outside an option's choices."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from draftlab import cli, cli_parser
from draftlab.cli import build_parser, main, package_version
from draftlab.config import TargetSpec

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"draftlab {metadata.version('draftlab')}\n"


def test_version_without_the_install_comes_from_pyproject(monkeypatch):
    import tomllib

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cli_parser.metadata, "version", missing)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert package_version() == expected


def test_version_of_a_checkout_on_pythonpath():
    # `PYTHONPATH=platform python -m draftlab --version`, as on a GPU machine without the install
    out = subprocess.run(
        [sys.executable, "-m", "draftlab", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "platform")},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("draftlab ") and out.stdout.split()[1][0].isdigit()


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "Speculative decoding with parallel drafters on Ray" in text
    assert (
        "examples:\n  draftlab pipeline -c jobs/configs/pipeline-smollm2-135m-cpu.yaml\n" in text
    )  # raw, not re-wrapped
    assert "draftlab serve --shutdown; ray stop" in text
    assert "--version" in text
    assert "parsing" not in text.lower() and "validation only" not in text  # no note to developers
    for command in (
        "pipeline",
        "distill",
        "sweep",
        "serve",
        "bench",
        "loadtest",
        "submit",
        "report",
    ):
        assert f"\n    {command} " in text


def test_report_help_names_every_kind_of_source(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for kind in (
        "pipeline directory",
        "sweep directory",
        "drafter directory",
        "MLflow run id",
        "training.json",
    ):
        assert kind in text


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_device_and_dtype_choices_are_the_configs(command):
    (sub,) = [
        a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
    ]
    options = {o: a for a in sub.choices[command]._actions for o in a.option_strings}
    assert options["--device"].choices == ["auto", "cpu", "cuda"]
    assert options["--dtype"].choices == ["auto", "float32", "bfloat16", "float16"]
    for name in (
        "device",
        "dtype",
    ):  # the same values TargetSpec accepts, so no valid value is refused
        allowed = TargetSpec.model_fields[name].annotation.__args__
        assert list(allowed) == options[f"--{name}"].choices


@pytest.mark.parametrize(
    ("argv", "option", "value"),
    [
        (["bench", "--device", "tpu"], "--device", "tpu"),
        (["profile", "--dtype", "bf16"], "--dtype", "bf16"),
        (["doctor", "--device", "gpu"], "--device", "gpu"),
    ],
)
def test_a_value_outside_the_choices_is_refused_before_any_work(capsys, argv, option, value):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"usage: draftlab {argv[0]} ")
    assert err[-1].startswith(
        f"draftlab {argv[0]}: error: argument {option}: invalid choice: '{value}' (choose from "
    )
    assert "'cpu'" in err[-1] or "'float32'" in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_valid_device_and_dtype_reach_the_config_unchanged():
    args = build_parser().parse_args(["bench", "--device", "cpu", "--dtype", "bfloat16"])
    target = cli._target(args)
    assert (target.device, target.dtype) == ("cpu", "bfloat16")
    defaults = cli._target(build_parser().parse_args(["bench"]))
    assert (defaults.device, defaults.dtype) == (TargetSpec().device, TargetSpec().dtype)
