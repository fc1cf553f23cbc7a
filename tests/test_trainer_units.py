"""The shared loop's batching and schedule: pure functions, checked on small cases."""

import json
import math

import pytest
import torch

from conftest import logged, micro_batch_sizes, spy_token_budget_plans
from rlhf_pipeline.distributed import sharded_batches
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.training.loop import (
    TrainOptions,
    global_batches,
    micro_batches,
    step_micro_batches,
    token_budget_plan,
    warmup_cosine,
)


def test_global_batches_are_a_seeded_partition():
    batches = global_batches(10, 4, seed=0, epoch=0)
    assert len(batches) == 2 and all(len(b) == 4 for b in batches)  # the partial batch of 2 is dropped
    assert len(set(batches[0]) | set(batches[1])) == 8
    assert global_batches(10, 4, seed=0, epoch=0) == batches
    assert global_batches(10, 4, seed=0, epoch=1) != batches
    assert global_batches(10, 4, seed=1, epoch=0) != batches


def test_micro_batches_split_one_global_batch_the_same_way_for_any_layout():
    lengths = [5, 9, 1, 7, 3, 8, 2, 6]
    batch = list(range(8))
    # Sorted longest first: 1(9) 5(8) 3(7) 7(6) 0(5) 4(3) 6(2) 2(1).
    one_proc = micro_batches(batch, lengths, batch_size=2, world=1, accumulation=4, rank=0)
    assert one_proc == [[1, 5], [3, 7], [0, 4], [6, 2]]
    two_procs = [micro_batches(batch, lengths, 2, world=2, accumulation=2, rank=r) for r in (0, 1)]
    assert two_procs == [[[1, 5], [0, 4]], [[3, 7], [6, 2]]]
    big = micro_batches(batch, lengths, batch_size=8, world=1, accumulation=1, rank=0)
    assert sorted(big[0]) == batch


def test_token_budget_plan_by_hand():
    lengths = [5, 9, 1, 7, 3, 8, 2, 6]
    batch = list(range(8))
    # Sorted longest first: 1(9) 5(8) 3(7) 7(6) 0(5) 4(3) 6(2) 2(1); greedy runs of at most 16 tokens:
    # [1] 9 | [5, 3] 15 | [7, 0, 4, 6] 16 | [2] 1; each process runs its micro-batches most tokens first.
    assert token_budget_plan(batch, lengths, 16, world=1) == [[[7, 0, 4, 6], [5, 3], [1], [2]]]
    # Two processes, two rounds each; largest first to the lighter process: 16 -> rank 0, 15 -> rank 1, 9 -> rank 1
    # (15 < 16), 1 -> rank 0 (rank 1 has its two).
    assert token_budget_plan(batch, lengths, 16, world=2) == [[[7, 0, 4, 6], [2]], [[5, 3], [1]]]
    # An example longer than the budget is a micro-batch of its own.
    assert token_budget_plan([0, 1, 2], [10, 3, 3], 5, world=1) == [[[0], [1], [2]]]
    # Fewer micro-batches than processes: the others have none, and run one stand-in each.
    config = TrainOptions(model="m", data="d", output="o", max_tokens_per_micro_batch=100)
    assert [step_micro_batches(batch, lengths, config, 3, r) for r in range(3)] == [[[1, 5, 3, 7, 0, 4, 6, 2]],
                                                                                   [None], [None]]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_token_budget_plan_covers_the_batch_once_within_the_budget_alike_on_every_process(world):
    import random

    rng = random.Random(world)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(40)]
        batch = rng.sample(range(40), 24)
        budget = rng.randint(10, 150)
        plan = token_budget_plan(batch, lengths, budget, world)
        chunks = [c for mine in plan for c in mine]
        assert len(plan) == world and sorted(i for c in chunks for i in c) == sorted(batch)  # each example once
        assert all(sum(lengths[i] for i in c) <= budget or len(c) == 1 for c in chunks)
        assert all(len(c) == 1 for c in chunks if lengths[c[0]] > budget)  # an oversize example runs alone
        rounds = math.ceil(len(chunks) / world)
        assert max(map(len, plan)) == rounds  # no process runs more forwards than it must
        assert token_budget_plan(batch[::-1], lengths, budget, world) == plan  # the same whatever the order
        config = TrainOptions(model="m", data="d", output="o", max_tokens_per_micro_batch=budget)
        for rank in range(world):
            mine = step_micro_batches(batch, lengths, config, world, rank)
            assert len(mine) == rounds and [c for c in mine if c is not None] == plan[rank]


