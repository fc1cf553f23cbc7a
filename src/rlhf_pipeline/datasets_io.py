"""Dataset references, loading, and the atomic, self-describing outputs every stage writes.

A reference (``REF``) is one of:

* a local directory in the ``datasets.save_to_disk`` layout (what every stage writes);
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file;
* a Hub dataset id ``ORG/NAME``, optionally ``ORG/NAME#CONFIG`` (a configuration, or subset, of the repo: what
  ``--push-to-hub ORG/NAME --hub-config CONFIG`` writes, and ``rlhf iterate`` per stage), ``ORG/NAME:SPLIT`` and
  ``ORG/NAME@REVISION``, in the order ``ORG/NAME[#CONFIG][:SPLIT][@REVISION]``.

A local directory or Hub id holding several splits takes ``:SPLIT`` too (``runs/my_run/iter_1/filter:train``).

An output directory holds the dataset and a ``manifest.json`` that is written last: its presence means the stage
completed. It records the stage, the package version, the full config, the inputs with their fingerprints, row
counts in and out, rows dropped per reason and the wall time. Outputs are written to a hidden temporary sibling
and renamed into place, so a crash never leaves a half-written output behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rlhf_pipeline import __version__
from rlhf_pipeline.config import semantic_dict, to_dict
from rlhf_pipeline.errors import PipelineError, redact
from rlhf_pipeline.files import (
    first_line, flush_files, flush_tree, is_disk_full, reading, sha256_file, sync_dir, writing,
)
from rlhf_pipeline.layout import MANIFEST, PARTS_DIR, RUN_RECORD

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

log = logging.getLogger(__name__)

REWRITE_HINT = "run the stage that wrote it again (with --overwrite), or copy it again from where it came from"
TRAINING_STAGES = ("sft", "train-rm", "train")  # outputs that are models, whose rows_out counts steps
FILE_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:#(?P<config>[\w.-]+))?(?::(?P<split>[\w.-]+))?"
                     r"(?:@(?P<revision>[\w./-]+))?$")
HUB_MANIFESTS = "manifests"  # where a dataset repo keeps the manifest of each configuration: manifests/CONFIG.json
_COMMIT = re.compile(r"[0-9a-f]{40}")  # a Hub commit id
HUB_TIMEOUT_S = 100  # how long a question to the Hub may wait for its answer (datasets waits as long)


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """A parsed dataset reference. ``kind`` is ``dir``, ``file`` or ``hub``."""

    kind: str
    location: str
    split: str | None = None
    revision: str | None = None
    config: str | None = None  # a Hub dataset's configuration (subset)

    def __str__(self) -> str:
        text = self.location
        if self.config:
            text += f"#{self.config}"
        if self.split:
            text += f":{self.split}"
        if self.revision:
            text += f"@{self.revision}"
        return text

    @property
    def name(self) -> str:
        """How error messages name the source: the path as given, or the Hub id."""
        return self.location


def parse_ref(text: str) -> DatasetRef:
    """Parse a dataset reference, checking that a local one exists."""
    path = Path(text).expanduser()
    split = None
    if not path.exists() and ":" in text:
        head, _, tail = text.rpartition(":")
        if Path(head).expanduser().exists() and re.fullmatch(r"[\w.-]+", tail):
            path, split = Path(head).expanduser(), tail
    if path.is_dir():
        return DatasetRef("dir", str(path), split=split)
    if path.is_file():
        if split not in (None, "train"):  # a file is one split, which datasets names train
            raise PipelineError(f"{text}: {path} is a file, which holds one split (train); drop ':{split}'")
        if path.suffix not in FILE_SUFFIXES:
            raise PipelineError(
                f"{text}: unsupported file type '{path.suffix}'; use .json, .jsonl, .parquet or a save_to_disk directory"
            )
        return DatasetRef("file", str(path))
    match = _HUB_ID.match(text)
    name = text.split("@", 1)[0]  # a revision may hold slashes (refs/pr/1)
    looks_local = text.startswith((".", "/", "~")) or Path(name).suffix in FILE_SUFFIXES or name.count("/") != 1
    if match and not looks_local:
        return DatasetRef("hub", match["repo"], split=match["split"], revision=match["revision"],
                          config=match["config"])
    raise PipelineError(
        f"{text}: no such file or directory, and not a Hub dataset id (ORG/NAME[#CONFIG][:SPLIT][@REVISION])"
    )


def _unreadable_file(path: Path, builder: str, error: Exception) -> str:
    """Why a data file did not load, as precisely as can be found: an empty file, or a JSON Lines file's first line
    that is not a JSON object (datasets' own error names neither)."""
    size = path.stat().st_size
    blank = size <= 1 << 20 and path.suffix in (".json", ".jsonl") and not path.read_bytes().strip()
    if size == 0 or blank:
        return f"{path}: is empty; give it at least one row"
    if path.suffix == ".jsonl" or (path.suffix == ".json" and _json_lines(path)):
        with path.open(errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.strip())
                except json.JSONDecodeError as e:
                    return f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno}); fix or remove it"
                if not isinstance(value, dict):
                    return f"{path}: line {number} is a JSON {type(value).__name__}, not an object; give one row a line"
    return f"{path}: could not be read as {builder} ({type(error).__name__}: {error})"


