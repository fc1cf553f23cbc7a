"""SFT, reward-model training and evaluation: the losses against naive oracles, the stages end to end on the
bundled review task with the tiny models, and the eval numbers recomputed by hand from what the stage wrote."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import load_from_disk

from conftest import (assert_same_gradient_norms, logged, max_weight_diff, micro_batch_sizes,
                      spy_token_budget_plans)
from rlhf_pipeline.cli import main as rlhf
from rlhf_pipeline.demo.task import gold_reward, write_task_data
from rlhf_pipeline.errors import PipelineError

GOLD = "rlhf_pipeline.demo.task:gold_reward"


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run(*args) -> int:
    """One stage in-process; each training run builds its own Accelerator, and accelerate keeps singletons."""
    try:
        return rlhf([str(a) for a in args])
    finally:
        _reset_accelerate()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def manifest(path: Path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    return write_task_data(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def tok(tiny_policy):
    from rlhf_pipeline.chat import load_tokenizer

    return load_tokenizer(tiny_policy)


# ---------------------------------------------------------------------------------------------------------------
# SFT: tokenization


def test_encode_answers_splits_the_rendered_conversation_at_the_generation_prompt(tok):
    from rlhf_pipeline.chat import encode_prompts
    from rlhf_pipeline.chat import encode_answers
    from rlhf_pipeline.stages.sft import split_conversation

    prompts = ["Write a short review of the park Fox Hill.", "Hi"]
    answers = ["The paths were lovely.", "A superb album with warm vocals. I would call it fun."]
    prompt_ids, answer_ids, fallbacks = encode_answers(tok, prompts, answers)
    assert fallbacks == 0
    assert prompt_ids == encode_prompts(tok, prompts)  # exactly what generate feeds the policy
    for p, text, pi, ai in zip(prompts, answers, prompt_ids, answer_ids):
        full = tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": text}], tokenize=True, return_dict=True
        )["input_ids"]
        assert pi + ai == list(full)
        assert ai[-1] == tok.eos_token_id and tok.eos_token_id not in ai[:-1]
        assert tok.decode(ai[:-1]) == text  # the answer part holds the answer text and nothing of the prompt
        assert tok.convert_ids_to_tokens(pi[-1]) == "<|assistant|>"  # the generation prompt belongs to the prompt

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Review Night Train."},
                {"role": "assistant", "content": "The acting was dull."}]
    prompt, answer = split_conversation({"messages": messages}, 0, "demos.jsonl")
    assert prompt == messages[:2] and answer == "The acting was dull."
    (pi,), (ai,), fallbacks = encode_answers(tok, [prompt], [answer])
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert fallbacks == 0 and pi + ai == list(full) and pi == encode_prompts(tok, [messages[:2]])[0]
    assert tok.decode(ai, skip_special_tokens=True) == "The acting was dull."


def test_encode_answers_falls_back_when_the_template_does_not_render_the_prompt_as_a_prefix(tiny_policy):
    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.chat import encode_answers

    tok = load_tokenizer(tiny_policy)
    # The generation prompt says <|assistant|>, but a rendered assistant turn is opened by <|system|>: no prefix.
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|system|>' }}"
        "{% else %}{{ '<|' + m['role'] + '|>' }}{% endif %}{{ m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    (pi,), (ai,), fallbacks = encode_answers(tok, ["Review it."], ["It was good."])
    assert fallbacks == 1
    assert ai == tok("It was good.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.convert_ids_to_tokens(pi[-1]) == "<|assistant|>"
    # raw text (--chat-template none): nothing after the answer stops sampling, so the EOS it stops on is trained
    tok.chat_template = None
    (pi,), (ai,), fallbacks = encode_answers(tok, ["Review it."], ["It was good."])
    assert fallbacks == 0 and ai[-1] == tok.eos_token_id and tok.eos_token_id not in pi + ai[:-1]
    assert tok.decode(ai[:-1]).strip() == "It was good."


def test_split_conversation_rejects_rows_without_an_answer():
    from rlhf_pipeline.stages.sft import split_conversation

    with pytest.raises(PipelineError, match=r"demos\.jsonl: row 7 has neither"):
        split_conversation({"prompt": "Review it."}, 7, "demos.jsonl")
    with pytest.raises(PipelineError, match="row 3: 'messages' must end with a non-empty assistant turn"):
        split_conversation({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                         {"role": "user", "content": "c"}]}, 3, "demos.jsonl")
    with pytest.raises(PipelineError, match="row 0: 'answer' must be non-empty text"):
        split_conversation({"prompt": "Review it.", "answer": ""}, 0, "demos.jsonl")
    with pytest.raises(PipelineError, match="row 2: 'conversations' must end with a non-empty assistant turn"):
        split_conversation({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, 2,
                           "demos.jsonl")
    with pytest.raises(PipelineError, match="row 4: a ShareGPT turn is from 'bard'"):
        split_conversation({"conversations": [{"from": "human", "value": "a"}, {"from": "bard", "value": "b"}]}, 4,
                           "demos.jsonl")


def test_split_conversation_reads_sharegpt_turns_as_messages():
    """ShareGPT's ``conversations`` ({from, value}; human, gpt, system) give what the same ``messages`` give."""
    from rlhf_pipeline.stages.sft import split_conversation

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Review Night Train."},
                {"role": "assistant", "content": "The acting was dull."}]
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": speakers[m["role"]], "value": m["content"]} for m in messages]
    assert split_conversation({"conversations": sharegpt}, 0, "demos.jsonl") == (messages[:2], messages[2]["content"])
    # 'messages' wins when a row has both (as 'prompt' wins over 'messages' for prompts)
    other = messages[:2] + [{"role": "assistant", "content": "Fine."}]
    assert split_conversation({"messages": other, "conversations": sharegpt}, 0, "demos.jsonl")[1] == "Fine."


