"""A Hugging Face Hub on the local disk, for the tests: what the pipeline calls of ``datasets`` and ``huggingface_hub``
(``Dataset(Dict).push_to_hub``, ``HfApi``'s ``create_repo``/``create_branch``/``upload_file``/``upload_folder``,
``hf_hub_download``, ``snapshot_download``, ``load_dataset`` of a repo id) kept under one directory, so that the
stage processes ``rlhf iterate`` launches see the Hub the test sees: launch them with ``python tests/fake_hub.py``
as the launcher (it installs the fake from ``FAKE_HUB``, the directory, then runs ``-m MODULE ARGS``).

Layout: ``ROOT/<kind>/<org>/<name>/repo.json`` (``{"private": ...}``, written when the repo is created), the files of
each revision under ``ROOT/<kind>/<org>/<name>/rev/<revision>/``, and a dataset's configurations as ``save_to_disk``
directories under ``ROOT/dataset/<org>/<name>/configs/<config>/``. A file ``ROOT/fail`` naming a configuration or
branch makes every upload there fail, as offline, until it is removed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import runpy
import shutil
import sys
import types
from pathlib import Path


def install(setattr_, root: str | Path) -> None:
    """Replace the Hub calls with ones on ``root``; ``setattr_`` is ``monkeypatch.setattr`` or ``setattr``."""
    import datasets
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    root = Path(root)

    def repo(kind: str, repo_id: str, private: bool | None = None, create: bool = True) -> Path:
        path = root / kind / repo_id
        if create and not (path / "repo.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            (path / "repo.json").write_text(json.dumps({"private": bool(private)}))
        return path

    def commit_of(kind: str, repo_id: str, revision: str | None) -> str:
        """A commit id for a branch as it is now: a hash of every file it holds, and of the configurations (the fake
        keeps no history, and reads no revision by its commit)."""
        path = repo(kind, repo_id, create=False)
        h = hashlib.sha1()
        for base in (path / "rev" / (revision or "main"), path / "configs"):
            for file in sorted(f for f in base.rglob("*") if f.is_file()):
                h.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
        return h.hexdigest()

    def check(place: str | None) -> None:
        fail = root / "fail"
        if fail.exists() and fail.read_text().strip() == (place or "main"):
            raise OSError(f"cannot reach the Hub (token {os.environ.get('HF_TOKEN')})")

    def push_to_hub(self, repo_id, config_name="default", split=None, private=None, revision=None, **kw):
        check(config_name)
        data = self if isinstance(self, datasets.DatasetDict) else datasets.DatasetDict({split or "train": self})
        target = repo("dataset", repo_id, private) / "configs" / config_name
        shutil.rmtree(target, ignore_errors=True)
        data.save_to_disk(str(target))

    class HfApi:
        def dataset_info(self, repo_id, revision=None, **kw):
            if not (root / "dataset" / repo_id / "repo.json").exists():
                raise OSError(f"{repo_id}: no such dataset repo")  # as unreachable: the caller falls back alike
            return types.SimpleNamespace(id=repo_id, sha=commit_of("dataset", repo_id, revision))

        def create_repo(self, repo_id, repo_type=None, private=None, exist_ok=False, **kw):
            repo(repo_type or "model", repo_id, private)

        def create_branch(self, repo_id, branch, repo_type=None, exist_ok=False, **kw):
            check(branch)
            (repo(repo_type or "model", repo_id) / "rev" / branch).mkdir(parents=True, exist_ok=True)

        def upload_file(self, path_or_fileobj, path_in_repo, repo_id, repo_type=None, revision=None, **kw):
            check(revision or (Path(path_in_repo).stem if path_in_repo.startswith("manifests/") else None))
            target = repo(repo_type or "model", repo_id) / "rev" / (revision or "main") / path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            data = path_or_fileobj if isinstance(path_or_fileobj, bytes) else Path(path_or_fileobj).read_bytes()
            target.write_bytes(data)

        def file_exists(self, repo_id, filename, repo_type=None, revision=None, **kw):
            path = repo(repo_type or "model", repo_id, create=False) / "rev" / (revision or "main") / filename
            return path.is_file()

        def delete_file(self, path_in_repo, repo_id, repo_type=None, revision=None, **kw):
            check(revision)
            path = repo(repo_type or "model", repo_id, create=False) / "rev" / (revision or "main") / path_in_repo
            if not path.is_file():
                raise EntryNotFoundError(f"{repo_id}: no {path_in_repo} at {revision or 'main'}")
            path.unlink()

        def list_repo_files(self, repo_id, repo_type=None, revision=None, **kw):
            files = repo(repo_type or "model", repo_id, create=False) / "rev" / (revision or "main")
            return sorted(str(f.relative_to(files)) for f in files.rglob("*") if f.is_file())

        def upload_folder(self, folder_path, repo_id, repo_type=None, revision=None, ignore_patterns=(),
                          delete_patterns=None, **kw):
            check(revision)
            target = repo(repo_type or "model", repo_id) / "rev" / (revision or "main")
            patterns = [delete_patterns] if isinstance(delete_patterns, str) else delete_patterns or ()
            for name in self.list_repo_files(repo_id, repo_type, revision):  # as huggingface_hub: fnmatchcase
                if name != ".gitattributes" and any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    (target / name).unlink()
            for file in Path(folder_path).rglob("*"):
                name = str(file.relative_to(folder_path))
                if file.is_file() and not any(fnmatch.fnmatch(name, p) for p in ignore_patterns or ()):
                    (target / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, target / name)

    def hf_hub_download(repo_id, filename, repo_type=None, revision=None, **kw):
        file = repo(repo_type or "model", repo_id, create=False) / "rev" / (revision or "main") / filename
        if not file.is_file():
            raise EntryNotFoundError(f"{repo_id}: no {filename} at {revision or 'main'}")
        return str(file)

    def snapshot_download(repo_id, repo_type=None, revision=None, local_dir=None, **kw):
        source = repo(repo_type or "model", repo_id, create=False) / "rev" / (revision or "main")
        if not source.is_dir():
            raise EntryNotFoundError(f"{repo_id}: no revision {revision}")
        shutil.copytree(source, local_dir, dirs_exist_ok=True)
        return str(local_dir)

    real_load_dataset = datasets.load_dataset

    def load_dataset(path, name=None, revision=None, **kw):
        configs = root / "dataset" / str(path) / "configs"
        if not configs.is_dir():
            return real_load_dataset(path, name=name, revision=revision, **kw)
        return datasets.load_from_disk(str(configs / (name or "default")))

    for cls in (datasets.Dataset, datasets.DatasetDict):
        setattr_(cls, "push_to_hub", push_to_hub)
    setattr_(huggingface_hub, "HfApi", HfApi)
    setattr_(huggingface_hub, "hf_hub_download", hf_hub_download)
    setattr_(huggingface_hub, "snapshot_download", snapshot_download)
    setattr_(datasets, "load_dataset", load_dataset)


def is_private(root: Path, kind: str, repo_id: str) -> bool:
    return json.loads((root / kind / repo_id / "repo.json").read_text())["private"]


def hub_manifest(root: Path, repo_id: str, config: str) -> dict:
    """The manifest a dataset stage pushed as ``config`` of ``repo_id``."""
    return json.loads((root / "dataset" / repo_id / "rev" / "main" / "manifests" / f"{config}.json").read_text())


if __name__ == "__main__":  # python fake_hub.py -m MODULE ARGS: the launcher of rlhf iterate's stages
    install(setattr, os.environ["FAKE_HUB"])
    assert sys.argv[1] == "-m", sys.argv
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