def _json_lines(path: Path) -> bool:
    """Whether a ``.json`` file is JSON Lines, as datasets reads one too: its first non-blank line is a JSON object
    by itself."""
    with path.open(errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _load_raw(ref: DatasetRef) -> Dataset | DatasetDict:
    import datasets

    # Stages cache by manifest, not by datasets' cache files, and map() on a dataset loaded from disk would
    # otherwise write cache-*.arrow files into the *input* directory, another stage's output.
    datasets.disable_caching()

    if ref.kind == "dir":
        path = Path(ref.location)
        if not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            raise PipelineError(
                f"{ref.location}: not a dataset directory (no dataset_info.json or dataset_dict.json); "
                "pass a directory written by a stage or by Dataset.save_to_disk, or a .jsonl/.parquet file"
            )
        with reading("dataset", path, REWRITE_HINT):
            ds = datasets.load_from_disk(str(path))
        _check_rows(ref, ds)
    elif ref.kind == "file":
        builder = FILE_SUFFIXES[Path(ref.location).suffix]
        try:
            ds = datasets.load_dataset(builder, data_files=ref.location, split="train")
        except Exception as e:  # datasets wraps JSON/Arrow parse errors in several exception types
            raise PipelineError(_unreadable_file(Path(ref.location), builder, e)) from e
    else:
        try:
            ds = datasets.load_dataset(ref.location, name=ref.config, revision=_hub_revision(ref))
        except Exception as e:  # offline, not found, gated, a network error: many kinds
            raise PipelineError(
                f"{ref}: no such file or directory here, and it did not load as a Hub dataset ({type(e).__name__}: "
                f"{redact(first_line(e))}); check the path, or the dataset id, HF_TOKEN and the network "
                "(HF_HUB_OFFLINE unset)") from e
    if ref.split is not None:
        if not isinstance(ds, datasets.DatasetDict) or ref.split not in ds:
            have = ", ".join(ds) if isinstance(ds, datasets.DatasetDict) else "none"
            raise PipelineError(f"{ref}: no split '{ref.split}' (splits: {have})")
        return ds[ref.split]
    return ds


def _check_rows(ref: DatasetRef, ds: Dataset | DatasetDict) -> None:
    """A stage's output holds the rows its manifest counted: a data file cut short at a record batch's end reads
    without an error, with fewer rows."""
    manifest = read_manifest(ref)
    if manifest is None or "rows_out" not in manifest or manifest.get("stage") in (None, *TRAINING_STAGES):
        return
    expected = manifest["rows_out"]
    have = {split: d.num_rows for split, d in ds.items()} if isinstance(expected, dict) and hasattr(ds, "items") \
        else getattr(ds, "num_rows", None)
    if have != expected:
        raise PipelineError(f"{ref.location}: holds {have} rows where its {MANIFEST} counted {expected}: a data file is "
                            f"damaged or incomplete; {REWRITE_HINT}")


def load_dataset_ref(ref: DatasetRef) -> Dataset:
    """Load one split. A source with a single split yields it; several splits need ``REF:SPLIT``."""
    import datasets

    ds = _load_raw(ref)
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise PipelineError(f"{ref}: has splits {', '.join(ds)}; choose one, e.g. {ref}:{next(iter(ds))}")
        ds = next(iter(ds.values()))
    return ds


def load_dataset_dict(ref: DatasetRef, required: tuple[str, ...] = ()) -> DatasetDict:
    """Load every split of a source, checking that the ``required`` ones are there."""
    import datasets

    ds = _load_raw(ref)
    if not isinstance(ds, datasets.DatasetDict):
        ds = datasets.DatasetDict({"train": ds})
    missing = [s for s in required if s not in ds]
    if missing:
        raise PipelineError(f"{ref}: missing split(s) {', '.join(missing)} (splits: {', '.join(ds)})")
    return ds


def read_manifest(ref: DatasetRef, warn_offline: bool = True) -> dict[str, Any] | None:
    """The manifest of a stage output, or None for data that no stage wrote. A Hub dataset's manifest out of reach
    (offline and not cached) is None too, with a warning once unless not ``warn_offline``."""
    if ref.kind == "dir":
        path = Path(ref.location) / MANIFEST
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as e:
            raise PipelineError(f"{path}: damaged ({type(e).__name__}: {e}); {REWRITE_HINT}") from e
    if ref.kind == "hub":
        path = hub_manifest_file(ref.config)
        return _hub_json(ref.location, path, repo_type="dataset", revision=ref.revision, owner=str(ref),
                         offline_ok=f"{ref}: its {path} is neither in the Hub cache nor reachable; what it records "
                                    "(sampling, shard, rows) is not checked (unset HF_HUB_OFFLINE to check it)"
                                    if warn_offline else "")
    return None


_WARNED: set[str] = set()


def _hub_json(repo_id: str, path: str, *, repo_type: str, revision: str | None, owner: str,
              offline_ok: str | None = None, rewrite: str = REWRITE_HINT) -> dict[str, Any] | None:
    """A JSON file of a Hub repo, or None when there is none (no such repo, branch or file). Not reaching the Hub
    (offline or unreachable, and not cached) is one line: an error, or, given ``offline_ok``, that warning (once per
    process; none when empty) and None. ``owner`` names the repo in messages, ``rewrite`` the fix of a damaged file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        local = hf_hub_download(repo_id, path, repo_type=repo_type, revision=revision)
    except LocalEntryNotFoundError as e:  # offline (HF_HUB_OFFLINE) or unreachable, and not in the cache
        if offline_ok is None:
            raise PipelineError(f"{owner}: could not read its {path} ({redact(first_line(e))}); check the network "
                                "and that HF_HUB_OFFLINE is not set") from None
        if offline_ok and offline_ok not in _WARNED:
            _WARNED.add(offline_ok)
            log.warning(offline_ok)
        return None
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return None
    except Exception as e:  # the Hub's and the network's other errors
        raise PipelineError(f"{owner}: could not read its {path} ({type(e).__name__}: {redact(first_line(e))}); "
                            "check HF_TOKEN and the network") from None
    try:
        return json.loads(Path(local).read_text())
    except ValueError as e:
        raise PipelineError(f"{owner}: its {path} is damaged ({e}); {rewrite}") from None


@functools.cache
def hub_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit that ``revision`` (None: the main branch) of a Hub dataset names, asked once per process, so that a
    stage records the commit it loads, and loads one commit even while someone pushes to the branch. Offline or out
    of reach, the commit the local Hub cache last saw there, where it knows one; None when neither knows (offline,
    ``datasets`` then loads the version it cached last), or the Hub says there is no such repo or revision (loading
    says so)."""
    if revision is not None and _COMMIT.fullmatch(revision):
        return revision
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return huggingface_hub.HfApi().dataset_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S).sha
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError):
        return None
    except Exception:  # offline, unreachable, the Hub's other errors: what the cache knows
        pass
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    cached = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="dataset") / "refs" / (
        revision or "main")
    with contextlib.suppress(OSError, UnicodeDecodeError):
        commit = cached.read_text().strip()
        if _COMMIT.fullmatch(commit):
            return commit
    return None


