"""A test module's own local Ray instance."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray

# Test Ray instances run without a dashboard, so no State API server is theirs. Left to find
# one, Ray Train's PlacementGroupCleaner (one per fit) asks the default address, where another
# test process (pytest-xdist) may run a dashboard: it does not find the fit's controller there,
# takes it for dead and removes the live run's placement group (seen in CI: a two-node DDP
# fit's workers killed mid-run). Ray's processes started meanwhile get an address where nothing
# answers: the cleaner then logs that the State API is unavailable and leaves the run alone.
NO_STATE_API = {"RAY_API_SERVER_ADDRESS": "http://127.0.0.1:9"}


@contextmanager
def no_state_api() -> Iterator[None]:
    """`NO_STATE_API` in the environment that Ray processes started inside inherit."""
    saved = {k: os.environ.get(k) for k in NO_STATE_API}
    os.environ.update(NO_STATE_API)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def local_ray(num_cpus: int = 2, object_store_mb: int = 150) -> Iterator[None]:
    """A fresh local Ray instance, stopped on exit (also when the body fails). `address="local"`:
    a bare `ray.init()` would join a head that another test started with `ray start --head`."""
    with no_state_api():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=object_store_mb * 1024**2,
        )
    try:
        yield
    finally:
        ray.shutdown()


def stop_serve() -> None:
    """`serve.shutdown()`, then a pause before the caller's `ray.shutdown()`. Serve kills its
    controller on the way out; a notice about it that reaches this process after Ray's core
    worker is gone makes Ray end the process ("The core worker has already been shutdown ...
    The process will exit", 60 ms after `ray.shutdown()` in a CI run: the pytest worker died
    and took its remaining modules with it)."""
    from ray import serve  # noqa: PLC0415 -- only Serve modules need it

    serve.shutdown()
    time.sleep(1.0)
