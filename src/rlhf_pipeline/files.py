"""Files that must be whole: which file of a saved directory is damaged, the list of files (and sizes) a checkpoint
is checked against, and a failed write (a full disk) or read (a damaged file) turned into one line.

Checks by kind, none of which unpickles anything:

* ``.json``: parses;
* ``.safetensors``: the header parses and the data it describes covers the file (``safetensors.safe_open``);
* ``.arrow`` (what ``datasets.save_to_disk`` writes): every record batch of the stream reads;
* ``.bin`` / ``.pt`` / ``.pth`` / ``.pkl`` in ``torch.save``'s zip format: the archive is complete and every member's CRC
  matches (``zipfile.testzip``); a legacy pickle file is not checked.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

from rlhf_pipeline.errors import PipelineError

MODEL_HINT = "copy or download the model again, or rerun the stage that wrote it (with --overwrite)"
FILE_LIST = "files.json"  # a checkpoint's files and their sizes, written when it is complete
NEARLY_FULL = 1 << 20  # bytes: a write that fails with less free than this ran out of space
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NO_SPACE_TEXT = ("no space left on device", "os error 28", "disk quota exceeded")


def check_file(path: Path) -> str | None:
    """Why ``path`` cannot be read whole, or None when it can (or is of a kind that is not checked)."""
    path = Path(path)
    suffix = path.suffix
    try:
        if suffix == ".json":
            json.loads(path.read_bytes())
        elif suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="np"):
                pass
        elif suffix == ".arrow":
            import pyarrow as pa

            with pa.memory_map(str(path)) as source:
                for _ in pa.ipc.open_stream(source):
                    pass
        elif suffix in (".bin", ".pt", ".pth", ".pkl"):
            with path.open("rb") as f:
                if f.read(2) != b"PK":
                    return None  # a legacy pickle: not checked
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            if bad is not None:
                return f"its member {bad} fails its CRC check"
    except Exception as e:  # each reader raises its own kinds; any of them means the file is not whole
        return f"{type(e).__name__}: {first_line(e)}"
    return None


def damaged_files(directory: Path) -> list[tuple[Path, str]]:
    """The files under ``directory`` that :func:`check_file` finds damaged, with the reason, in path order."""
    directory = Path(directory)
    found = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        reason = check_file(path)
        if reason is not None:
            found.append((path, reason))
    return found


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def reading(what: str, path: str | Path, fix: str, only_damaged: bool = False) -> Iterator[None]:
    """Turn a failure to read ``path`` (``what``: "dataset", "model", ...) into one line naming the damaged file
    when one can be found, and ``fix``. With ``only_damaged`` a failure where no file is found damaged propagates as
    it was (a model's loader fails for reasons of its own: a missing package, memory)."""
    try:
        yield
    except (PipelineError, KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:
        if not Path(path).exists():
            raise
        bad = damaged_files(Path(path)) if Path(path).is_dir() else []
        if bad:
            where, reason = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise PipelineError(f"{path}: the {what} could not be read: {where} is damaged or incomplete{more} "
                                f"({reason}); {fix}") from e
        if only_damaged:
            raise
        raise PipelineError(f"{path}: the {what} could not be read ({type(e).__name__}: {first_line(e)}); "
                            f"{fix}") from e


def is_disk_full(exc: BaseException) -> bool:
    """A write failed for lack of space: an OSError with ENOSPC (or a quota), or a library's error that says so in
    its text (tokenizers and safetensors raise their own types with the OS's message)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if any(text in str(e).lower() for text in _NO_SPACE_TEXT):
            return True
    return False


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _nearly_full(path: str | Path) -> bool:
    """A write failed where the filesystem has (almost) nothing left: a library that reports the failed write as
    its own error (torch.save: "iostream error", "unexpected pos") ran out of space."""
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL


def free_bytes(path: str | Path) -> int | None:
    """The bytes free on the filesystem that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


@contextlib.contextmanager
def writing(path: str | Path, needed: int | None = None, what: str = "the output",
            again: str = "run the same command again") -> Iterator[None]:
    """Turn a full disk while writing ``path`` into one line: the path, the bytes needed where known, the bytes
    free, and what to do. Whoever writes must still remove what the failed write left (an atomic directory does)."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as e:
        if not (is_disk_full(e) or _nearly_full(path)):
            raise
        where = next((getattr(x, "filename", None) for x in _chain(e) if getattr(x, "filename", None)), None)
        free = free_bytes(path)
        need = f"about {size_text(needed)} needed, " if needed else ""
        have = f"{size_text(free)} free there" if free is not None else "free space unknown"
        raise PipelineError(
            f"{path}: no space left on the device while writing {what}{f' ({where})' if where else ''}; {need}{have}. "
            "Nothing partial was kept as finished and the inputs are untouched: free some space (or choose another "
            f"--output) and {again}"
        ) from e


def list_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size), except the list itself."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != FILE_LIST}


def seal(directory: Path) -> None:
    """Flush every file of a directory just written to the disk, and record their sizes in ``files.json``
    (itself flushed): a directory with that list was complete when it was written."""
    directory = Path(directory)
    (directory / FILE_LIST).write_text(json.dumps({"files": list_files(directory)}, indent=1) + "\n")
    flush_tree(directory)


def flush_tree(directory: Path) -> None:
    """Flush every file under ``directory``, and the directories holding them, to the disk: what is renamed into
    place after this survives a power cut as written."""
    directory = Path(directory)
    dirs = {directory}
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            _fsync(p)
            dirs.add(p.parent)
    for d in sorted(dirs):
        sync_dir(d)


def flush_files(directory: Path, names: Iterable[str] | None = None) -> None:
    """Flush the files directly in ``directory`` (not its subdirectories), or only those ``names``, and the directory
    itself to the disk."""
    directory = Path(directory)
    paths = sorted(directory.iterdir()) if names is None else [directory / name for name in names]
    for p in paths:
        if p.is_file():
            _fsync(p)
    sync_dir(directory)


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def directory_signature(path: str | Path, skip: Iterable[str] = ()) -> str | None:
    """A digest of the names, sizes and modification times of the files directly in a directory but those named in
    ``skip``, or None for what is not one (a Hub id): it changes when a model directory is written again or replaced,
    without reading a weight."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in skip:
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def verify(directory: Path) -> str | None:
    """Why a sealed directory is not the one that was written (a file missing, cut short, damaged), or None. An
    unsealed one (no ``files.json``) is only checked file by file."""
    directory = Path(directory)
    listing = directory / FILE_LIST
    if not listing.exists():  # sealed by no one (an older version wrote it): each file must at least read whole
        bad = damaged_files(directory)
        return None if not bad else f"{bad[0][0].relative_to(directory)} is damaged ({bad[0][1]})"
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{FILE_LIST} is damaged ({first_line(e)})"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
        reason = check_file(path)
        if reason is not None:
            return f"{name} is damaged ({reason})"
    return None


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it) to the disk, where the filesystem can."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory
    finally:
        os.close(fd)
