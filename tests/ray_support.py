"""A test module's own local Ray instance."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray


@contextmanager
def local_ray(num_cpus: int = 2, object_store_mb: int = 150) -> Iterator[None]:
    """A fresh local Ray instance, stopped on exit (also when the body fails). `address="local"`:
    a bare `ray.init()` would join a head that another test started with `ray start --head`."""
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