def _hub_revision(ref: DatasetRef) -> str | None:
    """The revision to read a Hub dataset at: its commit where known (:func:`hub_commit`), else as given."""
    return hub_commit(ref.location, ref.revision) or ref.revision


def _by_request(ref: DatasetRef) -> str:
    """A Hub dataset's fingerprint by the revision asked for: all there is when no commit is known, and all there
    was in manifests written before commits were resolved."""
    return f"hub:{ref.location}{'#' + ref.config if ref.config else ''}@{ref.revision or 'main'}"


def fingerprint(ref: DatasetRef) -> str:
    """A string that changes whenever the referenced data changes.

    Stage outputs carry a fresh ``output_id`` in their manifest each time they are written, on the Hub too; other
    directories use the fingerprints ``datasets`` stores in ``state.json``; files are hashed; other Hub datasets are
    named by the revision asked for (``@COMMIT`` pins one). Not by the commit a branch names: a commit covers the
    whole repo, so a README edit or another configuration pushed would count as new data, and a resumed run would
    refuse its finished stages. :func:`input_record` records that commit beside the fingerprint.
    """
    if ref.kind in ("dir", "hub"):
        manifest = read_manifest(ref, warn_offline=False)  # out of reach offline: a user's dataset has none
        if manifest is not None and isinstance(manifest.get("output_id"), str):
            return manifest["output_id"]
    if ref.kind == "dir":
        path = Path(ref.location)
        states = sorted(path.rglob("state.json"))
        h = hashlib.sha256()
        for state in states:
            h.update(json.loads(state.read_text()).get("_fingerprint", "").encode())
        return "datasets:" + h.hexdigest()[:32]
    if ref.kind == "file":
        return "sha256:" + sha256_file(Path(ref.location))
    return _by_request(ref)


def input_record(ref: DatasetRef) -> dict[str, Any]:
    """How a manifest records an input: as given, its kind, its data's fingerprint, and the split it names (two splits
    of one source are different data with one fingerprint); a Hub dataset's commit too, where known (the data the
    stage read)."""
    record = {"ref": str(ref), "kind": ref.kind, "fingerprint": fingerprint(ref), "split": ref.split}
    if ref.kind == "hub":
        record["commit"] = hub_commit(ref.location, ref.revision)
    return record


def same_inputs(recorded: list[dict[str, Any]], inputs: list[dict[str, Any]]) -> bool:
    """Whether the inputs of a manifest (``recorded``) are the same data as ``inputs`` (:func:`input_record`'s): each
    the same input (:func:`same_input`), and the same splits where the record has them (a manifest from before they
    were recorded has none, and is not held to them)."""
    return len(recorded) == len(inputs) and all(
        same_input(r, i) and ("split" not in r or r["split"] == i.get("split")) for r, i in zip(recorded, inputs))


