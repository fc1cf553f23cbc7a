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


def test_a_mapping_flag_overrides_the_yaml_mapping_key_by_key(tmp_path):
    """``rlhf iterate --config run.yaml --train '{...}'`` changes the keys it names and keeps the section's others
    (it replaced the whole section before: the config's eta, learning rate and bf16 were dropped without a word);
    a key set to null takes the file's value away, and repeated flags merge in order."""
    from rlhf_pipeline.stages.iterate import IterateConfig, plan

    path = tmp_path / "run.yaml"
    path.write_text("model: base\nprompts: p.jsonl\noutput: run\nreward_model: rm\niterations: 1\n"
                    "launchers: {generate: vllm-env python, train: accelerate launch --config_file z.yaml}\n"
                    "train: {eta: 1.0e+6, learning_rate: 3.0e-7, bf16: true}\n")
    cfg = parse_config(IterateConfig, ["--config", str(path), "--train", "{learning_rate: 1.0e-6, bf16: null}",
                                       "--train", "{save_every: 5}", "--launchers", "{score: accelerate launch}"],
                       "test")
    assert cfg.train == {"eta": 1e6, "learning_rate": 1e-6, "bf16": None, "save_every": 5}
    assert cfg.launchers == {"generate": "vllm-env python", "train": "accelerate launch --config_file z.yaml",
                             "score": "accelerate launch"}
    steps = {s.name: s for s in plan(cfg, num_prompts=8)}
    train = steps["iter_1/train"]
    assert train.command[:4] == ["accelerate", "launch", "--config_file", "z.yaml"]
    assert train.args[train.args.index("--eta") + 1] == "1000000.0" and "--bf16" not in train.args
    assert steps["iter_1/generate"].command[:2] == ["vllm-env", "python"]
    # without a file, the flag is the whole mapping
    assert parse_config(IterateConfig, ["--model", "m", "--prompts", "p", "--output", "o", "--reward-model", "r",
                                        "--train", "{eta: 2}"], "test").train == {"eta": 2}


def test_yaml_unknown_key_names_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\noutput: o\ntemprature: 1.0\n")
    with pytest.raises(PipelineError, match=r"run.yaml: unknown option 'temprature'; did you mean temperature\?$"):
        parse_config(DemoConfig, ["--config", str(path)], "test")
    path.write_text("model: m\noutput: o\nzzz: 1.0\n")  # nothing close: no list of every option either
    with pytest.raises(PipelineError, match=r"run.yaml: unknown option 'zzz'; --help lists the options$"):
        parse_config(DemoConfig, ["--config", str(path)], "test")