# ---------------------------------------------------------------------------------------------------------------
# SFT: the loss


def _nll_oracle(model, prompt: list[int], answer: list[int], include_prompt: bool = False) -> float:
    """Mean NLL of the answer tokens (or of every predicted token) from the model's own forward, one sequence
    alone, no padding, float64 softmax."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # (T, V)
    logp = torch.log_softmax(logits[:-1], dim=-1)  # position t predicts token t + 1
    targets = ids[0, 1:]
    nll = -logp.gather(-1, targets[:, None])[:, 0]
    start = 0 if include_prompt else len(prompt) - 1
    return nll[start:].mean().item()


def test_sft_loss_is_the_mean_over_examples_of_the_answer_tokens_mean_nll(tiny_policy, tok):
    from rlhf_pipeline.chat import pad_id
    from rlhf_pipeline.modeling import load_causal_lm
    from rlhf_pipeline.chat import encode_answers
    from rlhf_pipeline.stages.sft import SFTTask

    model = load_causal_lm(tiny_policy, device=torch.device("cpu"))
    with torch.no_grad():  # the random init predicts every token at about log(1/V): sharpen it so NLLs differ
        model.lm_head.weight.mul_(50)
    prompts = ["Review the park.", "Give a one-sentence review of Nova X2, a phone.", "Hi"]
    answers = ["Great.", "The screen was lovely and the battery weak.", "I found the food fresh and the staff rude."]
    prompt_ids, answer_ids, _ = encode_answers(tok, prompts, answers)
    assert len({len(p) + len(a) for p, a in zip(prompt_ids, answer_ids)}) == 3  # three lengths: padding in play
    task = SFTTask(pad_id(tok))
    batch = task.collate([{"prompt_token_ids": p, "answer_token_ids": a} for p, a in zip(prompt_ids, answer_ids)])
    assert batch.num_padded_tokens > 0
    loss, metrics, (real, total) = task.loss(model, batch)

    per_example = [_nll_oracle(model, p, a) for p, a in zip(prompt_ids, answer_ids)]
    expected = sum(per_example) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
    # Not the token-weighted mean over the batch, and not counting the prompt tokens.
    token_weighted = sum(e * len(a) for e, a in zip(per_example, answer_ids)) / sum(map(len, answer_ids))
    assert abs(token_weighted - expected) > 1e-3
    with_prompt = sum(_nll_oracle(model, p, a, include_prompt=True) for p, a in zip(prompt_ids, answer_ids)) / 3
    assert abs(with_prompt - expected) > 1e-2
    assert metrics == {}
    assert real == sum(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    assert total == 3 * max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))

    loss.backward()  # differentiable, through every parameter
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------------------------
# SFT: the stage


@pytest.fixture(scope="module")
def sft_data(task, tmp_path_factory) -> Path:
    rows = read_jsonl(task["sft"])[:64]
    return write_jsonl(tmp_path_factory.mktemp("sft_data") / "demos.jsonl", rows)


def sft_args(tiny_policy, data, out) -> list:
    return ["sft", "--model", tiny_policy, "--data", data, "--output", out, "--test-size", 16, "--epochs", 3,
            "--batch-size", 8, "--learning-rate", 3e-3, "--report-to", "none"]


@pytest.fixture(scope="module")
def sft_model(tiny_policy, sft_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "out"
    assert run(*sft_args(tiny_policy, sft_data, out)) == 0
    return out


def test_sft_lowers_the_eval_loss_and_saves_a_loadable_model_once(sft_model, sft_data, tiny_policy, capsys):
    from transformers import AutoModelForCausalLM

    m = manifest(sft_model)
    assert m["stage"] == "sft"
    assert m["training"]["steps"] == 3 * (48 // 8) and m["training"]["answer_tokenized_alone"] == 0
    evals = [r for r in read_jsonl(sft_model / "metrics.jsonl") if "loss/eval" in r]
    assert [r["step"] for r in evals] == [0, 18]
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"] - 1.0, evals
    assert m["training"]["eval"]["loss"] == pytest.approx(evals[-1]["loss/eval"], abs=1e-6)

    model = AutoModelForCausalLM.from_pretrained(str(sft_model))
    before = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert not torch.equal(model.lm_head.weight, before.lm_head.weight)

    capsys.readouterr()
    assert run(*sft_args(tiny_policy, sft_data, sft_model)) == 0
    assert "complete for this config and inputs; nothing to do" in capsys.readouterr().out
    assert manifest(sft_model)["output_id"] == m["output_id"]


def test_sft_eval_loss_at_step_0_is_the_untrained_models_answer_nll(sft_model, sft_data, tiny_policy, tok):
    """The logged step-0 eval loss is the SFT loss of the starting model on the held-out rows, recomputed here."""
    from rlhf_pipeline.modeling import load_causal_lm
    from rlhf_pipeline.selection import split_indices
    from rlhf_pipeline.chat import encode_answers

    rows = read_jsonl(sft_data)
    _, test_rows = split_indices(len(rows), 16, 0)
    prompts, answers = [rows[i]["prompt"] for i in test_rows], [rows[i]["answer"] for i in test_rows]
    prompt_ids, answer_ids, _ = encode_answers(tok, prompts, answers)
    model = load_causal_lm(tiny_policy, device=torch.device("cpu"))
    expected = sum(_nll_oracle(model, p, a) for p, a in zip(prompt_ids, answer_ids)) / len(test_rows)
    step0 = read_jsonl(sft_model / "metrics.jsonl")[0]
    assert step0["step"] == 0 and step0["loss/eval"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("stage", ["sft", "train-rm"])
def test_a_token_budget_trains_as_batching_by_count(stage, task, tiny_policy, tmp_path, monkeypatch):
    """rlhf sft and rlhf train-rm run on the shared loop: --max-tokens-per-micro-batch cuts each global batch of 8
    rows into micro-batches of several sizes instead of 2 of 4, with the same losses and weights."""
    rows = read_jsonl(task["sft" if stage == "sft" else "preferences"])[:40]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    common = [stage, "--model", tiny_policy, "--data", data, "--test-size", 8, "--max-steps", 3, "--batch-size", 4,
              "--gradient-accumulation-steps", 2, "--learning-rate", 3e-3, "--report-to", "none"]
    assert run(*common, "--output", tmp_path / "count") == 0
    plans = spy_token_budget_plans(monkeypatch)
    assert run(*common, "--output", tmp_path / "tokens", "--max-tokens-per-micro-batch", 150) == 0
    assert len(plans) == 3 and len(micro_batch_sizes(plans) - {4}) >= 2, plans
    assert logged(tmp_path / "tokens") == pytest.approx(logged(tmp_path / "count"), abs=1e-5)
    assert logged(tmp_path / "tokens", "loss/eval") == pytest.approx(logged(tmp_path / "count", "loss/eval"), abs=1e-5)
    assert_same_gradient_norms(tmp_path / "count", tmp_path / "tokens")
    assert max_weight_diff(tmp_path / "tokens", tmp_path / "count") < 1e-4


def test_sft_bad_rows_fail_with_the_row_named(tiny_policy, tmp_path, capsys):
    good = [{"prompt": f"Review the park number {i}.", "answer": "The trees were lovely."} for i in range(20)]
    data = write_jsonl(tmp_path / "no_answer.jsonl", good[:10] + [{"prompt": "Review the lake."}] + good[10:])
    capsys.readouterr()
    assert run(*sft_args(tiny_policy, data, tmp_path / "a"), "--test-size", 0) == 1
    err = capsys.readouterr().err
    assert "no_answer.jsonl: row 10 has neither 'prompt' and 'answer' nor 'messages'" in err
    assert not (tmp_path / "a" / "manifest.json").exists()

    user_last = {"messages": [{"role": "user", "content": "Review it."}, {"role": "assistant", "content": "Good."},
                              {"role": "user", "content": "And the food?"}]}
    data = write_jsonl(tmp_path / "user_last.jsonl", [user_last] + good)
    assert run(*sft_args(tiny_policy, data, tmp_path / "b")) == 1
    err = capsys.readouterr().err
    assert "user_last.jsonl" in err and "must end with a non-empty assistant turn" in err
    assert not (tmp_path / "b" / "manifest.json").exists()


@pytest.mark.parametrize("stage", ["sft", "train-rm"])
def test_a_bad_row_is_named_by_its_row_in_the_file_when_rows_are_held_out(stage, tiny_policy, tmp_path, capsys):
    if stage == "sft":
        good = [{"prompt": f"Review the park number {i}.", "answer": "The trees were lovely."} for i in range(20)]
        bad, expected = {"prompt": "Review the lake."}, "has neither 'prompt' and 'answer' nor 'messages'"
    else:
        good = [{"prompt": f"Review the park number {i}.", "chosen": "Lovely.", "rejected": "Dull."} for i in range(20)]
        bad, expected = {"prompt": "Review the lake.", "chosen": "Lovely."}, "has no 'chosen'/'rejected'"
    data = write_jsonl(tmp_path / "rows.jsonl", good[:10] + [bad] + good[10:])
    capsys.readouterr()
    assert run(stage, "--model", tiny_policy, "--data", data, "--output", tmp_path / "out", "--test-size", 5,
               "--report-to", "none") == 1
    assert f"rows.jsonl: row 10 {expected}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Reward model: the loss and the pair formats


def _reward_alone(model, ids: list[int]) -> float:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


@pytest.mark.parametrize("own_pad", [False, True])
def test_reward_loss_is_bradley_terry_on_rewards_of_each_sequence_alone(tiny_rm, own_pad):
    """``own_pad``: the model's config names a pad id other than the tokenizer's; batches are padded with the
    model's (what prepare_reward_model returns, and train-rm pads with), so each reward is still read at its
    sequence's last real token."""
    from rlhf_pipeline.chat import encode_conversations, load_tokenizer, pad_id
    from rlhf_pipeline.modeling import load_reward_model
    from rlhf_pipeline.rewards import prepare_reward_model
    from rlhf_pipeline.stages.train_rm import RewardTask

    tok = load_tokenizer(tiny_rm)
    model = load_reward_model(tiny_rm, device=torch.device("cpu"))
    if own_pad:
        model.config.pad_token_id = next(i for i in (3, 4, 5) if i != pad_id(tok))
    pad = prepare_reward_model(model, pad_id(tok))
    assert pad == (model.config.pad_token_id if own_pad else pad_id(tok))
    prompts = ["Review the park.", "Review Nova X2, a phone.", "Hi"]
    chosen = ["Lovely.", "The screen was lovely and the battery superb.", "Great food, friendly staff."]
    rejected = ["The paths were dull and the lake messy; I would call it awful.", "Bad.", "Cold soup."]
    rows = [{"chosen_input_ids": c, "rejected_input_ids": r} for c, r in
            zip(encode_conversations(tok, prompts, chosen), encode_conversations(tok, prompts, rejected))]
    assert len({len(x) for r in rows for x in r.values()}) == 6

    task = RewardTask(pad)
    loss, metrics, (real, total) = task.loss(model, task.collate(rows))
    rc = torch.tensor([_reward_alone(model, r["chosen_input_ids"]) for r in rows], dtype=torch.float64)
    rr = torch.tensor([_reward_alone(model, r["rejected_input_ids"]) for r in rows], dtype=torch.float64)
    assert loss.item() == pytest.approx((-F.logsigmoid(rc - rr)).mean().item(), abs=1e-5)
    assert metrics["chosen_reward"].tolist() == pytest.approx(rc.tolist(), abs=1e-5)
    assert metrics["rejected_reward"].tolist() == pytest.approx(rr.tolist(), abs=1e-5)
    assert metrics["accuracy"].tolist() == [float(c > r) for c, r in zip(rc, rr)]
    assert real == sum(len(x) for r in rows for x in r.values())
    assert total == 6 * max(len(x) for r in rows for x in r.values())
    # Swapping chosen and rejected flips the margins: the loss becomes mean(-logsigmoid(rr - rc)).
    swapped = [{"chosen_input_ids": r["rejected_input_ids"], "rejected_input_ids": r["chosen_input_ids"]} for r in rows]
    loss_swapped, _, _ = task.loss(model, task.collate(swapped))
    assert loss_swapped.item() == pytest.approx((-F.logsigmoid(rr - rc)).mean().item(), abs=1e-5)
    assert abs(loss_swapped.item() - loss.item()) > 1e-4