def same_input(recorded: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a recorded input is the same data as one now: the same fingerprint; or, for a Hub stage output, its
    ``output_id`` on one side and the revision asked for on the other (how records made it before outputs on the
    Hub were fingerprinted by their manifests, and all there is offline with the manifest out of reach), both of
    the same Hub reference."""
    if recorded["fingerprint"] == now["fingerprint"]:
        return True
    if now.get("kind") != "hub":
        return False
    named = []
    for record in (recorded, now):
        match = _HUB_ID.match(str(record.get("ref", "")))
        named.append(match and _by_request(DatasetRef("hub", match["repo"], revision=match["revision"],
                                                      config=match["config"])))
    if named[0] is None or named[0] != named[1]:
        return False
    recorded_hub = recorded.get("kind", "hub" if recorded["fingerprint"].startswith("hub:") else None) == "hub"
    return recorded_hub and named[0] in (recorded["fingerprint"], now["fingerprint"])


# The manifest's record of the other stages' outputs a run's options name (a policy, a reference, a baseline).
USED_OUTPUTS = "used_outputs"


def used_outputs(config: Any) -> dict[str, str]:
    """``{option: output_id}`` of every finished stage output that an option of ``config`` names, besides
    ``--output``: the policy a stage samples from or trains, a reference or critic model, an earlier evaluation as
    the baseline. Written again (a policy retrained into its directory), an output gets a new id, so a run that
    used it counts as changed and is redone: what it made came from the old one. Directories that no stage wrote
    (a model from the Hub) are not in it."""
    found: dict[str, str] = {}
    for key, value in semantic_dict(config).items():
        values = value if isinstance(value, list) else [value]
        for k, v in enumerate(values):
            if key == "output" or not isinstance(v, str) or not v:
                continue
            manifest = Path(v).expanduser() / MANIFEST
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                if manifest.is_file():
                    found[key if len(values) == 1 else f"{key}[{k}]"] = json.loads(manifest.read_text())["output_id"]
    return found


def find_in_lineage(inputs: list[DatasetRef], key: str) -> Any:
    """A value (e.g. ``sampling``) recorded in the nearest upstream manifest that has it, or None."""
    for ref in inputs:
        manifest = read_manifest(ref)
        if manifest is not None and manifest.get(key) is not None:
            return manifest[key]
    return None


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a hidden temporary sibling of ``path`` to fill; on success it replaces ``path`` in one rename.

    On any failure (Ctrl-C included) the temporary directory is removed and an existing ``path`` is left as it
    was, so readers only ever see a complete directory or none. What a killed write left (SIGKILL runs no cleanup)
    is removed first.
    """
    clean_stale(path, streams=False)  # the rows being saved may be in a scratch_writer's file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        flush_tree(tmp)  # the rename below must not reach the disk before what it publishes
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        sync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


class ScratchWriter:
    """Rows written a batch at a time to an Arrow file (``datasets``' own ``ArrowWriter``), read back memory-mapped
    by :meth:`finish`: what a stage makes row by row is never all in memory at once."""

    def __init__(self, file: Path, features):
        from datasets.arrow_writer import ArrowWriter

        self.file = file
        self.writer = ArrowWriter(features=features, path=str(file))
        self.rows = 0

    def write(self, columns: dict[str, list]) -> None:
        self.writer.write_batch(columns)
        self.rows += len(next(iter(columns.values()), []))

    def finish(self) -> Dataset:
        from datasets import Dataset

        self.writer.finalize()
        self.writer.close()
        return Dataset.from_file(str(self.file))


class Parts:
    """The finished pieces of an output that a stage fills in place (``OUTPUT/parts/``, :data:`layout.PARTS_DIR`),
    each kept as it completes so that a rerun of an interrupted run reuses it: ``KEY.arrow`` (the rows, an Arrow file
    read back memory-mapped) and ``KEY.json`` (what the stage notes about how it was made). A piece is written under a
    temporary name and renamed into place once flushed, so a kill leaves it whole or absent. The stage's final save
    replaces the directory, and the pieces with it."""

    def __init__(self, directory: Path, features):
        self.directory, self.features = Path(directory), features
        self.directory.mkdir(parents=True, exist_ok=True)
        for cut in self.directory.glob(".*.tmp-*"):  # a piece a kill cut short while it was written
            cut.unlink(missing_ok=True)

    def get(self, key: str) -> tuple[Dataset, dict[str, Any]] | None:
        """A finished piece and its notes, or None (never written, or unreadable: it is made again)."""
        from datasets import Dataset

        rows, notes = self.directory / f"{key}.arrow", self.directory / f"{key}.json"
        if not rows.is_file() or not notes.is_file():
            return None
        try:
            return Dataset.from_file(str(rows)), json.loads(notes.read_text())
        except Exception as e:  # damaged on the disk since: made again rather than trusted
            log.warning("%s: unreadable (%s); making it again", rows, first_line(e))
            rows.unlink(missing_ok=True)
            return None

    def write(self, key: str, columns: dict[str, list], notes: dict[str, Any]) -> Dataset:
        """Keep a finished piece (its rows as ``columns``), and return it as a dataset."""
        from datasets import Dataset
        from datasets.arrow_writer import ArrowWriter

        final = self.directory / f"{key}.arrow"
        tmp = self.directory / f".{key}.arrow.tmp-{os.getpid()}"
        final.unlink(missing_ok=True)  # a piece made again is absent until whole: never old rows with new notes
        writer = ArrowWriter(features=self.features, path=str(tmp))
        writer.write_batch(columns)
        writer.finalize()
        writer.close()
        write_text_atomic(self.directory / f"{key}.json", json.dumps(notes) + "\n")
        flush_files(self.directory, [tmp.name, f"{key}.json"])  # this piece's files alone: not every piece again
        os.replace(tmp, final)  # the rows last: a piece is finished when its .arrow is there
        sync_dir(self.directory)
        return Dataset.from_file(str(final))


class OutputParts:
    """The finished pieces of a stage output filled chunk by chunk (rlhf generate's chunks of prompts, rlhf score's
    chunks of responses), for a stage whose :meth:`StageOutput.done` was called with ``resume=True``.

    - A run that continues an unfinished one (``out.resumed``) finds that run's pieces in ``OUTPUT/parts/``
      (:meth:`finished`) and makes only the others.
    - The output directory, its run record and ``parts/`` are made when the first piece is kept (:meth:`keep`):
      a run that fails before (a model that does not load) leaves nothing.
    - ``--overwrite`` of an unfinished run of other options removes it at once. A finished output that it replaces
      stays whole until the new one is saved over it: this run's pieces go to a hidden sibling
      (``.NAME.stream-*``, not resumable), removed on leaving the ``with`` block whether the run succeeded or not.

    Use it as a context manager around the stage's work and its ``out.save``."""

    def __init__(self, out: StageOutput, features):
        self.out, self.features = out, features
        replacing_finished = out.replace and (out.path / MANIFEST).exists()
        if out.replace and not replacing_finished:  # an unfinished run of other options
            shutil.rmtree(out.path)
        self.scratch = (out.path.parent / f".{out.path.name}.stream-{uuid.uuid4().hex[:8]}"
                        if replacing_finished else None)
        self.parts = Parts(out.path / PARTS_DIR, features) if out.resumed else None

    def finished(self, keys: list[str]) -> dict[str, tuple[Dataset, dict[str, Any]] | None]:
        """Each key's finished piece and its notes, None where there is none."""
        return {key: self.parts.get(key) if self.parts is not None else None for key in keys}

    def discard(self) -> None:
        """Delete the finished pieces (made in a way this run does not reuse): every piece is made again."""
        if self.parts is not None:
            shutil.rmtree(self.parts.directory)
            self.parts = None

    def keep(self, key: str, columns: dict[str, list], notes: dict[str, Any]) -> Dataset:
        """Keep a finished piece (:meth:`Parts.write`), making the output's directory and run record for the first."""
        if self.parts is None:
            if self.scratch is None:
                self.out.record_start()
            self.parts = Parts(self.scratch or self.out.path / PARTS_DIR, self.features)
        return self.parts.write(key, columns, notes)

    def close(self) -> None:
        """Remove the hidden sibling of a run that replaced a finished output (saved over it, or failed)."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> OutputParts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def scratch_writer(path: Path, features) -> Iterator[ScratchWriter]:
    """A :class:`ScratchWriter` into a hidden sibling of the output ``path`` (``.NAME.stream-*``), removed on the way
    out, and by :func:`clean_stale` after a kill. Save what it holds before leaving the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.parent / f".{path.name}.stream-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        yield ScratchWriter(scratch / "data.arrow", features)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file under a temporary name and rename it into place: readers see the old file or the new one."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, path)


