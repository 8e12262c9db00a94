"""Shared fixtures: tiny random-config targets load in milliseconds and are reused."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import distill_support
from draftlab.models import row_kernel
from draftlab.models.target import load_target
from mlflow_server import MlflowServer, mlflow_server_fixture

# One build of the CPU row attention kernel for the whole session, also for the modules that
# point DRAFTLAB_CACHE at a directory of their own (their data, S3 mirrors): a build takes up
# to a minute on 2 cores. Set before any Ray instance starts, so its workers inherit it.
os.environ.setdefault("DRAFTLAB_KERNEL_CACHE", str(row_kernel.kernels_dir()))
# Ray Train, for every test Ray instance (read when a fit starts): the controller polls its
# workers every 0.1 s instead of 2 s (each fit ends sooner), no preemption watcher actor (one
# more Python process to start per fit, for cloud node drains a test never has), and no state
# actor polling controllers that the fault tests kill.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION", "0")
# Under pytest-xdist (`-n 2`) the test processes share the cores: each one's torch gets its
# share. Two processes of 2 OpenMP threads each on 2 cores ran the compute-bound modules up to
# 10x slower than alone (test_greedy_identity 321 s against 31 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, torch.get_num_threads() // _workers))


# Whole-module seconds of the long modules under the README's `pytest -n 2` on the 2-core CI
# class (a full run, rounded). `--dist loadfile` hands a worker whole modules; ordered by test
# count (xdist's default) the few-test Ray Train and Tune modules came last and one worker sat
# idle for the last ~6 minutes of the 32. Longest first (`_LongestFirst`) levels the two
# workers' ends; a module not listed counts a second a test. Rough figures are enough: these
# were taken before the install compiled bytecode (`uv pip install --compile-bytecode`), which
# cut the whole run from 34 to 21 minutes (the sweep crash test alone: 127 s to 81 s).
MODULE_SECONDS = {
    "tests/distill/test_faults.py": 340,
    "tests/pipeline/test_pipeline.py": 330,
    "tests/sweep/test_sweep_tune.py": 270,
    "tests/distill/test_distill_ray.py": 230,
    "tests/distill/test_sharded_training.py": 190,
    "tests/serve/test_serve_faults.py": 190,
    "tests/serve/test_vllm_serve.py": 180,
    "tests/distill/test_job_submission.py": 180,
    "tests/serve/test_serve_app.py": 170,
    "tests/data/test_selfdistill.py": 160,
    "tests/test_vllm_bench.py": 150,
    "tests/distill/test_s3_storage.py": 150,
    "tests/sweep/test_sweep_faults.py": 130,
    "tests/data/test_vllm_writer.py": 110,
    "tests/sweep/test_trial.py": 80,
    "tests/decoding/test_lossless_sampling.py": 80,
    "tests/models/test_attention.py": 75,
    "tests/test_smoke_smollm2.py": 70,
    "tests/test_tracking.py": 50,
    "tests/serve/test_fuzz.py": 45,
}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: no xdist, no call
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the longest modules handed out first (`MODULE_SECONDS`)."""
    if config.getoption("dist") != "loadfile":
        return None
    if gone := [m for m in MODULE_SECONDS if not (config.rootpath / m).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py: MODULE_SECONDS names no such module: {gone}")
    from xdist.scheduler import LoadFileScheduling  # noqa: PLC0415 -- only under xdist

    class _LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            queue = self.workqueue  # module -> {nodeid: done}

            def seconds(module: str) -> float:
                return MODULE_SECONDS.get(module, len(queue[module]))

            queue.move_to_end(max(queue, key=seconds), last=False)
            super()._assign_work_unit(node)

    return _LongestFirst(config, log)


def _services() -> tuple[bool, int]:
    """(Ray is up in this process, MLflow servers started so far)."""
    ray = sys.modules.get("ray")
    return (ray is not None and ray.is_initialized()), MlflowServer.starts


def _only_slow_tests_start_services(item: pytest.Item, before: tuple[bool, int]) -> None:
    """The fast tier (`-m "not slow"`) starts no Ray and no MLflow server: a test whose
    fixtures or body start one must be marked slow."""
    if item.get_closest_marker("slow") is not None:
        return
    (ray_before, mlflow_before), (ray_after, mlflow_after) = before, _services()
    started = [
        what
        for what, new in (
            ("Ray", ray_after and not ray_before),
            ("an MLflow server", mlflow_after > mlflow_before),
        )
        if new
    ]
    if started:
        pytest.fail(
            f"{item.nodeid} starts {' and '.join(started)}: mark it @pytest.mark.slow",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    before = _services()
    result = yield
    _only_slow_tests_start_services(item, before)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = _services()
    result = yield
    _only_slow_tests_start_services(item, before)
    return result


@pytest.fixture(scope="module", autouse=True)
def _threads_unchanged():
    """A module that changes torch's process-wide thread count must put it back: otherwise
    every later module runs (and is timed) on its setting."""
    threads = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == threads, (
        f"this module left torch at {torch.get_num_threads()} threads (was {threads})"
    )


@pytest.fixture(scope="session", autouse=True)
def _shared_tiny_data(tmp_path_factory):
    """One prompt file and data cache for every `distill_support.tiny_config` of the session."""
    distill_support.SHARED = tmp_path_factory.mktemp("tiny-data")
    yield
    distill_support.SHARED = None


_session_mlflow = mlflow_server_fixture(scope="session")


@pytest.fixture(scope="session")
def mlflow_uri(_session_mlflow):
    """One real tracking server for the session's integration modules (~15 s of CPU a start).
    Tests that read back runs, versions or aliases name their own experiment or read the
    versions they created; modules that take their server down (`distill/test_faults.py`) or
    count registry versions from 1 (`test_tracking.py`) start their own."""
    return _session_mlflow.url


@pytest.fixture(scope="session")
def tiny():
    return load_target("tiny-llama")


@pytest.fixture(scope="session")
def tiny_prompts(tiny):
    texts = ["Hello world", "The quick brown fox", "1 + 1 =", "Write a poem about the sea."]
    return [tiny.encode_prompt(t) for t in texts]