def test_a_token_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="--max-tokens-per-micro-batch must be at least 1"):
        TrainOptions(model="m", data="d", output="o", max_tokens_per_micro_batch=0)


def test_sharded_batches_give_every_process_the_same_number_of_rounds():
    lengths = [3, 1, 4, 1, 5, 9, 2]
    rank0 = sharded_batches(lengths, 2, world=3, rank=0)
    rank2 = sharded_batches(lengths, 2, world=3, rank=2)
    assert len(rank0) == len(rank2) == 2
    assert rank2[-1] is None  # 4 batches over 3 processes: the third has one round with nothing to do
    covered = [i for r in range(3) for b in sharded_batches(lengths, 2, 3, r) if b for i in b]
    assert sorted(covered) == list(range(7))


def test_warmup_then_cosine():
    assert warmup_cosine(0, warmup=4, total=20) == pytest.approx(1 / 5)
    assert warmup_cosine(3, warmup=4, total=20) == pytest.approx(4 / 5)
    assert warmup_cosine(4, warmup=4, total=20) == pytest.approx(1.0)
    assert warmup_cosine(12, warmup=4, total=20) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(20, warmup=4, total=20) == pytest.approx(0.0)
    assert warmup_cosine(0, warmup=0, total=10) == pytest.approx(1.0)


