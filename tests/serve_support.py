"""Shared pieces for Serve tests: a module's own Ray + Serve on a free local port, and
printing measured figures past pytest's capture."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ray import serve

from mlflow_server import free_port
from ray_support import local_ray, stop_serve


@contextmanager
def local_serve() -> Iterator[str]:
    """Start Ray and Serve (HTTP on 127.0.0.1, a free port); give the base URL; stop both, also
    when Serve or the module's deployment fails to start (a Ray left running would fail every
    later module of the pytest worker). `with local_serve() as url:` in a module fixture."""
    with local_ray(num_cpus=4):
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_serve()


def report(capsys, tag: str, line: str) -> None:
    """Print past pytest's capture, so the measured figures show under `-q` in CI."""
    with capsys.disabled():
        print(f"\n[{tag}] {line}")