def test_misspelt_flag_gets_the_closest_flag(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--model", "m", "--output", "o", "--temprature", "1"], "test")
    assert capsys.readouterr().err.strip().endswith(
        "unrecognized arguments: --temprature 1; did you mean --temperature?")


def test_missing_required_option_exits(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--output", "o"], "test")
    assert "--model" in capsys.readouterr().err


def test_bad_choice_exits(capsys):
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--model", "m", "--output", "o", "--engine", "tpu"], "test")
    assert "invalid choice" in capsys.readouterr().err


def test_a_wrong_choice_is_one_line_with_the_closest_choice(capsys):
    """rlhf train --algo dop printed train's whole usage (45 lines) before the error, and no suggestion."""
    from rlhf_pipeline.cli import main

    for given, close in (("dop", "dpo"), ("DPO", "dpo"), ("grpoo", "grpo")):
        with pytest.raises(SystemExit) as e:
            main(["train", "--algo", given, "--model", "m", "--data", "d", "--output", "o"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: rlhf train: argument --algo: invalid choice")
        assert err.endswith(f"; did you mean {close}?"), err
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--model", "m", "--output", "o", "--engine", "tpu"], "test")
    assert capsys.readouterr().err.strip().endswith("invalid choice: 'tpu' (choose from 'auto', 'hf'); test --help "
                                                    "lists the options")


def test_semantic_dict_leaves_out_non_semantic_fields():
    cfg = DemoConfig(model="m", output="o", num_proc=4, overwrite=True)
    keys = set(semantic_dict(cfg))
    assert "num_proc" not in keys and "overwrite" not in keys and "output" not in keys
    assert {"model", "max_new_tokens", "temperature"} <= keys


def test_how_a_training_run_gets_to_its_result_is_not_its_identity():
    """A run resumes with checkpointing turned on after running out of memory, or with checkpoints or evaluations
    added; they were part of its identity, so that --resume refused them and rlhf iterate --overwrite retrained."""
    from rlhf_pipeline.training.loop import TrainOptions

    keys = set(semantic_dict(TrainOptions(model="m", data="d", output="o")))
    assert not keys & {"gradient_checkpointing", "save_every", "eval_every", "pack_ratio", "compile"}
    assert {"model", "learning_rate", "batch_size", "seed"} <= keys


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_option_is_documented(stage):
    from rlhf_pipeline.cli import config_class

    config_cls = config_class(stage)
    help_text = build_parser(config_cls, f"rlhf {stage}").format_help()
    for f in dataclasses.fields(config_cls):
        assert f.metadata.get("help"), f"{config_cls.__name__}.{f.name} has no help text"
        assert "--" + f.name.replace("_", "-") in help_text


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_remote_code_is_off_by_default_wherever_a_stage_takes_the_flag(stage):
    """Every stage that loads a model or a tokenizer of the user's takes ``--trust-remote-code``, declared once
    (``config.trust_remote_code_option``): off unless given."""
    from rlhf_pipeline.cli import config_class

    fields = {f.name: f for f in dataclasses.fields(config_class(stage))}
    if stage in ("merge", "report", "tiny-model", "demo", "bench", "iterate"):  # no model of the user's, or per stage
        assert "trust_remote_code" not in fields
        return
    field = fields["trust_remote_code"]
    assert field.default is False
    assert field.metadata["help"].startswith("Run custom ") and "off by default" in field.metadata["help"]


def _option_help(stage: str, flag: str) -> str:
    """The help text of ``flag`` in ``rlhf STAGE --help``, whitespace collapsed."""
    from rlhf_pipeline.cli import config_class

    parser = build_parser(config_class(stage), f"rlhf {stage}")
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return " ".join(action.help.split())


@pytest.mark.parametrize("stage", ["train", "sft", "train-rm"])
def test_training_stages_say_they_write_a_model(stage):
    assert "the model (save_pretrained" in _option_help(stage, "--output")
    assert "Hub model repo" in _option_help(stage, "--push-to-hub")


@pytest.mark.parametrize("stage", ["generate", "score", "filter", "merge", "ref-logps"])
def test_data_stages_say_they_write_a_dataset(stage):
    assert "save_to_disk" in _option_help(stage, "--output")
    assert "Hub dataset repo" in _option_help(stage, "--push-to-hub")


@pytest.mark.parametrize("stage, flag", [("generate", "--prompts"), ("eval", "--prompts"), ("iterate", "--prompts"),
                                         ("train", "--data"), ("score", "--input"), ("filter", "--input")])
def test_dataset_inputs_name_the_revision_syntax(stage, flag):
    assert "ORG/NAME[#CONFIG][:SPLIT][@REVISION]" in _option_help(stage, flag)


def test_group_defaults_in_the_help_come_from_the_registry():
    """Every group algorithm whose own default differs from the family's is named in the option's help."""
    from rlhf_pipeline.algorithms import ALGORITHMS, GROUPS

    for name, base in [("kl_coef", 0.05), ("clip", 0.2), ("clip_high", None)]:
        text = _option_help("train", "--" + name.replace("_", "-"))
        differ = [a.name for a in ALGORITHMS.values()
                  if a.data == GROUPS and a.defaults.get(name, base) != base]
        assert differ, name  # each of these has algorithms of its own (DAPO, GSPO, CISPO, SPPO, ...)
        for algorithm in differ:
            assert algorithm in text, (name, algorithm, text)
    assert "sppo" in _option_help("train", "--kl-coef") and "cispo" in _option_help("train", "--kl-coef")
