"""The source root `platform/` must never shadow the stdlib module of the same name."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_init_in_source_root():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_import_platform_is_stdlib_with_repo_root_first():
    # Ray puts the working dir first on sys.path in every worker; simulate that.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import platform, sysconfig, pathlib;"
        "assert hasattr(platform, 'system'), platform;"
        "stdlib = pathlib.Path(sysconfig.get_paths()['stdlib']).resolve();"
        "assert pathlib.Path(platform.__file__).resolve().parent == stdlib, platform.__file__;"
        "import torch, draftlab; print(platform.system())"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