def _field_defaults(config: Any) -> dict[str, Any]:
    """The JSON form of each config field's default (fields without one are left out)."""
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = json.loads(json.dumps(f.default, default=str))
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = json.loads(json.dumps(f.default_factory(), default=str))
    return out


def clean_stale(path: Path, streams: bool = True) -> None:
    """Remove temporary siblings that a killed run (SIGKILL, power loss) left next to ``path``: the new version
    being written, the old one being replaced (killed between :func:`atomic_directory`'s two renames), and the rows
    a :func:`scratch_writer` was writing (``streams``; not when the output is being saved from one). An old version
    with nothing in its place (the kill came between the renames) is put back instead: the replacement did not
    happen."""
    if not path.parent.exists():
        return
    name = glob.escape(path.name)  # an output named exp[1] or gen*: its own siblings, no one else's
    old = sorted(path.parent.glob(f".{name}.old-*"))
    new = list(path.parent.glob(f".{name}.tmp-*"))
    if old and new and not path.exists():  # the old one moved aside, the new one not yet in its place
        with contextlib.suppress(OSError):  # every process of a launch may try: the first one puts it back
            os.rename(old[-1], path)
            log.warning("restored %s from %s: an interrupted run was replacing it", path, old[-1].name)
        old = old[:-1]
    for stale in [*new, *old,
                  *(path.parent.glob(f".{name}.stream-*") if streams else [])]:
        log.info("removing %s, left by an interrupted run", stale)
        shutil.rmtree(stale, ignore_errors=True)


