"""The layout: the source root `platform/` never shadows the stdlib module of the same name,
the package's modules import each other without loops, and the repository is formatted and
linted (ruff)."""

import ast
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


def _import_graph() -> dict[str, set[str]]:
    """draftlab module -> the draftlab modules it imports, at the top or inside a function
    (a function-local import hides a loop, it does not break it); `if TYPE_CHECKING:` imports
    are left out (never run)."""
    src = ROOT / "platform"
    files = {
        ".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): f
        for f in (src / "draftlab").rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        tree = ast.parse(f.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for mod in names:
                while mod and mod not in files:
                    mod = mod.rpartition(".")[0]
                if mod and mod != name:
                    targets.add(mod)
        graph[name] = targets
    return graph


def _a_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of `graph` (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for child in sorted(graph[node]):
            if loop := visit(child, [*path, node]):
                return loop
        done.add(node)
        return None

    return next((loop for start in sorted(graph) if (loop := visit(start, []))), None)


def test_the_package_has_no_import_loops():
    graph = _import_graph()
    assert {"draftlab.config", "draftlab.bench", "draftlab.distill.worker"} <= graph.keys()
    assert (
        "draftlab.models.drafters.registry" in graph["draftlab.config.distill"]
    )  # function-local imports count
    assert _a_loop(graph) is None, " -> ".join(_a_loop(graph))
    assert _a_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        "a",
        "b",
        "c",
        "a",
    ]  # the finder finds one


def test_configs_and_the_drafter_registry_import_without_torch():
    # `draftlab.config` (its `distill` module) validates drafter families through the registry,
    # a leaf: checking a job file must not load torch or transformers (nor, through them, a
    # family module)
    code = (
        "import sys, draftlab.config; "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _ruff() -> list[str]:
    """The ruff of the interpreter running the tests: its venv's `ruff` script, else the module."""
    script = Path(sys.executable).with_name("ruff")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ruff"]


def test_ruff_format_and_check_are_clean():
    # the settings are pyproject.toml's [tool.ruff]; `ruff format .` and `ruff check --fix .`
    # fix most of what this reports
    for args in (["format", "--check", "."], ["check", "."]):
        out = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout}{out.stderr}"
