"""The algorithm registry: every stage's choices, defaults and dispatch come from it, and a new algorithm is one
entry there. A reference-free toy pair loss and a toy group algorithm with its own policy loss are added here
through ``register`` alone (this file is their one module: the package is not edited) and each trains a step."""

import json
import typing
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file

from rlhf_pipeline import algorithms
from rlhf_pipeline.algorithms import ALGORITHMS, FAMILIES, GROUPS, GroupAlgorithm, PairAlgorithm, names, register


def test_stage_choices_are_the_registry():
    from rlhf_pipeline.stages.demo import DemoConfig
    from rlhf_pipeline.stages.iterate import IterateConfig
    from rlhf_pipeline.stages.train import TrainConfig

    for config in (TrainConfig, IterateConfig, DemoConfig):
        assert typing.get_args(typing.get_type_hints(config)["algo"]) == tuple(ALGORITHMS), config.__name__
    assert set(names()) == set(ALGORITHMS) and sum(len(names(data)) for data in FAMILIES) == len(ALGORITHMS)
    assert all(a.data in FAMILIES for a in ALGORITHMS.values())  # every algorithm has its family's recipe
    assert all(a.demo for a in ALGORITHMS.values())  # rlhf demo has settings for every algorithm


@pytest.mark.parametrize("option, value", [("reward_gap_scale", "rms"), ("nll_coef", 0.5), ("label_smoothing", 0.1),
                                           ("desirable_weight", 2.0), ("scale_rewards", "none"), ("clip", 0.1)])
def test_every_familys_option_given_to_every_algorithm_is_accepted_or_one_clear_error(option, value):
    """A family's option checks read capabilities that other families' entries may not declare (a group algorithm
    has no ``uses_rewards``): given to any algorithm, an option is taken or refused with a ValueError (the stage's
    one ``error:`` line), never a crash."""
    from rlhf_pipeline.stages.train import TrainConfig

    taken = set()
    for name in ALGORITHMS:
        try:
            TrainConfig(algo=name, model="m", data="d", output="o", **{option: value})
        except ValueError:
            continue
        taken.add(name)
    assert taken and taken != set(ALGORITHMS), option  # each option belongs to some algorithms, not to all


def test_every_familys_options_are_flags_of_rlhf_train_and_algo_help_shows_the_ones_it_reads():
    """rlhf train takes every family's options (from the registry); --algo X --help shows the options X reads (each
    option's declared ``reads``: its family's, the reference, SPPO's --eta) and none that it does not."""
    import dataclasses
    import re

    from rlhf_pipeline.stages.train import ALGORITHM_OPTIONS, TrainConfig, algorithm_help

    flags = {f.name for f in dataclasses.fields(TrainConfig)}
    for family in FAMILIES.values():
        if family.options is not None:
            assert {f.name for f in dataclasses.fields(family.options)} <= flags, family.data
    for name, algorithm in ALGORITHMS.items():
        text = algorithm_help(name)
        for options in ALGORITHM_OPTIONS:
            for f in dataclasses.fields(options):
                shown = re.search(rf"--{f.name.replace('_', '-')}(?![\w-])", text) is not None
                assert shown == f.metadata["reads"](algorithm), (name, f.name)
        own = FAMILIES[algorithm.data].options
        if own is not None:
            assert own.options_group in text, name