class ToyModel(torch.nn.Module):
    """The loop without a language model: a linear layer."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def save_pretrained(self, path, **kwargs):  # the loop saves the final model; nothing to check here
        pass


class ToyTask:
    """The per-example mean of squared errors ``(linear(x) - y)²`` over rows ``{"x", "y", "tokens"}``; a row costs its
    ``tokens`` (1 when the rows have none)."""

    def lengths(self, rows):
        return list(rows["tokens"]) if "tokens" in rows.column_names else [1] * len(rows)

    def collate(self, rows):
        return torch.tensor([r["x"] for r in rows]), torch.tensor([r.get("y", 0.0) for r in rows])

    def loss(self, model, batch):
        x, y = batch
        error = model.linear(x).squeeze(-1) - y
        return error.pow(2).mean(), {"margin": error.detach()}, (len(x), len(x))


class NoTokenizer:
    def save_pretrained(self, path):
        pass


def train_toy(output, rows: list[dict], **options) -> tuple[ToyModel, TrainOptions]:
    """Train a seeded :class:`ToyModel` on ``rows`` with the shared loop, as a stage would (its accelerator)."""
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset

    from rlhf_pipeline.training.loop import prepare, train
    from rlhf_pipeline.training.stage import make_accelerator

    config = TrainOptions(model="unused", data="unused", output=str(output), report_to="none", **options)
    torch.manual_seed(0)
    model = ToyModel()
    try:
        accelerator = make_accelerator(config)
        setup = prepare(config, accelerator, model, len(rows))
        train(config, accelerator, setup, NoTokenizer(), ToyTask(), Dataset.from_list(rows), None)
    finally:  # accelerate keeps singletons between runs
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return model, config


@pytest.mark.parametrize("launcher", ["bf16", "fp16"])
def test_a_launcher_asking_for_mixed_precision_needs_bf16_on_the_run(tmp_path, monkeypatch, launcher):
    """accelerate launch --config_file accelerate_cfgs/zero3.yaml sets ACCELERATE_MIXED_PRECISION=bf16; a run
    without --bf16 passed mixed_precision='no', which wins, and trained in float32 without a word."""
    from accelerate.state import AcceleratorState, GradientState

    from rlhf_pipeline.training.stage import make_accelerator

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    plain = TrainOptions(model="unused", data="unused", output=str(tmp_path), report_to="none")
    with pytest.raises(PipelineError, match=f"asks for {launcher} mixed precision.*no --bf16.*add --bf16"):
        make_accelerator(plain)
    try:
        accelerator = make_accelerator(TrainOptions(model="unused", data="unused", output=str(tmp_path),
                                                    report_to="none", bf16=True))
        assert accelerator.mixed_precision == "bf16"
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    try:
        assert make_accelerator(plain).mixed_precision == "no"
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_logged_learning_rate_is_the_one_each_step_used(tmp_path):
    """The ``lr`` logged for step k is the rate of step k's update (warmup_cosine(k - 1)), not step k + 1's: the
    scheduler is stepped after the update, so its last rate must be read before that."""
    total, peak = 6, 1e-2
    _, config = train_toy(tmp_path, [{"x": [float(i), 1.0]} for i in range(8)], max_steps=total, batch_size=1,
                          learning_rate=peak, warmup_ratio=0.5)

    lrs = logged(tmp_path, "lr")
    warmup = int(config.warmup_ratio * total)
    assert lrs == pytest.approx([peak * warmup_cosine(s, warmup, total) for s in range(total)])
    assert lrs[0] == pytest.approx(peak / (warmup + 1))  # the first step's warmup rate, not the second's


def test_a_token_budget_trains_as_batching_by_count(tmp_path, monkeypatch):
    """--max-tokens-per-micro-batch cuts each global batch (batch 3 x accumulation 2 = 6 rows) into micro-batches of
    1 to 6 rows; weighted by their rows they give the update of the count's 2 micro-batches of 3, to float rounding.
    Unweighted (each micro-batch's mean alike) they would not."""
    from rlhf_pipeline.training import loop

    rng = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(2, generator=rng).tolist(), "y": float(i % 5) - 2.0, "tokens": 1 + (7 * i) % 11}
            for i in range(24)]
    common = dict(max_steps=8, batch_size=3, gradient_accumulation_steps=2, learning_rate=0.05, warmup_ratio=0.0)
    plans = spy_token_budget_plans(monkeypatch)
    by_count, _ = train_toy(tmp_path / "count", rows, **common)
    assert not plans  # the count path never plans by tokens
    by_tokens, _ = train_toy(tmp_path / "tokens", rows, **common, max_tokens_per_micro_batch=14)
    assert len(plans) == 8 and len(micro_batch_sizes(plans) - {3}) > 2, plans  # micro-batches of several sizes
    for a, b in zip(by_count.parameters(), by_tokens.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert logged(tmp_path / "tokens") == pytest.approx(logged(tmp_path / "count"), abs=1e-6)
    assert logged(tmp_path / "tokens", "reward/train_margin") == pytest.approx(
        logged(tmp_path / "count", "reward/train_margin"), abs=1e-6)

    monkeypatch.setattr(loop, "micro_batch_weight", lambda examples, batch_size: 1.0)
    unweighted, _ = train_toy(tmp_path / "unweighted", rows, **common, max_tokens_per_micro_batch=14)
    assert max((a - b).abs().max().item() for a, b in zip(by_count.parameters(), unweighted.parameters())) > 1e-3


def test_rebel_backpropagates_repos_form_and_reports_the_papers(tiny_policy):
    """PairTask's REBEL loss has the paper's value, (Δ/η − Δr)², and REBEL's code's gradient, η² times larger."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.losses import PairLossParams, rebel_loss
    from rlhf_pipeline.algorithms.pairs import PairTask, pair_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    rows = [{"prompt_token_ids": [1, 10, 11], "chosen_token_ids": [20, 21, 2], "rejected_token_ids": [30, 2],
             "chosen_ref_logp": -9.0, "rejected_ref_logp": -4.5, "chosen_reward": 1.0, "rejected_reward": 0.2},
            {"prompt_token_ids": [1, 12], "chosen_token_ids": [40, 2], "rejected_token_ids": [41, 42, 43, 2],
             "chosen_ref_logp": -5.0, "rejected_ref_logp": -12.0, "chosen_reward": 0.4, "rejected_reward": -0.3}]
    eta = 10.0
    task = PairTask("rebel", PairLossParams(eta=eta, beta=0.1, label_smoothing=0.0, gamma=0.5), 1.0, 0)
    loss, _, _ = task.loss(model, rows)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    chosen, rejected, _ = pair_logps(model, rows, 0, 1.0)
    t = lambda k: torch.tensor([r[k] for r in rows])  # noqa: E731
    paper = rebel_loss(chosen, rejected, t("chosen_ref_logp"), t("rejected_ref_logp"), t("chosen_reward"),
                       t("rejected_reward"), eta=eta).mean()
    assert float(loss.detach()) == pytest.approx(float(paper.detach()), rel=1e-6)
    paper.backward()
    scale = max(float(g.abs().max()) for g in ours.values())
    for name, p in model.named_parameters():  # float32 sums in another order: tolerance relative to the largest
        torch.testing.assert_close(ours[name], eta**2 * p.grad, rtol=1e-3, atol=1e-5 * scale)


@pytest.mark.parametrize("algo", ["simpo", "orpo", "cpo", "dpo_norm"])
@pytest.mark.parametrize("pack_ratio", [0.0, 2.0])
def test_length_normalised_pair_losses_through_pairtask_equal_a_per_sequence_oracle(tiny_policy, algo, pack_ratio):
    """SimPO, ORPO, CPO and dpo_norm divide by each response's own length: PairTask's loss on a real forward equals
    the formula written out here on one plain forward per sequence, lengths counted from the rows (chosen and
    rejected of different lengths, so that lengths swapped or taken from the other response fail)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.algorithms.pairs import PairTask
    from rlhf_pipeline.losses import PairLossParams

    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    rows = [{"prompt_token_ids": [1, 10, 11], "chosen_token_ids": [20, 21, 22, 2], "rejected_token_ids": [30, 2],
             "chosen_ref_logp": -20.0, "rejected_ref_logp": -9.0},
            {"prompt_token_ids": [1, 12], "chosen_token_ids": [40, 2], "rejected_token_ids": [41, 42, 43, 44, 45, 2],
             "chosen_ref_logp": -11.0, "rejected_ref_logp": -35.0}]
    beta, gamma, sft = 0.7, 0.3, 0.6
    task = PairTask(algo, PairLossParams(beta=beta, gamma=gamma, sft_coef=sft), 1.0, 0, pack_ratio=pack_ratio)
    with torch.no_grad():
        loss = float(task.loss(model, rows)[0])

        def logp(prompt, response):  # summed log-probs of the response tokens, one sequence alone
            ids = torch.tensor([prompt + response])
            logprobs = model(ids).logits[0, :-1].log_softmax(-1)
            return sum(float(logprobs[len(prompt) - 1 + k, tok]) for k, tok in enumerate(response))

        expected = []
        for r in rows:
            pc, pr = (logp(r["prompt_token_ids"], r[k]) for k in ("chosen_token_ids", "rejected_token_ids"))
            c, rj = pc / len(r["chosen_token_ids"]), pr / len(r["rejected_token_ids"])
            if algo == "simpo":
                expected.append(-F.logsigmoid(torch.tensor(beta * (c - rj) - gamma)))
            elif algo == "dpo_norm":
                ratios = (pc - r["chosen_ref_logp"]) / len(r["chosen_token_ids"]) - (pr - r["rejected_ref_logp"]) / len(
                    r["rejected_token_ids"])
                expected.append(-F.logsigmoid(torch.tensor(beta * ratios)))
            elif algo == "orpo":
                odds = (c - rj) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(rj)))
                expected.append(sft * -c - beta * F.logsigmoid(torch.tensor(odds)))
            else:
                expected.append(-F.logsigmoid(torch.tensor(beta * (pc - pr))) + sft * -c)
    assert loss == pytest.approx(float(sum(expected)) / len(rows), rel=1e-5)