def test_expand_pairs_pairs_reals_answers_by_position_and_names_a_mismatched_row():
    from rlhf_pipeline.stages.train_rm import expand_pairs

    row = {"prompt": "Review it.", "pos_answers": ["great", "good"], "neg_answers": ["awful", "bad"]}
    assert expand_pairs(row, 0, "p.jsonl") == [("Review it.", "great", "awful"), ("Review it.", "good", "bad")]
    assert expand_pairs({"prompt": "q", "chosen": "a", "rejected": "b"}, 0, "p.jsonl") == [("q", "a", "b")]
    for bad in ({"prompt": "q", "pos_answers": ["a", "b"], "neg_answers": ["c"]},
                {"prompt": "q", "pos_answers": [], "neg_answers": []},
                {"prompt": "q", "pos_answers": ["a"]}):
        with pytest.raises(PipelineError, match=r"p\.jsonl: row 4: 'pos_answers' and 'neg_answers' must be"):
            expand_pairs(bad, 4, "p.jsonl")
    with pytest.raises(PipelineError, match=r"p\.jsonl: row 2 has no 'chosen'/'rejected'"):
        expand_pairs({"prompt": "q", "chosen": "a"}, 2, "p.jsonl")


def test_reward_model_trains_on_filter_pairs_of_conversation_prompts(tiny_policy, tmp_path):
    """rlhf filter's pairs carry the prompts' own column: prompts given as messages stay messages, which train-rm
    refused ("text responses need a 'prompt' column")."""
    messages = [{"role": "user", "content": "Review the park."}]
    rows = [{"prompt_id": str(i), "messages": messages, "chosen": "Lovely trees.", "rejected": "Dull."}
            for i in range(8)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert run("train-rm", "--model", tiny_policy, "--data", data, "--output", tmp_path / "rm", "--max-steps", 1,
               "--batch-size", 2, "--test-size", 0, "--report-to", "none") == 0
    from rlhf_pipeline.stages.train_rm import expand_pairs

    whole = messages + [{"role": "assistant", "content": "Lovely trees."}]  # a whole conversation is no prompt
    assert expand_pairs({"messages": whole, "chosen": "a", "rejected": "b"}, 0, "p") == [(None, "a", "b")]


def test_reals_format_trains_on_every_positional_pair(tiny_policy, tmp_path):
    """pos_answers/neg_answers rows expand into one training pair per position (3 rows x 2 = 6 + test pairs)."""
    from datasets import Dataset, DatasetDict

    train = [{"prompt": f"Review place {i}.", "pos_answers": ["Lovely and warm.", "Great."],
              "neg_answers": ["Awful.", "Dull and noisy."]} for i in range(3)]
    test = [{"prompt": "Review it.", "pos_answers": ["Superb."], "neg_answers": ["Bad."]}]
    DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)}).save_to_disk(str(tmp_path / "d"))
    assert run("train-rm", "--model", tiny_policy, "--data", tmp_path / "d", "--output", tmp_path / "rm",
               "--batch-size", 2, "--max-steps", 1, "--report-to", "none") == 0
    assert manifest(tmp_path / "rm")["training"]["pairs"] == {"train": 6, "test": 1}


