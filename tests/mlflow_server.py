"""A real `mlflow server` subprocess on 127.0.0.1 for integration tests.

    from mlflow_server import MlflowServer, mlflow_server_fixture

    mlflow_server = mlflow_server_fixture(scope="module")   # in a test module

    def test_x(mlflow_server):
        Tracker(tracking_uri=mlflow_server.url, ...)
        mlflow_server.stop()     # fault injection: the server is gone ...
        mlflow_server.start()    # ... and back on the same port with the same database

The server uses a sqlite backend and proxied artifacts (`--artifacts-destination`) in a
temp dir, so clients never touch the server's disk directly: what a test reads back
really went through HTTP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# Cold start is ~14 s on a 2-core machine; leave room for a loaded CI box.
STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all sockets stay bound until every port is picked (one at a
    time, the kernel may hand the same just-released port out twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class MlflowServer:
    """One `mlflow server` process; `stop()`/`start()` keep the port, database and artifacts."""

    starts = 0  # processes started in this test session (conftest: only slow tests start one)

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        port: int | None = None,
        workers: int = 1,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        extra_env: dict[str, str] | None = None,
    ):
        self._tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="mlflow-srv-")
        self.root = Path(root if root is not None else self._tmp.name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.workers = workers
        self.startup_timeout = startup_timeout
        self.extra_env = dict(extra_env or {})
        self.db = self.root / "mlflow.db"
        self.artifacts = self.root / "mlartifacts"
        self.log_path = self.root / "server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # The venv's `mlflow` script sits beside the interpreter; `-m mlflow` works as well.
        return [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--backend-store-uri",
            f"sqlite:///{self.db}",
            "--artifacts-destination",
            str(self.artifacts),
            "--workers",
            str(self.workers),
        ]

    def start(self) -> str:
        """Start (or restart) the server and wait for `/health`; returns the URL."""
        if self.running:
            return self.url
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            # The server otherwise forks a job runner plus ~7 huey consumers (GenAI jobs):
            # seconds of CPU on a 2-core box for something draftlab never uses.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            **self.extra_env,
        }
        env.pop("MLFLOW_TRACKING_URI", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            # Own session: stop() signals the whole group (the server forks its workers).
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
                start_new_session=True,
            )
            MlflowServer.starts += 1
        finally:
            log.close()
        self._wait_healthy()
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with code {self.proc.returncode} before answering "
                    f"/health on {self.url}.\n--- server log tail ---\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"mlflow server did not answer {self.url}/health within {self.startup_timeout:.0f} s."
            f"\ncommand: {' '.join(self.command())}\n--- server log tail ---\n{self.log_tail()}"
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server's process group, then kill it if it lingers."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(10)
        # Workers may outlive the parent for a moment; make sure the group is gone.
        self._signal_group(proc, signal.SIGKILL)
        # The port must be free before a restart binds it again.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._port_in_use():
            time.sleep(0.2)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # pgid == pid thanks to start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def _port_in_use(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mlflow_server_fixture(scope: str = "module", **kwargs):
    """A pytest fixture yielding a started `MlflowServer`; assign it to a module-level name."""

    @pytest.fixture(scope=scope)
    def _mlflow_server():
        with MlflowServer(**kwargs) as server:
            yield server

    return _mlflow_server