def test_ppos_policy_and_critic_are_both_checkpointed_without_the_deprecated_name(tiny_policy, tiny_rm):
    """PPO's one module of policy and critic (not a transformers model, so without ``activation_checkpointing_enable``)
    takes the old entry point, and passes it on to each model under transformers' current name."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.algorithms.groups import policy_and_critic
    from rlhf_pipeline.modeling import enable_activation_checkpointing

    both = policy_and_critic(AutoModelForCausalLM.from_pretrained(tiny_policy),
                             AutoModelForSequenceClassification.from_pretrained(tiny_rm, num_labels=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_activation_checkpointing(both)
    assert not [w for w in caught if "checkpointing_enable" in str(w.message)]
    for part in (both.policy.model, both.critic.model):
        assert part.layers and all(layer.gradient_checkpointing for layer in part.layers)


def test_a_model_with_its_own_checkpointing_method_gets_it_called_as_it_was_written():
    """Remote code may override ``gradient_checkpointing_enable`` with transformers' older signature; transformers
    5.2x's new entry point would call it with arguments it does not take, so such a model gets its own method."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf_pipeline.modeling import enable_activation_checkpointing

    base = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    calls = []

    class OwnCode(type(base)):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):  # the pre-5.2x signature
            calls.append(gradient_checkpointing_kwargs)
            super().gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    model = OwnCode(base.config)
    enable_activation_checkpointing(model)
    assert calls == [{"use_reentrant": False}]
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_a_resumed_run_keeps_the_metrics_up_to_its_checkpoint_and_drops_a_line_cut_short(tmp_path):
    """A kill or a full disk mid-write leaves metrics.jsonl with a partial last line: --resume keeps the whole
    records up to its checkpoint's step (it failed on that line with a JSON traceback before)."""
    from types import SimpleNamespace

    from rlhf_pipeline.training.loop import Metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.7}\n{"step": 2, "loss": 0.6}\n{"step": 3, "loss": 0.5}\n{"step": 4, "lo')
    Metrics(SimpleNamespace(is_main_process=True), tmp_path, resume_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    Metrics(SimpleNamespace(is_main_process=True), tmp_path, resume_step=0)  # a fresh start keeps nothing
    assert path.read_text() == ""


def test_metrics_keep_small_values_to_their_significant_digits(tmp_path):
    """A learning rate of 1e-9 or a KL of 3.8e-8 is logged as itself (rounding to 8 decimals made them 0 and 4e-08)."""
    from types import SimpleNamespace

    from rlhf_pipeline.training.loop import Metrics

    values = {"lr": 9.6194e-07, "kl": 3.806e-08, "tiny": 1.2e-9, "loss": 0.693147180559}
    metrics = Metrics(SimpleNamespace(is_main_process=True, log=lambda *a, **k: None), tmp_path, resume_step=0)
    metrics.log(1, values)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {k: record[k] for k in values} == pytest.approx(values, rel=1e-9)


def test_every_option_reaches_tensorboard_in_a_form_it_takes():
    """TensorBoard's hparams refuse lists: --lora-target-modules under the default --report-to failed the run."""
    from torch.utils.tensorboard.summary import hparams

    from rlhf_pipeline.stages.sft import SFTConfig
    from rlhf_pipeline.training.loop import tracker_config

    config = SFTConfig(model="m", data="d.jsonl", output="o", lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    tracked = tracker_config(config)
    assert tracked["lora_target_modules"] == '["q_proj", "v_proj"]' and tracked["lora_rank"] == 4
    hparams(tracked, {})  # raised ValueError on the list before


def test_a_tracker_that_is_not_installed_is_refused_before_the_run(monkeypatch, capsys):
    """accelerate drops a --report-to tracker whose package is missing with a warning, and an 8B run would log to
    nowhere but metrics.jsonl: refused when the options are read, with both ways out."""
    import importlib.util

    from conftest import run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert run("train", "--model", "m", "--data", "d", "--output", "o", "--report-to", "wandb") == 1
    err = capsys.readouterr().err
    assert "--report-to wandb: wandb is not installed here (pip install wandb); or pass --report-to none" in err


def test_a_kept_data_pass_is_read_only_when_every_process_sees_it(tmp_path, monkeypatch):
    """The reference pass (or PPO's rollout) kept by an interrupted run: read when every process sees it, else done
    again by all of them. One process reading it while another ran the pass, with its collectives, hung both."""
    from types import SimpleNamespace

    from datasets import Dataset, DatasetDict

    from rlhf_pipeline.training import stage

    accelerator = SimpleNamespace(num_processes=2, is_main_process=True, wait_for_everyone=lambda: None)
    cache, calls = tmp_path / "cache", []

    def compute(value):
        calls.append(value)
        return DatasetDict({"train": Dataset.from_dict({"x": [value]})})

    seen_missing = {"elsewhere": False}  # whether another process does not see the cache
    monkeypatch.setattr(stage, "anywhere", lambda acc, flag: flag or seen_missing["elsewhere"])
    assert stage.cached_splits(accelerator, cache, lambda: compute(1))["train"]["x"] == [1]
    assert stage.cached_splits(accelerator, cache, lambda: compute(2))["train"]["x"] == [1]  # kept, seen everywhere
    seen_missing["elsewhere"] = True
    assert stage.cached_splits(accelerator, cache, lambda: compute(3))["train"]["x"] == [3]  # every process again
    assert calls == [1, 3]


def test_the_training_collective_timeout_is_30_minutes_unless_the_environment_says(monkeypatch):
    from datetime import timedelta

    from rlhf_pipeline.distributed import training_collective_timeout

    monkeypatch.delenv("RLHF_TRAINING_TIMEOUT_MINUTES", raising=False)
    assert training_collective_timeout() == timedelta(minutes=30)
    monkeypatch.setenv("RLHF_TRAINING_TIMEOUT_MINUTES", "90")
    assert training_collective_timeout() == timedelta(minutes=90)
    for bad in ("0", "-5", "nan", "soon"):
        monkeypatch.setenv("RLHF_TRAINING_TIMEOUT_MINUTES", bad)
        with pytest.raises(PipelineError, match=f"RLHF_TRAINING_TIMEOUT_MINUTES='{bad}': give a number of minutes"):
            training_collective_timeout()


def test_means_divide_by_examples_or_by_weights_and_leave_out_a_mean_over_nothing():
    """``training.loop.means``: a plain metric over the examples, a weighted one (``NAME@weight``) over its weights;
    a weighted mean over no weight (KTO's undesirable responses in a window that had none) is left out, not 0."""
    from rlhf_pipeline.training.loop import means

    totals = {"_n": 4.0, "_real": 9.0, "loss": 2.0, "grad_norm": 1.5, "clip_frac": 0.3, "clip_frac@weight": 6.0,
              "undesirable_logratio": 0.0, "undesirable_logratio@weight": 0.0}
    assert means(totals) == pytest.approx({"loss": 0.5, "clip_frac": 0.05})
    assert means({"_n": 0.0, "loss": 0.0}) == {}


def test_the_wandb_run_id_is_kept_for_a_resume(tmp_path, monkeypatch):
    """A new run gets a new id and keeps it in OUTPUT/runs/wandb_run_id; --resume goes on with it (the tracker's
    run continues); $WANDB_RUN_ID wins, and is kept too."""
    from types import SimpleNamespace

    from rlhf_pipeline.training.loop import _wandb_run_id

    main = SimpleNamespace(is_main_process=True)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    first = _wandb_run_id(main, tmp_path, resume=False)
    assert (tmp_path / "runs" / "wandb_run_id").read_text().strip() == first
    assert _wandb_run_id(main, tmp_path, resume=True) == first
    assert _wandb_run_id(SimpleNamespace(is_main_process=False), tmp_path / "other", resume=False) != first
    assert not (tmp_path / "other").exists()  # only the main process writes
    fresh = _wandb_run_id(main, tmp_path, resume=False)  # a run started over (--overwrite): a run of its own
    assert fresh != first
    monkeypatch.setenv("WANDB_RUN_ID", "mine")
    assert _wandb_run_id(main, tmp_path, resume=True) == "mine"
    monkeypatch.delenv("WANDB_RUN_ID")
    assert _wandb_run_id(main, tmp_path, resume=True) == "mine"