def test_pairs_without_a_preference_are_dropped_and_counted(tiny_policy, tmp_path):
    """A pair whose chosen and rejected conversations are the same tokens teaches nothing (loss log 2, no gradient)
    and counted as a wrong answer in the eval accuracy: dropped, per split, in the manifest."""
    from datasets import Dataset, DatasetDict

    train = [{"prompt": f"Review place {i}.", "chosen": "Lovely.", "rejected": "Lovely." if i < 2 else "Dull."}
             for i in range(5)]
    test = [{"prompt": "Review it.", "chosen": "Superb.", "rejected": "Bad."},
            {"prompt": "Review that.", "chosen": "Fine.", "rejected": "Fine."}]
    DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)}).save_to_disk(str(tmp_path / "d"))
    assert run("train-rm", "--model", tiny_policy, "--data", tmp_path / "d", "--output", tmp_path / "rm",
               "--batch-size", 2, "--max-steps", 1, "--report-to", "none") == 0
    m = manifest(tmp_path / "rm")
    assert m["training"]["pairs"] == {"train": 3, "test": 1}
    assert m["dropped"] == {"train:identical": 2, "test:identical": 1}


# ---------------------------------------------------------------------------------------------------------------
# Reward model: the stage


@pytest.fixture(scope="module")
def rm_model(task, tiny_policy, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rm")
    data = write_jsonl(d / "prefs.jsonl", read_jsonl(task["preferences"])[:400])
    assert run("train-rm", "--model", tiny_policy, "--data", data, "--output", d / "out", "--test-size", 100,
               "--epochs", 2, "--learning-rate", 1e-3, "--batch-size", 16, "--report-to", "none") == 0
    return d / "out"


def test_a_causal_lm_loads_as_a_reward_model_without_transformers_load_report(tiny_policy, tmp_path, caplog):
    """From a causal LM the LM head is left out and the score head is new, always: transformers' report of that (a
    table per process, "Consider training on your downstream task") is not shown. A body weight missing from the
    checkpoint still is, as a warning naming it; a load that fails shows the report its error points to."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    from rlhf_pipeline.stages.train_rm import load_reward_model_for_training

    class Reports(logging.Handler):  # what reaches transformers' handlers (its logger does not propagate)
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    reports = Reports()
    logging.getLogger("transformers.modeling_utils").addHandler(reports)
    try:
        with caplog.at_level("WARNING"):
            model = load_reward_model_for_training(tiny_policy)
        assert model.config.num_labels == 1 and not caplog.records
        assert not [m for m in reports.messages if "LOAD REPORT" in m]
        damaged = shutil.copytree(tiny_policy, tmp_path / "damaged")
        weights = load_file(str(damaged / "model.safetensors"))
        del weights["model.layers.0.mlp.up_proj.weight"]
        save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
        with caplog.at_level("WARNING"):
            load_reward_model_for_training(str(damaged))
        assert [r.getMessage() for r in caplog.records] == [
            f"{damaged}: 1 weight of the model missing from it, so initialised at random: "
            "model.layers.0.mlp.up_proj.weight"]
        assert not [m for m in reports.messages if "LOAD REPORT" in m]
        two_labels = tmp_path / "two_labels"
        AutoModelForSequenceClassification.from_pretrained(tiny_policy, num_labels=2).save_pretrained(two_labels)
        with pytest.raises(RuntimeError, match="look at the above report"):
            load_reward_model_for_training(str(two_labels))
        assert [m for m in reports.messages if "LOAD REPORT" in m and "MISMATCH" in m]
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(reports)


def test_reward_model_learns_the_gold_preferences_and_loads_for_scoring(rm_model):
    from transformers import AutoModelForSequenceClassification

    m = manifest(rm_model)
    assert m["stage"] == "train-rm"
    assert m["training"]["pairs"] == {"train": 300, "test": 100}
    evals = [r for r in read_jsonl(rm_model / "metrics.jsonl") if "reward/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2 * (300 // 16)]
    assert m["training"]["eval"]["accuracy"] == pytest.approx(evals[-1]["reward/accuracy"], abs=1e-6)
    assert evals[-1]["reward/accuracy"] > 0.75, evals  # chance is 0.5; it reaches about 0.9
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"] - 0.2, evals

    model = AutoModelForSequenceClassification.from_pretrained(str(rm_model))
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    assert model.score.weight.shape[0] == 1


@pytest.fixture(scope="module")
def generations(task, tiny_policy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "gen"
    assert run("generate", "--model", tiny_policy, "--prompts", task["eval_prompts"], "--output", out, "--n", 2,
               "--limit", 4, "--max-new-tokens", 12, "--engine", "hf") == 0
    return out


def test_score_with_the_trained_reward_model_equals_its_forward(rm_model, generations, tmp_path):
    from rlhf_pipeline.chat import load_tokenizer

    assert run("score", "--input", generations, "--output", tmp_path / "scored", "--reward-model", rm_model,
               "--batch-size", 3) == 0
    scored = load_from_disk(str(tmp_path / "scored"))
    assert scored.num_rows == 4 and all(len(r) == 2 for r in scored["rewards"])

    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(str(rm_model))
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_model)).eval()
    for row in scored:
        for response, reward in zip(row["responses"], row["rewards"]):
            ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": response}], tokenize=True,
                                          return_dict=True)["input_ids"]
            assert reward == pytest.approx(_reward_alone(model, list(ids)), abs=1e-4)
    assert len({round(r, 4) for rs in scored["rewards"] for r in rs}) > 1


# ---------------------------------------------------------------------------------------------------------------
# Eval: the numbers


def test_mean_and_stderr_by_hand():
    from rlhf_pipeline.evalstats import mean_and_stderr

    mean, stderr = mean_and_stderr([1, 2, 3, 4])
    assert mean == 2.5
    assert stderr == pytest.approx(math.sqrt((5 / 3) / 4))  # sample variance (2.25+.25+.25+2.25)/3, over n = 4
    assert mean_and_stderr([7.0]) == (7.0, None)
    assert mean_and_stderr([2.0, 2.0]) == (2.0, 0.0)


def test_summarize_by_hand():
    from rlhf_pipeline.stages.eval import summarize

    ours = [[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]]
    theirs = [[0.0, 0.0, 0.7], [0.1, 0.3, 0.9]]
    # prompt 0: win, tie, loss; prompt 1: win, loss, tie
    s = summarize(ours, theirs)
    assert (s["wins"], s["ties"], s["losses"]) == (2, 2, 2)
    assert s["win_rate"] == pytest.approx((2 + 2 / 2) / 6)
    # mean over prompts of each prompt's mean: (0.5 + 1.3/3) / 2
    assert s["mean"] == pytest.approx((0.5 + 1.3 / 3) / 2)
    assert s["stderr"] == pytest.approx(abs(0.5 - 1.3 / 3) / 2)  # two values: sd = |a - b| / sqrt 2, over sqrt 2
    assert s["baseline_mean"] == pytest.approx((0.7 / 3 + 1.3 / 3) / 2)
    # the gain and its paired standard error: per-prompt differences 0.5 - 0.7/3 and 1.3/3 - 1.3/3 = 0
    assert s["gain"] == pytest.approx((0.5 - 0.7 / 3) / 2)
    assert s["gain_stderr"] == pytest.approx(abs(0.5 - 0.7 / 3) / 2)
    # prompts of shared difficulty: a gain the combined standard errors hide, and their pairing shows
    easy_hard = summarize([[1.1], [5.1], [9.2]], [[1.0], [5.0], [9.0]])
    combined = (easy_hard["stderr"] ** 2 + easy_hard["baseline_stderr"] ** 2) ** 0.5
    assert easy_hard["gain"] / combined < 0.1 and easy_hard["gain"] / easy_hard["gain_stderr"] > 2

    s = summarize([[1.0], [3.0, 5.0]], None)  # uneven counts: per-prompt means 1 and 4
    assert s["mean"] == pytest.approx(2.5) and s["win_rate"] is None and s["wins"] is None
    assert summarize([[1.0, 1.0]], [[0.0, 2.0]])["win_rate"] == 0.5
    assert summarize([[3.0, 1.0, 1.0]], [[0.0, 0.0, 2.0]])["win_rate"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------------------------
# Eval: the stage


def eval_args(model, prompts, out, *extra) -> list:
    return ["eval", "--model", model, "--prompts", prompts, "--output", out, "--n", 2, "--max-new-tokens", 12,
            "--limit", 12, "--engine", "hf", *extra]


def _per_prompt(samples, column: str) -> dict[str, list[float]]:
    return dict(zip(samples["prompt_id"], samples[column]))


@pytest.fixture(scope="module")
def eval_self(task, tiny_policy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "self"
    assert run(*eval_args(tiny_policy, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", tiny_policy)) == 0
    return out


def test_eval_against_itself_ties_everything_and_its_mean_is_the_samples_mean(eval_self, task):
    results = json.loads((eval_self / "results.json").read_text())
    assert manifest(eval_self)["stage"] == "eval" and manifest(eval_self)["eval"] == results
    assert results["num_prompts"] == 12 and results["n"] == 2
    s = results["scores"]["reward_fn"]
    assert s["scorer"] == GOLD
    assert s["win_rate"] == 0.5 and s["ties"] == 24 and s["wins"] == 0 and s["losses"] == 0
    assert not (eval_self / "baseline").exists()

    samples = load_from_disk(str(eval_self / "samples"))
    assert samples.num_rows == 12
    expected_ids = [r["id"] for r in read_jsonl(task["eval_prompts"])[:12]]
    assert samples["prompt_id"] == expected_ids
    rewards = samples["rewards_reward_fn"]
    # The stored rewards are the gold reward of the stored responses.
    for prompt, responses, rs in zip(samples["prompt"], samples["responses"], rewards):
        assert rs == pytest.approx(gold_reward([prompt] * len(responses), responses))
    per_prompt = [sum(r) / len(r) for r in rewards]
    assert s["mean"] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-12)
    assert samples["baseline_rewards_reward_fn"] == rewards
    lengths = [len(t) for t in load_from_disk(str(eval_self / "generate"))["response_token_ids"] for t in t]
    assert results["response_tokens_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert all(1 <= n <= 12 for n in lengths)


@pytest.fixture(scope="module")
def eval_sft(eval_self, sft_model, task, tmp_path_factory) -> Path:
    """The SFT model evaluated against the earlier evaluation of the tiny policy (its samples reused)."""
    out = tmp_path_factory.mktemp("eval") / "sft"
    assert run(*eval_args(sft_model, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", eval_self)) == 0
    return out


def results_of(eval_dir: Path) -> dict:
    return json.loads((eval_dir / "results.json").read_text())


def test_eval_reuses_an_earlier_evals_samples_as_the_baseline(eval_sft, eval_self):
    assert not (eval_sft / "baseline").exists()  # nothing sampled for the baseline: the earlier samples are reused
    results = results_of(eval_sft)
    assert str(eval_self) in results["baseline"]
    s = results["scores"]["reward_fn"]

    ours = load_from_disk(str(eval_sft / "samples"))
    theirs = load_from_disk(str(eval_self / "samples"))
    mine, base = _per_prompt(ours, "rewards_reward_fn"), _per_prompt(theirs, "rewards_reward_fn")
    assert set(mine) == set(base) and len(mine) == 12
    assert ours["baseline_rewards_reward_fn"] == [base[i] for i in ours["prompt_id"]]
    wins = ties = losses = 0
    for pid in mine:
        assert len(mine[pid]) == len(base[pid]) == 2
        for a, b in zip(mine[pid], base[pid]):
            wins, ties, losses = wins + (a > b), ties + (a == b), losses + (a < b)
    assert (s["wins"], s["ties"], s["losses"]) == (wins, ties, losses)
    assert s["win_rate"] == pytest.approx((wins + ties / 2) / 24)
    assert wins + losses > 0, "the comparison should not be all ties (then the check above proves little)"
    assert s["baseline_mean"] == pytest.approx(results_of(eval_self)["scores"]["reward_fn"]["mean"])
    per_prompt = [sum(r) / len(r) for r in ours["rewards_reward_fn"]]
    assert s["mean"] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-12)
    assert s["mean"] != s["baseline_mean"]
    assert ours["responses"] != theirs["responses"]  # the SFT model's own samples, not the baseline's


def test_a_baseline_eval_whose_scorer_changed_since_is_scored_again(sft_model, tiny_policy, task, tmp_path,
                                                                    capsys):
    """An earlier evaluation reused as the baseline keeps its samples, but its rewards are its scorer's as it was:
    a reward function edited since (or a reward model trained again at its path) scores those samples again, rather
    than compare this evaluation's rewards with stale ones (the win rate was silently wrong)."""
    fn = tmp_path / "length.py"
    fn.write_text("def reward(prompts, responses, **columns):\n    return [float(len(r)) for r in responses]\n")
    earlier = tmp_path / "earlier"
    assert run(*eval_args(tiny_policy, task["eval_prompts"], earlier, "--reward-fn", f"{fn}:reward")) == 0
    fn.write_text("def reward(prompts, responses, **columns):\n    return [-float(len(r)) for r in responses]\n")
    capsys.readouterr()
    out = tmp_path / "later"
    assert run(*eval_args(sft_model, task["eval_prompts"], out, "--reward-fn", f"{fn}:reward",
                          "--baseline", earlier)) == 0
    assert f"--reward-fn {fn}:reward changed since {earlier} scored its samples: scoring them again" in (
        capsys.readouterr().out)
    samples = load_from_disk(str(out / "samples"))
    theirs = load_from_disk(str(earlier / "generate"))
    negative = {pid: [-float(len(r)) for r in rs] for pid, rs in zip(theirs["prompt_id"], theirs["responses"])}
    assert samples["baseline_rewards_reward_fn"] == [negative[i] for i in samples["prompt_id"]]
    assert not (out / "baseline" / "generate").exists()  # the earlier samples, not new ones
    assert "scored again" in results_of(out)["baseline"]


def test_eval_samples_a_trained_model_given_as_the_baseline(eval_sft, sft_model, tiny_policy, task, tmp_path):
    out = tmp_path / "vs_sft"
    assert run(*eval_args(tiny_policy, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", sft_model)) == 0
    assert (out / "baseline" / "generate" / "manifest.json").exists()
    # Sampled with the same settings and seed as eval_sft sampled the SFT model, so the same rewards, and the
    # comparison is eval_sft's seen from the other side.
    samples = load_from_disk(str(out / "samples"))
    sft_rewards = _per_prompt(load_from_disk(str(eval_sft / "samples")), "rewards_reward_fn")
    assert samples["baseline_rewards_reward_fn"] == [sft_rewards[i] for i in samples["prompt_id"]]
    s, other = results_of(out)["scores"]["reward_fn"], results_of(eval_sft)["scores"]["reward_fn"]
    assert (s["wins"], s["ties"], s["losses"]) == (other["losses"], other["ties"], other["wins"])


def test_eval_refuses_a_baseline_eval_scored_with_another_scorer(eval_self, rm_model, tiny_policy, task, tmp_path,
                                                                   capsys):
    capsys.readouterr()
    out = tmp_path / "rm_eval"
    assert run(*eval_args(tiny_policy, task["eval_prompts"], out, "--reward-model", rm_model,
                          "--baseline", eval_self)) == 1
    err = capsys.readouterr().err
    assert "was not scored with --reward-model" in err and str(eval_self) in err
    assert not (out / "manifest.json").exists() and not (out / "results.json").exists()


def test_eval_refuses_a_baseline_eval_made_under_another_chat_template(eval_self, tiny_policy, task, tmp_path,
                                                                       capsys):
    """The template the prompts were rendered with is a sampling setting like --n: the baseline's samples under
    another one answer other inputs."""
    capsys.readouterr()
    out = tmp_path / "chatml"
    assert run(*eval_args(tiny_policy, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", eval_self,
                          "--chat-template", "chatml")) == 1
    assert "sampled with other settings (--chat-template None vs chatml)" in capsys.readouterr().err
    assert not out.exists()


def test_eval_refuses_a_baseline_directory_that_is_neither_a_model_nor_an_eval(generations, tiny_policy, task,
                                                                               tmp_path, capsys):
    capsys.readouterr()
    assert run(*eval_args(tiny_policy, task["eval_prompts"], tmp_path / "e", "--reward-fn", GOLD,
                          "--baseline", generations)) == 1
    assert "holds a generate output, not a model or an rlhf eval output" in capsys.readouterr().err
    assert not (tmp_path / "e" / "manifest.json").exists()
    # an evaluation that has not finished (its samples, no manifest yet): said so, not "not a model"
    import shutil

    unfinished = tmp_path / "unfinished"
    shutil.copytree(generations, unfinished / "generate")
    assert run(*eval_args(tiny_policy, task["eval_prompts"], tmp_path / "e", "--reward-fn", GOLD,
                          "--baseline", unfinished)) == 1
    assert "holds an unfinished rlhf eval (no manifest.json yet); run its command again" in capsys.readouterr().err


def test_an_unfinished_eval_whose_parts_differ_is_redone_with_overwrite(eval_self, tiny_policy, task, tmp_path,
                                                                         capsys):
    """An unfinished evaluation continues with its finished parts; a part made with other settings (here a score
    batch size, which its score part records) is refused with "pass --overwrite", and --overwrite then redoes it
    (the parts were run without it, and kept refusing)."""
    import shutil

    out = Path(shutil.copytree(eval_self, tmp_path / "eval"))
    (out / "manifest.json").unlink()
    (out / "results.json").unlink()  # as if killed after its parts were written
    args = eval_args(tiny_policy, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", tiny_policy,
                     "--score-batch-size", 4)
    capsys.readouterr()
    assert run(*args) == 1
    assert "batch_size 16 -> 4" in capsys.readouterr().err
    assert run(*args, "--overwrite") == 0
    assert json.loads((out / "results.json").read_text()) == json.loads((eval_self / "results.json").read_text())


def test_an_unfinished_eval_continues_with_its_parts_and_says_it_resumed(eval_self, tiny_policy, task, tmp_path):
    """Rerun with the same options, an evaluation killed after its parts were written finishes from them, and its
    manifest says ``"resumed": true``: its wall time is that attempt's alone (the report marks it ``+``)."""
    import shutil

    out = Path(shutil.copytree(eval_self, tmp_path / "eval"))
    (out / "manifest.json").unlink()
    (out / "results.json").unlink()
    assert "resumed" not in manifest(eval_self)
    assert run(*eval_args(tiny_policy, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", tiny_policy)) == 0
    assert manifest(out)["resumed"] is True
    assert json.loads((out / "results.json").read_text()) == json.loads((eval_self / "results.json").read_text())


def test_eval_refuses_a_baseline_eval_sampled_with_other_settings_before_sampling(eval_self, tiny_policy, task,
                                                                                  tmp_path, capsys):
    """With another --n, response j would be compared with only some of the baseline's responses; refused, and
    before this evaluation samples anything."""
    capsys.readouterr()
    out = tmp_path / "n3"
    args = eval_args(tiny_policy, task["eval_prompts"], out, "--reward-fn", GOLD, "--baseline", eval_self)
    args[args.index("--n") + 1] = 3
    assert run(*args) == 1
    err = capsys.readouterr().err
    assert "sampled with other settings (--n 2 vs 3)" in err
    assert not (out / "generate").exists()
    # other prompts: refused before sampling too (it was found only once both had been sampled and scored)
    other = write_jsonl(tmp_path / "other_prompts.jsonl", read_jsonl(task["eval_prompts"])[::-1])
    assert run(*eval_args(tiny_policy, other, out, "--reward-fn", GOLD, "--baseline", eval_self)) == 1
    assert "that evaluation was made on other prompts" in capsys.readouterr().err
    assert not out.exists()