def test_every_algorithm_option_declares_who_reads_it_and_one_rule_refuses_it_for_the_others(toy, capsys):
    """Each option that only some algorithms read declares which (``reads``, a predicate on the entries'
    capabilities), and the one rule (``registry.check_reads``) refuses it, given, to any other algorithm in one
    line whose list of readers is derived from the registry: a new entry that declares the capability is listed."""
    import dataclasses

    from rlhf_pipeline.cli import main as rlhf
    from rlhf_pipeline.stages.train import ALGORITHM_OPTIONS

    assert all("reads" in f.metadata for o in ALGORITHM_OPTIONS for f in dataclasses.fields(o))
    toy(PairAlgorithm("toy_regression", toy_pair_terms, "a regression on eta", regression=True, uses_rewards=True))
    betas = ", ".join(n for n, a in ALGORITHMS.items() if algorithms.takes_beta(a))
    assert betas.startswith("dpo, cdpo") and betas.endswith("kto") and "rebel" not in betas
    for argv, message in [
        (["--algo", "rebel", "--beta", "0.5"], f"--beta is not read by --algo rebel (it is read by {betas}); leave "
         "it out"),
        (["--algo", "dpo", "--eta", "1e6", "--gamma", "3"], "--eta is not read by --algo dpo (it is read by rebel, "
         "sppo, toy_regression); leave it out"),
        (["--algo", "dpo", "--gamma", "3"], "--gamma is not read by --algo dpo (it is read by simpo); leave it out"),
        (["--algo", "simpo", "--ref-model", "m"], "--ref-model is not read by --algo simpo (it is read by rebel, dpo"),
        (["--algo", "grpo", "--discount", "0.9"], "--discount is not read by --algo grpo (it is read by ppo, "
         "reinforce_pp); leave it out"),
        (["--algo", "rloo", "--vf-coef", "1"], "--vf-coef is not read by --algo rloo (it is read by ppo); leave it "
         "out"),
    ]:
        assert rlhf(["train", *argv, "--model", "m", "--data", "d", "--output", "o"]) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: rlhf train: {message}"), (argv, err)
    from rlhf_pipeline.stages.train import TrainConfig

    # an option left at its default is not given; each algorithm takes its own
    TrainConfig(algo="rebel", model="m", data="d", output="o", eta=1e6, gamma=0.5)
    TrainConfig(algo="dpo", model="m", data="d", output="o", beta=0.5, ref_model="sft")
    TrainConfig(algo="sppo", model="m", data="d", output="o", eta=2.0)


def test_ref_logps_finds_the_family_of_its_data_in_the_registry():
    from rlhf_pipeline.algorithms import PAIRS, UNPAIRED, reference_family
    from rlhf_pipeline.contracts import PAIR_TOKEN_COLUMNS, UNPAIRED_TOKEN_COLUMNS
    from rlhf_pipeline.errors import PipelineError

    assert reference_family(list(PAIR_TOKEN_COLUMNS), "d").data == PAIRS
    assert reference_family(list(UNPAIRED_TOKEN_COLUMNS), "d").data == UNPAIRED
    markers = [f.reference.marker for f in FAMILIES.values() if f.reference is not None]
    assert len(set(markers)) == len(markers) == 2  # one column tells each family's data apart
    with pytest.raises(PipelineError, match="found neither in its columns prompt_token_ids, responses"):
        reference_family(["prompt_token_ids", "responses"], "d")
    with pytest.raises(PipelineError, match="found both"):
        reference_family(markers, "d")


def test_unknown_and_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm; choose one of rebel, dpo"):
        algorithms.get("dpp")
    with pytest.raises(ValueError, match="already registered"):
        register(PairAlgorithm("dpo", "rlhf_pipeline.losses:dpo_terms", "again"))


@pytest.fixture
def toy(request):
    """Register an algorithm for one test and remove it afterwards."""
    added = []

    def add(algorithm):
        added.append(register(algorithm).name)
        return algorithm

    yield add
    for name in added:
        ALGORITHMS.pop(name)


def toy_pair_terms(params, policy_chosen, policy_rejected):
    """A reference-free hinge on the raw log-prob gap: max(0, 1 - (logπc - logπr))."""
    gap = policy_chosen - policy_rejected
    return torch.relu(1.0 - gap), gap, policy_chosen, policy_rejected


def toy_advantages(token_rewards, mask, values, params):
    """Every token gets its sequence's total reward."""
    return torch.where(mask, token_rewards.sum(dim=1, keepdim=True), 0.0), None


def toy_baseline(rewards, params):
    return rewards - rewards.mean(dim=-1, keepdim=True)


def dataset(tmp_path: Path, rows: list[dict]) -> Path:
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "data"))
    return tmp_path / "data"


def changed(before: str, after: Path) -> bool:
    wa, wb = load_file(Path(before) / "model.safetensors"), load_file(after / "model.safetensors")
    return any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_a_toy_pair_loss_trains_through_the_registry_alone(toy, tmp_path, tiny_policy, fresh_accelerate_state):
    toy(PairAlgorithm("toy_pair", toy_pair_terms, "hinge on the log-prob gap", needs_reference=False))
    rows = [{"prompt_token_ids": [1, 10 + i, 11], "chosen_token_ids": [20 + i, 21, 22, 2], "rejected_token_ids": [30, 2],
             "chosen_reward": 1.0, "rejected_reward": 0.0} for i in range(4)]
    from rlhf_pipeline.stages.train import TrainConfig, main

    out = tmp_path / "out"
    main(TrainConfig(algo="toy_pair", model=tiny_policy, data=str(dataset(tmp_path, rows)), output=str(out),
                     report_to="none", batch_size=2, max_steps=1, learning_rate=1e-2))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["algo"] == "toy_pair" and manifest["training"]["steps"] == 1
    assert manifest["training"]["loss_first_step"] > 1  # the longer chosen response is far less likely: the hinge is on
    assert changed(tiny_policy, out)


