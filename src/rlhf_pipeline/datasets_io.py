"""Dataset references, loading, and the atomic, self-describing outputs every stage writes.

A reference (``REF``) is one of:

* a local directory in the ``datasets.save_to_disk`` layout (what every stage writes);
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file;
* a Hub dataset id ``ORG/NAME``, optionally ``ORG/NAME:SPLIT`` and ``ORG/NAME@REVISION``.

A local directory or Hub id holding several splits takes ``:SPLIT`` too (``runs/iter_0/filter:train``).

An output directory holds the dataset and a ``manifest.json`` that is written last: its presence means the stage
completed. It records the stage, the package version, the full config, the inputs with their fingerprints, row
counts in and out, rows dropped per reason and the wall time. Outputs are written to a hidden temporary sibling
and renamed into place, so a crash never leaves a half-written output behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from rlhf_pipeline import __version__
from rlhf_pipeline.config import semantic_dict, to_dict
from rlhf_pipeline.errors import PipelineError

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RUN_RECORD = "run_started.json"  # an in-place output's config and inputs, written when it starts
FILE_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<split>[\w.-]+))?(?:@(?P<revision>[\w./-]+))?$")


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """A parsed dataset reference. ``kind`` is ``dir``, ``file`` or ``hub``."""

    kind: str
    location: str
    split: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        text = self.location
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
        if path.suffix not in FILE_SUFFIXES:
            raise PipelineError(
                f"{text}: unsupported file type '{path.suffix}'; use .json, .jsonl, .parquet or a save_to_disk directory"
            )
        return DatasetRef("file", str(path))
    match = _HUB_ID.match(text)
    looks_local = text.startswith((".", "/", "~")) or Path(text).suffix in FILE_SUFFIXES or text.count("/") != 1
    if match and not looks_local:
        return DatasetRef("hub", match["repo"], split=match["split"], revision=match["revision"])
    raise PipelineError(f"{text}: no such file or directory, and not a Hub dataset id (ORG/NAME[:SPLIT][@REVISION])")


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
        ds = datasets.load_from_disk(str(path))
    elif ref.kind == "file":
        builder = FILE_SUFFIXES[Path(ref.location).suffix]
        try:
            ds = datasets.load_dataset(builder, data_files=ref.location, split="train")
        except Exception as e:  # datasets wraps JSON/Arrow parse errors in several exception types
            raise PipelineError(f"{ref.location}: could not be read as {builder} ({type(e).__name__}: {e})") from e
    else:
        ds = datasets.load_dataset(ref.location, revision=ref.revision)
    if ref.split is not None:
        if not isinstance(ds, datasets.DatasetDict) or ref.split not in ds:
            have = ", ".join(ds) if isinstance(ds, datasets.DatasetDict) else "none"
            raise PipelineError(f"{ref}: no split '{ref.split}' (splits: {have})")
        return ds[ref.split]
    return ds


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


def read_manifest(ref: DatasetRef) -> dict[str, Any] | None:
    """The manifest of a stage output, or None for data that no stage wrote."""
    if ref.kind == "dir":
        path = Path(ref.location) / MANIFEST
        return json.loads(path.read_text()) if path.exists() else None
    if ref.kind == "hub":
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            local = hf_hub_download(ref.location, MANIFEST, repo_type="dataset", revision=ref.revision)
        except EntryNotFoundError:
            return None
        return json.loads(Path(local).read_text())
    return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(ref: DatasetRef) -> str:
    """A string that changes whenever the referenced data changes.

    Stage outputs carry a fresh ``output_id`` in their manifest each time they are written; other directories use
    the fingerprints ``datasets`` stores in ``state.json``; files are hashed; Hub ids use the requested revision.
    """
    if ref.kind == "dir":
        path = Path(ref.location)
        manifest = read_manifest(ref)
        if manifest is not None:
            return manifest["output_id"]
        states = sorted(path.rglob("state.json"))
        h = hashlib.sha256()
        for state in states:
            h.update(json.loads(state.read_text()).get("_fingerprint", "").encode())
        return "datasets:" + h.hexdigest()[:32]
    if ref.kind == "file":
        return "sha256:" + _sha256_file(Path(ref.location))
    return f"hub:{ref.location}@{ref.revision or 'main'}"


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
    clean_stale(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


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


def clean_stale(path: Path) -> None:
    """Remove temporary siblings that a killed run (SIGKILL, power loss) left next to ``path``: the new version
    being written, and the old one being replaced (killed between :func:`atomic_directory`'s two renames)."""
    if path.parent.exists():
        for stale in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{path.name}.old-*")]:
            log.info("removing %s, left by an interrupted run", stale)
            shutil.rmtree(stale, ignore_errors=True)


class StageOutput:
    """The output directory of one stage run: reuse check, atomic write, manifest.

    Usage::

        out = StageOutput("score", config, inputs=[ref])
        if out.done():
            return out.path
        ...                                   # compute; nothing is written before save()
        out.save(dataset, rows_in=n, dropped={...})
    """

    def __init__(self, stage: str, config: Any, inputs: list[DatasetRef]):
        self.stage = stage
        self.config = config
        self.inputs = inputs
        self.path = Path(config.output).expanduser()
        self.started = time.time()
        self.input_records = [{"ref": str(r), "fingerprint": fingerprint(r)} for r in inputs]

    def _same_run(self, manifest: dict[str, Any]) -> list[str]:
        """What differs between this run and the one recorded in ``manifest`` (empty when they match)."""
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
        if [i["fingerprint"] for i in manifest.get("inputs", [])] != [i["fingerprint"] for i in self.input_records]:
            diffs.append("the input data changed")
        return diffs

    def done(self, resume: bool | None = None) -> bool:
        """True when the output already holds this exact run; raises when it holds another one.

        ``resume`` is for stages that fill their output in place (training): True continues an unfinished output
        (no manifest yet) when it was started with the same config and inputs, False refuses it with a hint to pass
        ``--resume``; None means the stage cannot resume. Afterwards ``self.replace`` says whether an existing
        output must be removed before the run starts (``--overwrite``).
        """
        self.replace = False
        clean_stale(self.path)
        if not self.path.exists():
            return False
        if not self.path.is_dir():
            raise PipelineError(f"--output {self.path}: exists and is a file; choose a directory path")
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            started = self.path / RUN_RECORD
            if resume and started.exists():
                diffs = self._same_run(json.loads(started.read_text()))
                if not diffs:
                    return False
                if not self.config.overwrite:
                    raise PipelineError(
                        f"--output {self.path}: its unfinished run was started with another config or inputs "
                        f"({'; '.join(diffs)}); pass --overwrite to start over, or resume with the same options"
                    )
            elif resume:
                return False
            if self.config.overwrite:
                self.replace = True
                return False
            hint = "pass --resume to continue it, or --overwrite to start over" if resume is False else (
                "remove it, choose another --output, or pass --overwrite"
            )
            raise PipelineError(
                f"--output {self.path}: exists but holds no completed stage output (no {MANIFEST}); {hint}"
            )
        diffs = self._same_run(json.loads(manifest_path.read_text()))
        if not diffs:
            log.info("%s: %s already holds this run (same config and inputs); skipping", self.stage, self.path)
            print(f"[{self.stage}] {self.path} is complete for this config and inputs; nothing to do")
            return True
        if self.config.overwrite:
            log.info("%s: replacing %s (%s)", self.stage, self.path, "; ".join(diffs))
            self.replace = True
            return False
        raise PipelineError(
            f"--output {self.path}: holds a {self.stage} run with a different config or inputs "
            f"({'; '.join(diffs)}); pass --overwrite to replace it or choose another --output"
        )

    def record_start(self) -> None:
        """For outputs filled in place: note the config and inputs, so that ``--resume`` can check them."""
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"stage": self.stage, "config": to_dict(self.config), "inputs": self.input_records}
        # atomically: a record truncated by a kill would make the output unreadable to --resume and --overwrite
        write_text_atomic(self.path / RUN_RECORD, json.dumps(record, indent=2, default=str) + "\n")

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
            "output_id": uuid.uuid4().hex,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": to_dict(self.config),
            "inputs": self.input_records,
            "rows_in": rows_in,
            "rows_out": rows_out,
            "dropped": dict(sorted((dropped or {}).items())),
            **(extra or {}),
        }

    def write_manifest(self, manifest: dict[str, Any], directory: Path | None = None) -> None:
        """Stamp the wall time and write ``manifest.json`` into ``directory`` (default: the output, for outputs
        filled in place such as a training run, where it marks the run complete)."""
        manifest["wall_time_s"] = round(time.time() - self.started, 3)
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
        with atomic_directory(self.path) as tmp:
            data.save_to_disk(str(tmp))
            self.write_manifest(manifest, tmp)
        print(f"[{self.stage}] wrote {self.path} ({_rows_text(rows_out)}) in {manifest['wall_time_s']:.1f}s")
        if self.config.push_to_hub:
            push_to_hub(data, self.path / MANIFEST, self.config.push_to_hub)
        return self.path


def _rows_text(rows_out: int | dict[str, int]) -> str:
    if isinstance(rows_out, dict):
        return ", ".join(f"{split}: {n} rows" for split, n in rows_out.items())
    return f"{rows_out} rows"


def push_to_hub(data: Dataset | DatasetDict, manifest_path: Path, repo_id: str) -> None:
    """Upload a finished output and its manifest. The token is read from the environment by huggingface_hub."""
    from huggingface_hub import HfApi

    log.info("pushing to the Hub dataset repo %s", repo_id)
    data.push_to_hub(repo_id)
    HfApi().upload_file(
        path_or_fileobj=str(manifest_path), path_in_repo=MANIFEST, repo_id=repo_id, repo_type="dataset"
    )
    print(f"pushed to https://huggingface.co/datasets/{repo_id}")
