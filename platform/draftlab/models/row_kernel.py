"""The CPU row attention kernel (`kernels/row_attention.cpp`): build once, load, call.

Row-exact attention (`attention.row_exact_attention`) runs every verified row as its own
batch entry of SDPA's flash kernel, on one thread, so each row a tree or a prompt lookup
adds to a verify block costs a noticeable share of a decoding step. This kernel computes
each row alone by construction (see the .cpp), reading the cache in place and spread over
torch's threads: several times cheaper a row, the decoding step included
(docs/benchmarks.md#verify-cost-on-cpus).

It is compiled with the C++ compiler torch's extensions use (`torch.utils.cpp_extension`,
ninja) the first time a process needs it (tens of seconds), into `kernels_dir()/<digest>`
keyed by the source, torch's version and this CPU's flags, so later processes load it in
milliseconds. Where it cannot be built (no compiler), `load()` returns None once with a
warning and row-exact attention keeps SDPA's kernel: both are row-exact, and one process
uses one of them throughout. `DRAFTLAB_ROW_KERNEL=0` turns it off.

A process killed while building or loading (a Ray worker a test or a node failure kills)
must not block the next ones: torch's own build lock is a file that outlives its process,
so every later `cpp_extension.load` of that directory would wait for ever. Hence a built
kernel is imported directly, and a build runs under an OS lock (`fcntl.flock`, released
when its holder dies) in a directory of its own that is renamed into place only once built.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
from functools import cache
from pathlib import Path

import torch

from draftlab.models.presets import cache_dir

SOURCE = Path(__file__).parent / "kernels" / "row_attention.cpp"
NAME = "draftlab_row_attention"
HEAD_SIZES = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float32)
log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next(
        (line for line in text.splitlines() if line.startswith("flags")), platform.processor()
    )


def kernels_dir() -> Path:
    """Built kernels: `$DRAFTLAB_KERNEL_CACHE`, else `$DRAFTLAB_CACHE/kernels`. A kernel depends
    on its source, torch and the CPU only, so processes that keep their data and mirrors
    apart (their own `DRAFTLAB_CACHE`) can still share one build."""
    own = os.environ.get("DRAFTLAB_KERNEL_CACHE")
    return Path(own).expanduser() if own else cache_dir() / "kernels"


def build_dir() -> Path:
    """Where this source, torch and CPU's build lives (a CPU with other flags builds anew:
    the kernel is compiled for the machine it runs on)."""
    key = "\n".join([SOURCE.read_text(), torch.__version__, platform.machine(), _cpu_flags()])
    return kernels_dir() / f"row_attention-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _find_ninja() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel (a dependency) puts it next to this
    interpreter, which is not on PATH when a venv's python runs without activation."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: PLC0415 -- optional: without the wheel, ninja comes from PATH
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def compiler() -> str | None:
    """The C++ compiler torch's extensions build with (`$CXX`, else `c++`), if installed."""
    return shutil.which(os.environ.get("CXX", "c++"))


def lock_path(where: Path) -> Path:
    """The build lock of the build directory `where` (beside it: a build renames `where`)."""
    return where.parent / f"{where.name}.lock"


def _import_built(where: Path):
    """Import the extension built in `where` (as torch's loader does, without its lock)."""
    spec = importlib.util.spec_from_file_location(NAME, where / f"{NAME}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(where: Path):
    """Build into a fresh directory beside `where` and rename it into place; the caller holds
    the build lock, so leftovers of builds killed half-way are removed first."""
    from torch.utils import cpp_extension  # noqa: PLC0415 -- setuptools: kernel builds only

    _find_ninja()
    for stale in where.parent.glob(f"{where.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(where, ignore_errors=True)  # a build from before this layout, or a broken one
    scratch = where.parent / f"{where.name}.tmp-{os.getpid()}"
    scratch.mkdir()
    log.info("building draftlab's CPU row attention kernel once (up to a minute) in %s", where)
    module = cpp_extension.load(
        name=NAME,
        sources=[str(SOURCE)],
        build_directory=str(scratch),
        extra_cflags=["-O3", "-march=native"],
        verbose=False,
    )
    scratch.rename(where)
    return module


@cache
def load():
    """The compiled extension, or None where it is turned off or cannot be built."""
    if os.environ.get("DRAFTLAB_ROW_KERNEL", "1") == "0":
        return None
    where = build_dir()
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path(where), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
            if (where / f"{NAME}.so").exists():
                return _import_built(where)
            return _build(where)
    except Exception as e:  # no compiler, no ninja, ...: SDPA's kernel stays row-exact
        log.warning(
            "draftlab's CPU row attention kernel could not be built (%s: %s); verify rows "
            "use SDPA per row instead (slower per row, equally exact)",
            type(e).__name__,
            e,
        )
        return None


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel covers this layer's tensors (CPU, bf16/float32, these head sizes)."""
    return (
        query.device.type == "cpu"
        and key.dtype in DTYPES
        and key.shape[-1] in HEAD_SIZES
        and load() is not None
    )


def rows_attention(
    query: torch.Tensor,  # (T, H, d)
    key: torch.Tensor,  # (KV, S, d)
    value: torch.Tensor,  # (KV, S, d)
    index: torch.Tensor,  # (T or 1, W) int64: row r's keys are index[r, :counts[r]], in order
    counts: torch.Tensor,  # (T,) int64
    scale: float,
) -> torch.Tensor:
    """(T, H, d) float32: every row's attention over its own keys (see the module doc). The
    caller checks the indices (`RowPlan.key_lists`): the kernel reads them unchecked."""
    return load().rows_attention(
        query.float().contiguous(),
        key.contiguous(),
        value.contiguous(),
        index.contiguous(),
        counts.contiguous(),
        float(scale),
    )
