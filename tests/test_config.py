"""Config parsing: kebab flags, YAML --config, precedence, errors, help text for every option."""

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from rlhf_pipeline.cli import STAGES
from rlhf_pipeline.config import OutputOptions, build_parser, option, parse_config, semantic_dict
from rlhf_pipeline.errors import PipelineError


@dataclass(kw_only=True)
class DemoConfig(OutputOptions):
    """A config for the tests."""

    model: str = option(help="the model")
    max_new_tokens: int = option(16, help="tokens")
    temperature: float = option(0.8, help="temperature")
    engine: Literal["auto", "hf"] = option("auto", help="engine")
    limit: Optional[int] = option(None, help="limit")
    drop_truncated: bool = option(False, help="drop")
    num_proc: int = option(0, help="procs", semantic=False)


def test_kebab_flags_and_types():
    cfg = parse_config(
        DemoConfig,
        ["--model", "m", "--output", "o", "--max-new-tokens", "32", "--temperature", "0.5", "--drop-truncated",
         "--limit", "3", "--engine", "hf"],
        "test",
    )
    assert (cfg.model, cfg.max_new_tokens, cfg.temperature, cfg.drop_truncated, cfg.limit, cfg.engine) == (
        "m", 32, 0.5, True, 3, "hf"
    )


def test_yaml_config_and_flags_override_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: from-yaml\noutput: out\nmax-new-tokens: 64\ntemperature: 1.0\n")
    cfg = parse_config(DemoConfig, ["--config", str(path), "--temperature", "0.3"], "test")
    assert cfg.model == "from-yaml"  # a required option may come from the YAML file alone
    assert cfg.max_new_tokens == 64  # dash spelling in YAML
    assert cfg.temperature == 0.3  # the flag wins


def test_yaml_unknown_key_names_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\noutput: o\ntemprature: 1.0\n")
    with pytest.raises(PipelineError, match=r"run.yaml: unknown option 'temprature'"):
        parse_config(DemoConfig, ["--config", str(path)], "test")


def test_missing_required_option_exits(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--output", "o"], "test")
    assert "--model" in capsys.readouterr().err


def test_bad_choice_exits(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--model", "m", "--output", "o", "--engine", "tpu"], "test")
    assert "invalid choice" in capsys.readouterr().err


def test_semantic_dict_leaves_out_non_semantic_fields():
    cfg = DemoConfig(model="m", output="o", num_proc=4, overwrite=True)
    keys = set(semantic_dict(cfg))
    assert "num_proc" not in keys and "overwrite" not in keys and "output" not in keys
    assert {"model", "max_new_tokens", "temperature"} <= keys


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_option_is_documented(stage):
    from rlhf_pipeline.cli import config_class

    config_cls = config_class(stage)
    help_text = build_parser(config_cls, f"rlhf {stage}").format_help()
    for f in dataclasses.fields(config_cls):
        assert f.metadata.get("help"), f"{config_cls.__name__}.{f.name} has no help text"
        assert "--" + f.name.replace("_", "-") in help_text
