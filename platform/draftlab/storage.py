"""Run outputs under `storage_path`: a local directory or a URI (`s3://`, `gs://`, ...).

Ray Train keeps its checkpoints under `storage_path` through pyarrow's filesystems
(`pyarrow.fs.FileSystem.from_uri`, which reads the usual AWS_* variables, AWS_ENDPOINT_URL
included); the drafter directory (weights, `tree.json`, `tree-search.json`, ...) goes through
the same filesystems here. `pathlib.Path` must never see a URI: `Path("s3://b/x")` is the
relative local path `s3:/b/x`.

Writers build a directory locally and `publish` it. Readers call `local_copy`: transformers,
torch and safetensors read local files, so a URI is mirrored into a cache directory (kept
per URI, refreshed file by file when the stored size or modification time changes).

pyarrow (a tenth of a second to import) is imported for URIs only, and `models.presets`
(torch) for a mirror's directory only: `draftlab --help` imports this module (cli;
serve.control -> serve.pair).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

# Written last into a mirror: the stored (size, mtime) of every file it holds.
MIRROR_INDEX = ".draftlab-mirror.json"


class StorageError(OSError):
    """A storage URI cannot be opened or holds nothing."""


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


def join(root: str | Path, *parts: str) -> str:
    """`root/parts...`: joined with `/` for a URI, with `pathlib` for a local path."""
    if is_uri(root):
        return "/".join([str(root).rstrip("/"), *parts])
    return str(Path(root, *parts))


def _filesystem(uri: str):
    """(pyarrow filesystem, path inside it) for `uri`."""
    # pyarrow: URIs only (module docstring)
    import pyarrow  # noqa: PLC0415
    from pyarrow.fs import FileSystem  # noqa: PLC0415

    try:
        return FileSystem.from_uri(uri)
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        raise StorageError(f"{uri}: cannot open its filesystem ({e})") from None


def exists(path: str | Path) -> bool:
    """`path` is a file or a non-empty directory (local or at a URI)."""
    if not is_uri(path):
        return Path(path).exists()
    from pyarrow.fs import FileType  # noqa: PLC0415 -- pyarrow: URIs only (module docstring)

    fs, root = _filesystem(str(path))
    return fs.get_file_info(root).type != FileType.NotFound


def publish(local_dir: str | Path, dest: str, names: list[str] | None = None) -> str:
    """Copy `local_dir`'s files (only `names`, when given) to the URI `dest`; returns `dest`.
    Stored files of the same name are replaced; others are kept."""
    from pyarrow.fs import LocalFileSystem, copy_files  # noqa: PLC0415 -- pyarrow: URIs only

    fs, root = _filesystem(dest)
    local_dir = Path(local_dir).resolve()
    for name in names or [""]:
        copy_files(
            str(local_dir / name) if name else str(local_dir),
            posixpath.join(root, name) if name else root,
            source_filesystem=LocalFileSystem(),
            destination_filesystem=fs,
        )
    return dest


def mirror_dir(uri: str) -> Path:
    """The local cache directory that mirrors `uri` (under `$DRAFTLAB_CACHE/storage`)."""
    from draftlab.models.presets import cache_dir  # noqa: PLC0415 -- torch (module docstring)

    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return cache_dir() / "storage" / f"{posixpath.basename(uri.rstrip('/'))}-{digest}"


def local_copy(path: str | Path) -> Path:
    """A local directory holding `path`'s files: `path` itself when it is local, else its
    mirror, brought up to date with what is stored at the URI now."""
    if not is_uri(path):
        return Path(path)
    from pyarrow.fs import (  # noqa: PLC0415 -- pyarrow: URIs only (module docstring)
        FileSelector,
        FileType,
        LocalFileSystem,
        copy_files,
    )

    uri = str(path)
    fs, root = _filesystem(uri)
    try:
        infos = fs.get_file_info(FileSelector(root, recursive=True, allow_not_found=True))
    except OSError as e:
        raise StorageError(f"{uri}: cannot list it ({e})") from None
    stored = {
        posixpath.relpath(i.path, root): [i.size, i.mtime_ns]
        for i in infos
        if i.type == FileType.File
    }
    if not stored:
        raise FileNotFoundError(f"{uri}: nothing is stored there")

    def fetch(rel: str, local: Path) -> None:
        copy_files(
            posixpath.join(root, rel),
            str(local),
            source_filesystem=fs,
            destination_filesystem=LocalFileSystem(),
        )

    return sync_mirror(mirror_dir(uri), stored, fetch)


def sync_mirror(dest: Path, stored: dict[str, list], fetch: Callable[[str, Path], None]) -> Path:
    """Bring the local mirror `dest` up to date with `stored` ({relative path: stamp, e.g.
    [size, mtime]}): `fetch(rel, dest / rel)` each file whose stamp changed or that is
    missing, delete what is not stored, write the index last. Under a file lock: replicas on
    one node share the mirror."""
    dest.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        index_file = dest / MIRROR_INDEX
        held = json.loads(index_file.read_text()) if index_file.is_file() else {}
        changed = [
            rel
            for rel, stamp in stored.items()
            if held.get(rel) != stamp or not (dest / rel).is_file()
        ]
        for rel in changed:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            fetch(rel, dest / rel)
        if changed or held.keys() - stored.keys():
            # Files not stored at the source: deleted there, or derived here from older files
            # (`tree-searched-<n>.json` from an older `tree-search.json`).
            for f in [f for f in dest.rglob("*") if f.is_file()]:
                if f.relative_to(dest).as_posix() not in stored and f.name != MIRROR_INDEX:
                    f.unlink()
        tmp = index_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        tmp.replace(index_file)
    return dest
