"""What `draftlab pipeline` leaves on the console: Ray's own notices go to the run's log."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from draftlab.pipeline.runner import QUIET_WORKERS, _ray_to_log


@pytest.fixture
def ray_logger():
    log = logging.getLogger("ray")
    saved = log.handlers[:], log.level, log.propagate
    yield log
    for h in log.handlers:
        h.close()
    log.handlers[:], log.level, log.propagate = saved


def test_ray_notices_go_to_the_log_and_only_warnings_to_the_console(tmp_path, capsys, ray_logger):
    log_file = tmp_path / "ray.log"
    _ray_to_log(log_file)
    logging.getLogger("ray._private.worker").info(
        "Connected to Ray cluster. View the dashboard at http://x"
    )
    logging.getLogger("ray.scripts").warning("Token authentication is enabled")
    err = capsys.readouterr().err
    assert "Connected to Ray cluster" not in err and "Token authentication is enabled" in err
    text = log_file.read_text()
    assert "INFO ray._private.worker -- Connected to Ray cluster" in text
    assert "WARNING ray.scripts -- Token authentication is enabled" in text


def test_workers_of_the_pipeline_draw_no_progress_bars():
    # a worker process with the pipeline's environment: transformers' "Loading weights" bar
    # (through huggingface_hub's switch) and MLflow's download bars are off
    code = (
        "from transformers.utils import logging as tl; "
        "from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR as bar; "
        "print(tl.is_progress_bar_enabled(), bar.get())"
    )
    env = {k: v for k, v in os.environ.items() if k not in QUIET_WORKERS}
    plain = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    quiet = subprocess.run(
        [sys.executable, "-c", code],
        env=env | QUIET_WORKERS,
        capture_output=True,
        text=True,
        check=True,
    )
    assert plain.stdout.split() == ["True", "True"]
    assert quiet.stdout.split() == ["False", "False"]