@functools.cache
def source_revision() -> dict[str, Any] | None:
    """The git commit of the code that runs, when it runs from a checkout (an editable install), and whether its
    tracked files differ from that commit: the package version alone names every commit of a checkout alike. None
    from an installed package, or without git."""
    import subprocess

    here = Path(__file__).resolve()
    root = here.parents[2]
    if not (root / ".git").exists():
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}  # this checkout's, not those

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10,
                              env=env).stdout.strip()

    try:
        git("ls-files", "--error-unmatch", str(here.relative_to(root)))  # a checkout of this code, not another's
        return {"commit": git("rev-parse", "HEAD"), "modified": bool(git("status", "--porcelain",
                                                                         "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


# How a directory that is not a stage's output is refused as an --output
_NOT_DELETED = "which rlhf does not delete, --overwrite or not; choose another --output, or remove it yourself"


class StageOutput:
    """The output directory of one stage run: reuse check, atomic write, manifest.

    Usage::

        out = StageOutput("score", config, inputs=[ref])
        if out.done():
            return out.path
        ...                                   # compute; nothing is written before save()
        out.save(dataset, rows_in=n, dropped={...})
    """

    def __init__(self, stage: str, config: Any, inputs: list[DatasetRef], pusher: Pusher | None = None):
        self.stage = stage
        self.pusher = pusher or push_dataset_dir  # uploads the output to --push-to-hub's repo
        self.config = config
        self.hub = HubTarget.of(config)
        self.pending_push: dict[str, Any] | None = None  # a finished run's upload left for later (done)
        self.inputs = inputs
        self.path = Path(config.output).expanduser()
        self.started = time.time()
        self.resumed = False  # done() found an unfinished run of this config and this run continues it
        self.input_records = [input_record(r) for r in inputs]
        self.used_outputs = used_outputs(config)

    def differences(self, manifest: dict[str, Any], used: bool = True) -> list[str]:
        """What differs between this run and the one recorded in ``manifest`` (empty when they match); ``used``: the
        outputs of other stages it names too (:func:`used_outputs`; not for an unfinished run a stage continues,
        whose parts check what they use themselves, as rlhf eval's do)."""
        diffs = []
        if manifest.get("stage") != self.stage:
            diffs.append(f"stage {manifest.get('stage')!r} -> {self.stage!r}")
        old = manifest.get("config", {})
        defaults = _field_defaults(self.config)
        for key, value in json.loads(json.dumps(semantic_dict(self.config))).items():
            if key not in old and key in defaults and value == defaults[key]:
                continue  # an option added since that run, left at its default: the same run
            if old.get(key) != value:
                diffs.append(f"{key} {old.get(key)!r} -> {value!r}")
        if not same_inputs(manifest.get("inputs", []), self.input_records):
            diffs.append("the input data changed")
        recorded = (manifest.get(USED_OUTPUTS) or {}) if used else {}  # none (an older run's): not held against it
        diffs += [f"{key} was made again since" for key in sorted(set(recorded) & set(self.used_outputs))
                  if recorded[key] != self.used_outputs[key]]
        return diffs

    def done(self, resume: bool | None = None, push: bool = True, parts_check_themselves: bool = False,
             push_later: bool = False) -> bool:
        """True when the output already holds this exact run; raises when it holds another one.

        ``resume`` is for stages that fill their output in place (training): True continues an unfinished output
        (no manifest yet) when it was started with the same config and inputs, False refuses it with a hint to pass
        ``--resume``; None means the stage cannot resume. A run continued so is held to the outputs of other stages it
        named when it started (a policy retrained into its ``--model`` since), unless ``parts_check_themselves``
        (rlhf eval, whose finished parts are outputs that check what they use). Afterwards ``self.replace`` says
        whether an existing output must be removed before the run starts (``--overwrite``), and ``self.resumed``
        whether this run continues an unfinished one (its manifest then says ``"resumed": true``: its wall time is
        this attempt's alone).

        A finished output whose ``--push-to-hub`` upload is still pending is uploaded now (``push``; by the main
        process), without recomputing anything; with ``push_later`` the main process keeps its manifest in
        ``self.pending_push`` instead, for the caller to upload once the other processes no longer wait for it (a
        training stage: after its process group is gone).
        """
        self.replace = self.resumed = False
        clean_stale(self.path)
        if not self.path.exists():
            return False
        if not self.path.is_dir():
            raise PipelineError(f"--output {self.path}: exists and is a file; choose a directory path")
        self._refuse_writing_over_an_input()
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            started = self.path / RUN_RECORD
            for cut in [*self.path.glob(f".{RUN_RECORD}.tmp-*"), *self.path.glob(f".{MANIFEST}.tmp-*")]:
                cut.unlink(missing_ok=True)  # a record a kill cut short while write_text_atomic wrote it
            if not started.exists():
                if not any(self.path.iterdir()):
                    return False  # an empty directory (a mount point, say): written into, not deleted
                # files no stage wrote (a model, a dataset of the user's, a folder of other things): never deleted
                # here, nor written into
                raise PipelineError(f"--output {self.path}: exists and holds files that are not a stage's output (no "
                                    f"{MANIFEST} or {RUN_RECORD}), {_NOT_DELETED}")
            record = self._stage_record(started, json.loads(started.read_text()))
            if resume:
                diffs = self.differences(record, used=not parts_check_themselves)
                if not diffs:
                    self.resumed = True
                    return False
                if not self.config.overwrite:
                    raise PipelineError(
                        f"--output {self.path}: its unfinished run was started with another config or inputs "
                        f"({'; '.join(diffs)}); pass --overwrite to start over, or resume with the same options"
                    )
            if self.config.overwrite:  # an unfinished run: --overwrite starts it over
                self.replace = True
                return False
            hint = "pass --resume to continue it, or --overwrite to start over" if resume is False else (
                "pass --overwrite to start over")
            raise PipelineError(f"--output {self.path}: holds an unfinished run (no {MANIFEST}); {hint}")
        manifest = self._stage_record(manifest_path, read_manifest(DatasetRef("dir", str(self.path))))
        diffs = self.differences(manifest)
        if not diffs:
            log.info("%s: %s already holds this run (same config and inputs); skipping", self.stage, self.path)
            pending = push and self.push_pending(manifest)
            print(f"[{self.stage}] {self.path} is complete for this config and inputs; "
                  f"{f'pushing it to {self.hub}' if pending else 'nothing to do'}")
            if pending and _main_process():
                if push_later:
                    self.pending_push = manifest
                else:
                    self.push(manifest)
            return True
        if self.config.overwrite:
            log.info("%s: replacing %s (%s)", self.stage, self.path, "; ".join(diffs))
            self.replace = True
            return False
        raise PipelineError(
            f"--output {self.path}: holds a {self.stage} run with a different config or inputs "
            f"({'; '.join(diffs)}); pass --overwrite to replace it or choose another --output"
        )

    def _stage_record(self, path: Path, record: Any) -> dict[str, Any]:
        """``record``, read from ``path`` (the output's manifest or run record), when a stage wrote it: else the
        directory is not a stage's output (a web app's manifest.json, say), and is neither replaced nor written
        into, --overwrite or not."""
        if (isinstance(record, dict) and isinstance(record.get("stage"), str) and isinstance(record.get("config"), dict)
                and isinstance(record.get("inputs"), list)):
            return record
        raise PipelineError(f"--output {self.path}: its {path.name} is not one a stage wrote (no stage, config and "
                            f"inputs), so the directory is not a stage's output, {_NOT_DELETED}")

    def _refuse_writing_over_an_input(self) -> None:
        """An --output that is, or holds, something this run reads (its input data, a model, a tokenizer, a
        baseline: any option naming a local path) is refused, --overwrite or not: replacing it would delete it."""
        out = self.path.resolve()
        named = [r.location for r in self.inputs if r.kind != "hub"]
        for key, value in to_dict(self.config).items():
            if key != "output":
                for v in (value if isinstance(value, list) else [value]):
                    if isinstance(v, str) and v:
                        named += [v, v.rsplit(":", 1)[0]] if ":" in v else [v]  # a reward function's FILE.py:fn
        for text in named:
            path = Path(text).expanduser()
            if path.exists() and (path.resolve() == out or out in path.resolve().parents):
                what = "is" if path.resolve() == out else "holds"
                raise PipelineError(f"--output {self.path}: {what} {text}, which this run reads; choose another "
                                    "--output (a stage never writes over its own inputs)")

    def record_start(self) -> None:
        """For outputs filled in place: note the config and inputs, so that ``--resume`` can check them."""
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"stage": self.stage, "config": to_dict(self.config), "inputs": self.input_records,
                  USED_OUTPUTS: self.used_outputs}
        # atomically: a record truncated by a kill would make the output unreadable to --resume and --overwrite
        write_text_atomic(self.path / RUN_RECORD, json.dumps(record, indent=2, default=str) + "\n")

    def push_pending(self, manifest: dict[str, Any] | None = None) -> bool:
        """Whether ``--push-to-hub`` asks for an upload (to that repo and ``--hub-config``) that this output has not
        had yet."""
        if self.hub is None:
            return False
        if manifest is None:
            manifest = read_manifest(DatasetRef("dir", str(self.path))) or {}
        return manifest.get(PUSH) != self.hub.record(pushed=True)

    def push(self, manifest: dict[str, Any]) -> None:
        """Upload the finished output to ``--push-to-hub``'s repo with its manifest, then record in the local
        manifest that it was pushed. A failure is one line; the manifest then records the push as pending, so that
        the same command run again uploads it without recomputing anything."""
        hub = self.hub
        pushed = dict(manifest, **{PUSH: hub.record(pushed=True)})
        try:
            self.pusher(self.path, hub, (json.dumps(pushed, indent=2, default=str) + "\n").encode())
        except Exception as e:  # the Hub's and the network's errors are many kinds
            manifest[PUSH] = hub.record(pushed=False)
            write_text_atomic(self.path / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")
            raise PipelineError(
                f"--push-to-hub {hub}: the upload failed ({type(e).__name__}: {redact(first_line(e))}); {self.path} "
                f"is complete and its {MANIFEST} records the push as pending: run the same command again to upload "
                "it (nothing is recomputed); check HF_TOKEN, the network, and that HF_HUB_OFFLINE is not set"
            ) from None
        write_text_atomic(self.path / MANIFEST, json.dumps(pushed, indent=2, default=str) + "\n")
        where = f" ({'configuration' if _hub_kind(self.pusher) else 'branch'} {hub.config})" if hub.config else ""
        print(f"[{self.stage}] pushed to https://huggingface.co/{_hub_kind(self.pusher)}{hub.repo_id}{where}")

    def manifest(
        self,
        *,
        rows_in: int,
        rows_out: int | dict[str, int],
        dropped: dict[str, int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The manifest of this run (``wall_time_s`` is added when it is written)."""
        return {
            "stage": self.stage,
            "version": __version__,
            **({"source": source_revision()} if source_revision() else {}),
            "output_id": uuid.uuid4().hex,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": to_dict(self.config),
            "inputs": self.input_records,
            USED_OUTPUTS: self.used_outputs,
            "rows_in": rows_in,
            "rows_out": rows_out,
            "dropped": dict(sorted((dropped or {}).items())),
            **(extra or {}),
            **({PUSH: self.hub.record(pushed=False)} if self.hub else {}),
        }

    def write_manifest(self, manifest: dict[str, Any], directory: Path | None = None) -> None:
        """Stamp the wall time (this attempt's: ``"resumed": true`` when it continued an unfinished run) and write
        ``manifest.json`` into ``directory`` (default: the output, for outputs filled in place such as a training run,
        where it marks the run complete)."""
        manifest["wall_time_s"] = round(time.time() - self.started, 3)
        if self.resumed:
            manifest["resumed"] = True
        directory = self.path if directory is None else directory
        write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")

    def save(
        self,
        data: Dataset | DatasetDict,
        *,
        rows_in: int,
        dropped: dict[str, int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write ``data`` and its manifest atomically, then push to the Hub if asked."""
        import datasets

        rows_out = (
            {split: d.num_rows for split, d in data.items()}
            if isinstance(data, datasets.DatasetDict)
            else data.num_rows
        )
        manifest = self.manifest(rows_in=rows_in, rows_out=rows_out, dropped=dropped, extra=extra)
        with writing(self.path, needed=_nbytes(data)), atomic_directory(self.path) as tmp:
            data.save_to_disk(str(tmp))
            self.write_manifest(manifest, tmp)
        return self.published(manifest)

    def published(self, manifest: dict[str, Any]) -> Path:
        """Say that the output is written (its manifest in place), then push it to the Hub if asked."""
        print(f"[{self.stage}] wrote {self.path} ({_rows_text(manifest['rows_out'])}) in {manifest['wall_time_s']:.1f}s")
        if self.push_pending(manifest):
            self.push(manifest)
        return self.path


def _rows_text(rows_out: int | dict[str, int]) -> str:
    if isinstance(rows_out, dict):
        return ", ".join(f"{split}: {n} rows" for split, n in rows_out.items())
    return f"{rows_out} rows"


PUSH = "push"  # the manifest's record of --push-to-hub: {"repo_id": ..., ["config": ...,] "pushed": true/false}


@dataclasses.dataclass(frozen=True)
class HubTarget:
    """Where ``--push-to-hub`` sends an output: the repo, the place in it (``--hub-config``: a configuration of a
    dataset repo, a branch of a model repo; None: the default configuration, the main branch) and whether a repo
    the upload creates is private (``--private``)."""

    repo_id: str
    config: str | None = None
    private: bool = False

    @classmethod
    def of(cls, config: Any) -> HubTarget | None:
        """The target a stage's options name, or None without ``--push-to-hub``."""
        repo, place = getattr(config, "push_to_hub", None), getattr(config, "hub_config", None)
        if not repo:
            if place or getattr(config, "private", False):
                raise PipelineError(f"--{'hub-config ' + place if place else 'private'} without --push-to-hub: "
                                    "give --push-to-hub ORG/NAME too, or leave it out")
            return None
        if place is not None and not re.fullmatch(r"[\w.-]+", place):
            raise PipelineError(f"--hub-config {place}: use letters, digits, '_', '-' and '.' only (e.g. iter1-score)")
        error = repo_id_error(repo, "--push-to-hub")
        if error:
            raise PipelineError(error)
        return cls(repo, place, bool(getattr(config, "private", False)))

    def __str__(self) -> str:
        return self.repo_id + (f"#{self.config}" if self.config else "")

    def record(self, pushed: bool) -> dict[str, Any]:
        """The manifest's ``push`` entry (the configuration only when there is one, as before it existed)."""
        return {"repo_id": self.repo_id, **({"config": self.config} if self.config else {}), "pushed": pushed}

    def manifest_file(self, model: bool) -> tuple[str, str | None]:
        """Where the manifest is uploaded: (path in the repo, revision). A dataset repo holds one per configuration
        (``manifests/CONFIG.json``); a model repo's is ``manifest.json`` on its branch."""
        return (MANIFEST, self.config) if model else (hub_manifest_file(self.config), None)


def repo_id_error(repo: str, flag: str) -> str | None:
    """Why ``repo`` is not a Hub repo id (huggingface_hub's own check), or None. The value is quoted only when it
    cannot hold a credential (a URL's ``user:token@``): such a value would otherwise reach the manifest, iterate's
    stage command lines and this message."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
        return None
    except HFValidationError:
        quoted = f" {repo}" if re.fullmatch(r"[\w./ -]*", repo) else ""
        return (f"{flag}{quoted}: not a Hub repo id; give ORG/NAME (letters, digits, '-', '_' and '.'), not a URL: "
                "the token comes from HF_TOKEN")


def hub_manifest_file(config: str | None) -> str:
    """The path of a dataset repo's manifest of ``config`` (the default configuration's: ``manifest.json``)."""
    return f"{HUB_MANIFESTS}/{config}.json" if config else MANIFEST


Pusher = Callable[[Path, HubTarget, bytes], None]  # (output directory, target, the manifest to upload beside it)


def push_dataset_dir(path: Path, hub: HubTarget, manifest: bytes) -> None:
    """Upload a finished dataset output and its manifest to a Hub dataset repo, as the configuration
    ``hub.config`` (if any). The token is read from the environment (HF_TOKEN) by huggingface_hub.

    The configuration's earlier manifest is deleted first and the new one uploaded last, as for a model
    (``training.stage.push_model_to_hub``): a push cut short between the data and the manifest leaves the
    configuration without one, which reads as not pushed, never an earlier run's manifest beside new data."""
    import datasets
    from huggingface_hub import HfApi

    log.info("pushing %s to the Hub dataset repo %s", path, hub)
    api, manifest_path = HfApi(), hub.manifest_file(model=False)[0]
    if api.file_exists(hub.repo_id, manifest_path, repo_type="dataset"):
        api.delete_file(manifest_path, hub.repo_id, repo_type="dataset",
                        commit_message=f"rlhf: replacing the {hub.config or 'default'} configuration")
    datasets.load_from_disk(str(path)).push_to_hub(
        hub.repo_id, **({"config_name": hub.config} if hub.config else {}), private=hub.private or None
    )
    api.upload_file(path_or_fileobj=manifest, path_in_repo=manifest_path, repo_id=hub.repo_id, repo_type="dataset")


push_dataset_dir.hub_kind = "datasets/"  # type: ignore[attr-defined]


def _hub_kind(pusher: Pusher) -> str:
    return getattr(pusher, "hub_kind", "")


def hub_manifest(hub: HubTarget, model: bool) -> dict[str, Any] | None:
    """The manifest that ``--push-to-hub`` uploaded to ``hub`` (a model repo's branch when ``model``), or None when
    there is none (no such repo, branch or file: nothing finished was pushed there). Not reaching the Hub is one
    line."""
    path, revision = hub.manifest_file(model)
    return _hub_json(hub.repo_id, path, repo_type="model" if model else "dataset", revision=revision,
                     owner=f"--push-to-hub {hub}", rewrite="push the stage again")


def pull_output(hub: HubTarget, path: Path, manifest: dict[str, Any], model: bool) -> None:
    """Make ``path`` the stage output that ``--push-to-hub`` uploaded to ``hub`` (``manifest``, read from there, is
    written beside it): the dataset, its splits as the stage wrote them, or the model repo's branch; atomically, as
    a stage writes its output."""
    print(f"pulling {path} from the Hub ({hub})", flush=True)
    with atomic_directory(path) as tmp:
        try:
            if model:
                from huggingface_hub import snapshot_download

                snapshot_download(hub.repo_id, repo_type="model", revision=hub.config, local_dir=str(tmp))
                shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's download records
            else:
                import datasets

                data = datasets.load_dataset(hub.repo_id, name=hub.config)
                if not isinstance(manifest.get("rows_out"), dict):  # a single dataset, pushed as the split "train"
                    data = next(iter(data.values()))
                data.save_to_disk(str(tmp))
        except Exception as e:  # the Hub's and the network's errors are many kinds
            if is_disk_full(e):  # the local disk: one line of its own (files.writing)
                raise
            raise PipelineError(
                f"--push-to-hub {hub}: pulling the finished {path.name} to {path} failed ({type(e).__name__}: "
                f"{redact(first_line(e))}); nothing was written there: check HF_TOKEN and the network, then run the "
                "same command again"
            ) from None
        write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")


def _main_process() -> bool:
    """The main process of a launch (or the only process): the one that uploads."""
    return os.environ.get("RANK", "0") == "0"


def _nbytes(data: Dataset | DatasetDict) -> int | None:
    try:
        parts = data.values() if hasattr(data, "values") else [data]
        return sum(d.data.nbytes for d in parts)
    except Exception:  # an estimate for the error line only
        return None