def test_a_toy_group_algorithm_trains_through_the_registry_alone(toy, tmp_path, tiny_policy,
                                                                fresh_accelerate_state):
    toy(GroupAlgorithm("toy_group", toy_advantages, "total reward on every token", baseline=toy_baseline))
    rows = [{"prompt_token_ids": [1, 10 + i, 11], "response_token_ids": [[20, 21, 2], [30, 2], [40, 41, 42]],
             "rewards": [1.0, 0.0, 0.5]} for i in range(2)]
    from rlhf_pipeline.stages.train import TrainConfig, main

    out = tmp_path / "out"
    main(TrainConfig(algo="toy_group", model=tiny_policy, data=str(dataset(tmp_path, rows)), output=str(out),
                     report_to="none", batch_size=2, max_steps=1, learning_rate=1e-2, temperature=1.0,
                     kl_coef=0.0))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["algo"] == "toy_group" and manifest["training"]["steps"] == 1
    assert changed(tiny_policy, out)
    rollout = Dataset.load_from_disk(str(out / "rollout" / "train"))
    # the toy baseline centred each group's rewards: scores (1, 0, 0.5) - 0.5
    assert rollout["score"][:3] == pytest.approx([0.5, -0.5, 0.0])


def toy_policy_loss(logp, old_logp, advantages, mask, params, reduction):
    """An unclipped importance-weighted policy gradient, -A * exp(logp - old), meaned over each response's tokens
    and then over the responses (the default "sequence" aggregation); it logs its own metric."""
    assert reduction == "sequence"
    ratio = torch.exp(torch.where(mask, logp - old_logp.detach(), 0))
    per_token = torch.where(mask, -advantages * ratio, 0)
    loss = (per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()
    return loss, {"toy_weight": ratio[mask].mean().detach()}


def test_a_group_algorithm_with_its_own_policy_loss_trains_through_the_registry_alone(
        toy, tmp_path, tiny_policy, fresh_accelerate_state):
    """The registry's policy-loss hook: the entry's own loss replaces the clipped surrogate, and every list of the
    stages (names, --algo's help, the family's recipe, the per-algorithm help) takes the new entry without an edit."""
    from rlhf_pipeline.algorithms import family, help_text
    from rlhf_pipeline.stages.train import TrainConfig, algorithm_help, main

    toy(GroupAlgorithm("toy_is", toy_advantages, "unclipped importance-weighted policy gradient",
                       baseline=toy_baseline, policy_loss=toy_policy_loss))
    assert "toy_is" in names(GROUPS) and "toy_is (groups)" in help_text()
    assert family("toy_is") is FAMILIES[GROUPS] and "group options" in algorithm_help("toy_is")
    rows = [{"prompt_token_ids": [1, 10 + i, 11], "response_token_ids": [[20, 21, 2], [30, 2], [40, 41, 42]],
             "rewards": [1.0, 0.0, 0.5]} for i in range(2)]
    out = tmp_path / "out"
    main(TrainConfig(algo="toy_is", model=tiny_policy, data=str(dataset(tmp_path, rows)), output=str(out),
                     report_to="none", batch_size=6, max_steps=1, learning_rate=1e-2, temperature=1.0, kl_coef=0.0))
    assert changed(tiny_policy, out)
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    weights = [v for k, v in step.items() if k.endswith("toy_weight")]
    assert weights == [pytest.approx(1.0, abs=1e-6)]  # the toy's metric, on-policy at step 1: its loss ran
    assert not any("clip_frac" in k for k in step)  # and the clipped surrogate did not
    # on-policy, the loss is -(mean advantage): every token of a response carries its group-centred score
    # (1, 0, 0.5) - 0.5 and the 6 responses' scores sum to 0 within each group
    assert step["loss/train"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("argv", [["train", "--algo", name] for name in ("rebel", "kto", "grpo", "raft")]
                         + [["sft"], ["train-rm"]])
def test_a_mistyped_model_is_the_error_reported_first(argv, tmp_path, capsys):
    """Every training stage checks --model before it reads anything else (as before the one skeleton): with a
    mistyped --model and a mistyped --data, the one error line names --model, and nothing is written."""
    from rlhf_pipeline.cli import main as rlhf

    out = tmp_path / "out"
    assert rlhf([*argv, "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no-data"),
                 "--output", str(out)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --model ")
    assert not out.exists()
