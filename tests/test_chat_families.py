"""Real chat-template families through the pipeline: Llama-3, ChatML (Qwen), Mistral and Gemma tiny tokenizers.

Each family's tokenizer carries its public format (``rlhf_pipeline.tiny.CHAT_FORMATS``). On each, checked against
the template's own rendering and against the format written out by hand below (so a template bug shows):
generate feeds the engine the template's ids with exactly one BOS (none for ChatML); sampling stops on the
end-of-turn token (Llama-3's ``<|eot_id|>`` and Gemma's ``<end_of_turn>`` come from the generation config, not the
tokenizer's EOS); SFT's loss covers exactly the answer and its end-of-turn token; a reward model reads the
conversation through its own template; filter and the trainer work on exactly the prompt ids + the sampled ids.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import load_from_disk

from conftest import make_stop_prone, run, write_jsonl

FAMILIES = ["llama3", "chatml", "mistral", "gemma"]
MAX_NEW_TOKENS = 12
N = 4
# The generations whose samples the stop/limit tests read, (generate options, token limit): the kit's, where most
# samples end their turn (a third of the probability at each step: about 1 in 130 runs 12 tokens), and one of a
# single token, where about two in three reach the limit, so that both kinds are there whatever the draw.
GENERATIONS = [((), MAX_NEW_TOKENS), (("--max-new-tokens", 1), 1)]

# A multi-turn conversation with a system turn, to be answered with ANSWER.
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello you"},
    {"role": "user", "content": "Review the lake."},
]
ANSWER = "Calm and clear."
PROMPT_ROWS = [
    [{"role": "user", "content": "Review the park Oak Hollow."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Review the album Night Train."}],
    MESSAGES,
    [{"role": "user", "content": "Write a short review of the film Red Harbor."}],
]


@dataclass(frozen=True)
class Rendering:
    """MESSAGES + ANSWER written out by hand from the family's published format."""

    prompt: str  # MESSAGES with the generation prompt: what generate feeds the engine
    answer: str  # what the assistant turn adds: the answer and the end-of-turn token (sampling stops there)
    after: str  # what the template writes after the end-of-turn token (never sampled)
    end_of_turn: str


HAND_WRITTEN = {
    "llama3": Rendering(
        prompt="<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello you<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nReview the lake.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        answer="Calm and clear.<|eot_id|>",
        after="",
        end_of_turn="<|eot_id|>",
    ),
    "chatml": Rendering(
        prompt="<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello you<|im_end|>\n<|im_start|>user\nReview the lake.<|im_end|>\n"
        "<|im_start|>assistant\n",
        answer="Calm and clear.<|im_end|>",
        after="\n",
        end_of_turn="<|im_end|>",
    ),
    "mistral": Rendering(  # the system prompt is folded into the first user turn
        prompt="<s>[INST] Be brief.\n\nHi there [/INST] Hello you</s>[INST] Review the lake. [/INST]",
        answer=" Calm and clear.</s>",
        after="",
        end_of_turn="</s>",
    ),
    "gemma": Rendering(  # the system prompt is folded into the first user turn; the assistant is "model"
        prompt="<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello you<end_of_turn>\n<start_of_turn>user\nReview the lake.<end_of_turn>\n"
        "<start_of_turn>model\n",
        answer="Calm and clear.<end_of_turn>",
        after="\n",
        end_of_turn="<end_of_turn>",
    ),
}

# Distinct rewards for distinct texts (few ties), so most prompts give a pair.
REWARD_FN = '''
def reward(prompts, responses, **columns):
    return [len(r) + (sum(map(ord, r)) % 97) / 100 + (1.0 if f == "stop" else 0.0)
            for r, f in zip(responses, columns["finish_reasons"])]
'''


def encode(tok, text: str) -> list[int]:
    """A hand-written rendering as ids: special tokens in the text are parsed, none added."""
    return tok(text, add_special_tokens=False)["input_ids"]


def template_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  return_dict=True)
    return list(out["input_ids"])


def make_family_stop_prone(path: Path, family: str, logit: float = 0.6) -> None:
    """Make the family's end-of-turn token likely after every token and its other stop tokens unlikely (see
    ``conftest.make_stop_prone``): most samples stop within 12 tokens, some hit the limit, and a stop is always on
    the end-of-turn token."""
    from transformers import AutoTokenizer

    from rlhf_pipeline.tiny import chat_format_spec

    spec = chat_format_spec(family)
    tok = AutoTokenizer.from_pretrained(path)
    others = (set(spec.generation_eos) | {spec.eos}) - {spec.end_of_turn}
    make_stop_prone(path, tok.convert_tokens_to_ids(spec.end_of_turn),
                    tuple(tok.convert_tokens_to_ids(t) for t in sorted(others)), logit=logit)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """Per family, built once for the module: a stop-prone tiny policy, a tiny reward model, and the outputs of
    generate -> score (a python reward) -> filter on the policy, each stage run in-process once."""
    from rlhf_pipeline.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("families")
    prompts = write_jsonl(root / "prompts.jsonl", [{"messages": m, "label": i} for i, m in enumerate(PROMPT_ROWS)])
    (root / "rewards.py").write_text(REWARD_FN)

    @functools.cache
    def policy(family: str) -> Path:
        path = save_tiny_model(root / f"{family}-policy", chat_format=family)
        make_family_stop_prone(path, family)
        return path

    @functools.cache
    def reward_model(family: str) -> Path:
        return save_tiny_model(root / f"{family}-rm", kind="reward", seed=1, chat_format=family)

    @functools.cache
    def stage(family: str, name: str, *options) -> Path:
        """The output of ``generate`` (with ``options``), ``score`` or ``filter`` (pairs, with ``options``)."""
        out = root / "-".join([family, name, *map(str, options)])
        if name == "generate":
            args = ["generate", "--model", policy(family), "--prompts", prompts, "--output", out, "--engine", "hf",
                    "--n", N, "--max-new-tokens", MAX_NEW_TOKENS, "--seed", 0, *options]
        elif name == "score":
            args = ["score", "--input", stage(family, "generate"), "--output", out,
                    "--reward-fn", f"{root}/rewards.py:reward"]
        else:
            args = ["filter", "--input", stage(family, "score"), "--output", out, "--tokenizer", policy(family),
                    "--test-size", 1, *options]
        assert run(*args) == 0
        return out

    return SimpleNamespace(policy=policy, reward_model=reward_model, stage=stage)


def load_tok(path):
    from rlhf_pipeline.chat import load_tokenizer

    return load_tokenizer(str(path))


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_feeds_the_templates_own_ids_with_one_bos(kit, family):
    tok = load_tok(kit.policy(family))
    ds = load_from_disk(str(kit.stage(family, "generate")))
    assert ds["label"] == list(range(len(PROMPT_ROWS)))  # one row per prompt, in order
    for messages, ids in zip(PROMPT_ROWS, ds["prompt_token_ids"]):
        assert ids == template_ids(tok, messages, add_generation_prompt=True)
        if family == "chatml":
            assert tok.bos_token_id is None  # ChatML has no BOS at all
        else:
            assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # The format written out by hand: a template bug (a missing newline, a role name, the system turn) shows here.
    hand = HAND_WRITTEN[family]
    assert ds["prompt_token_ids"][PROMPT_ROWS.index(MESSAGES)] == encode(tok, hand.prompt)
    if tok.bos_token_id is not None:  # the trap avoided: re-encoding the rendered text adds a second BOS
        assert tok(hand.prompt)["input_ids"][:2] == [tok.bos_token_id] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_stops_on_the_end_of_turn_token(kit, family):
    tok = load_tok(kit.policy(family))
    hand = HAND_WRITTEN[family]
    end_of_turn = tok.convert_tokens_to_ids(hand.end_of_turn)
    gen = kit.stage(family, "generate")
    stop_ids = manifest(gen)["sampling"]["stop_token_ids"]
    assert end_of_turn in stop_ids
    if family in ("llama3", "gemma"):  # the turn end is not the tokenizer's EOS: it comes from the generation config
        assert end_of_turn != tok.eos_token_id
        assert end_of_turn in json.loads((kit.policy(family) / "generation_config.json").read_text())["eos_token_id"]
    seen = []
    for options, limit in GENERATIONS:
        ds = load_from_disk(str(kit.stage(family, "generate", *options)))
        finishes = [f for fs in ds["finish_reasons"] for f in fs]
        if limit == MAX_NEW_TOKENS:
            assert finishes.count("stop") >= 0.75 * len(finishes)  # stop-prone: most samples end their turn
        seen += finishes
        for texts, samples, reasons in zip(ds["responses"], ds["response_token_ids"], ds["finish_reasons"]):
            for text, ids, reason in zip(texts, samples, reasons):
                if reason == "stop":
                    assert ids[-1] == end_of_turn and not set(ids[:-1]) & set(stop_ids)
                else:
                    assert len(ids) == limit and not set(ids) & set(stop_ids)
                assert hand.end_of_turn not in text  # texts (for people and reward models) carry no turn marker
    assert set(seen) == {"stop", "length"}  # both kinds were checked


@pytest.mark.parametrize("family", FAMILIES)
def test_filter_tokenizes_responses_without_ids_as_sampling_ends_them(kit, family):
    """Data from another sampler, texts only: each response is tokenized in its conversation, so a finished one ends
    with the template's turn end, as sampled (Llama-3's <|eot_id|> and Gemma's <end_of_turn>, not the tokenizer's
    EOS it ended with before), and one cut at the token limit ends with no stop token."""
    from rlhf_pipeline.chat import stop_token_ids
    from rlhf_pipeline.stages.filter import _tokenize_missing

    tok = load_tok(kit.policy(family))
    end_of_turn = tok.convert_tokens_to_ids(HAND_WRITTEN[family].end_of_turn)
    stops = tuple(stop_token_ids(tok, str(kit.policy(family))))
    seen = set()
    for options, _ in GENERATIONS:
        ds = load_from_disk(str(kit.stage(family, "generate", *options)))
        batch = {"messages": ds["messages"], "responses": ds["responses"], "finish_reasons": ds["finish_reasons"]}
        _tokenize_missing(batch, list(range(ds.num_rows)), "generated.jsonl", tok, "messages", stops)
        for texts, samples, reasons in zip(ds["responses"], batch["response_token_ids"], ds["finish_reasons"]):
            for text, ids, reason in zip(texts, samples, reasons):
                seen.add(reason)
                if reason == "stop":
                    assert ids[-1] == end_of_turn and not set(ids[:-1]) & set(stops)
                else:
                    assert not set(ids) & set(stops)
                assert tok.decode([t for t in ids if t not in stops]).strip() == text.strip()  # templates trim
        assert batch["prompt_token_ids"] == ds["prompt_token_ids"]
    assert seen == {"stop", "length"}


def test_filter_keeps_the_text_of_a_response_its_template_rewrites(kit):
    """A reasoning template that writes an empty think block before the last assistant turn's content (Qwen3's)
    would put tokens the policy never sampled into the response: the response is then encoded as its text,
    followed by the turn end the template closes it with."""
    from rlhf_pipeline.chat import stop_token_ids
    from rlhf_pipeline.stages.filter import _tokenize_missing

    tok = load_tok(kit.policy("chatml"))
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}[think] [/think] "
        "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}")
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    batch = {"prompt": ["Review the park.", "Hi"], "responses": [["Green and quiet.", "Dull"], ["Hello there."]],
             "finish_reasons": [["stop", "length"], ["stop"]]}
    _tokenize_missing(batch, [0, 1], "data.jsonl", tok, "prompt", tuple(stop_token_ids(tok, str(kit.policy("chatml")))))
    (quiet, dull), (hello,) = batch["response_token_ids"]
    assert quiet == tok("Green and quiet.", add_special_tokens=False)["input_ids"] + [end_of_turn]
    assert dull == tok("Dull", add_special_tokens=False)["input_ids"]  # cut at the token limit: no turn end
    assert tok.decode(hello[:-1]) == "Hello there." and hello[-1] == end_of_turn


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss_covers_exactly_the_answer_and_its_end_of_turn(kit, family):
    from rlhf_pipeline.chat import encode_answers, encode_prompts, pad_id, stop_token_ids
    from rlhf_pipeline.stages.sft import SFTTask, split_conversation

    model = kit.policy(family)
    tok = load_tok(model)
    hand = HAND_WRITTEN[family]
    end_of_turn = tok.convert_tokens_to_ids(hand.end_of_turn)
    rows = [{"messages": MESSAGES + [{"role": "assistant", "content": ANSWER}]},  # multi-turn, with a system turn
            {"prompt": "Review the park Oak Hollow.", "answer": "Green and quiet."}]
    prompts, answers = zip(*(split_conversation(r, i, "demos.jsonl") for i, r in enumerate(rows)))
    prompt_ids, answer_ids, fallbacks = encode_answers(tok, list(prompts), list(answers),
                                                       stop_token_ids(tok, str(model)))
    assert fallbacks == 0
    assert prompt_ids == encode_prompts(tok, list(prompts))  # exactly what generate feeds the policy
    assert prompt_ids[0] == encode(tok, hand.prompt) and answer_ids[0] == encode(tok, hand.answer)
    for p, a, messages in [(prompt_ids[0], answer_ids[0], rows[0]["messages"]),
                           (prompt_ids[1], answer_ids[1], [{"role": "user", "content": rows[1]["prompt"]},
                                                           {"role": "assistant", "content": rows[1]["answer"]}])]:
        assert a[-1] == end_of_turn and end_of_turn not in a[:-1]
        # The whole rendered conversation is prompt + answer + what the template writes after the turn's end. For
        # ChatML and Gemma that is a "\n", and it is NOT trained on: sampling stops on the end-of-turn token, so the
        # policy never produces that newline (the next prompt's template writes it), and the RL stages train on
        # sampled ids that end at the end-of-turn token; SFT learns exactly the ids the policy will sample.
        assert p + a + encode(tok, hand.after) == template_ids(tok, messages, add_generation_prompt=False)

    batch = SFTTask(pad_id(tok)).collate([{"prompt_token_ids": p, "answer_token_ids": a}
                                          for p, a in zip(prompt_ids, answer_ids)])
    for i, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        row = batch.input_ids[i]
        assert row[batch.response_mask[i]].tolist() == a  # the loss positions hold exactly the answer's ids
        assert row[batch.seq_ids[i] == i].tolist() == p + a


def test_sft_stage_trains_up_to_the_end_of_turn_from_the_generation_config(kit, tmp_path, monkeypatch,
                                                                           fresh_accelerate_state):
    """``rlhf sft`` passes the model's stop tokens on: Gemma's <end_of_turn> is not the tokenizer's EOS, so only the
    generation config can tell the stage where the answer ends (before the template's "\\n")."""
    import rlhf_pipeline.chat as chat

    model = kit.policy("gemma")
    tok = load_tok(model)
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    seen, real = [], chat.encode_answers

    def recording(*args, **kwargs):  # the answer ids the stage trains on
        out = real(*args, **kwargs)
        seen.extend(out[1])
        return out

    monkeypatch.setattr(chat, "encode_answers", recording)  # read by the stage when it tokenizes
    rows = [{"messages": MESSAGES + [{"role": "assistant", "content": ANSWER}]},
            {"prompt": "Review the park Oak Hollow.", "answer": "Green and quiet."}]
    assert run("sft", "--model", model, "--data", write_jsonl(tmp_path / "demos.jsonl", rows), "--output",
               tmp_path / "sft", "--test-size", 0, "--max-steps", 1, "--batch-size", 2, "--report-to", "none") == 0
    assert len(seen) == 2 and all(a[-1] == end_of_turn for a in seen)
    assert seen[0] == encode(tok, HAND_WRITTEN["gemma"].answer)


@pytest.mark.parametrize("family", FAMILIES)
def test_reward_model_reads_the_conversation_through_its_own_template(kit, family):
    from rlhf_pipeline.chat import as_messages, encode_conversations
    from rlhf_pipeline.rewards import RewardModelScorer

    tok = load_tok(kit.policy(family))
    hand = HAND_WRITTEN[family]
    (ids,) = encode_conversations(tok, [MESSAGES], [ANSWER])
    assert ids == template_ids(tok, MESSAGES + [{"role": "assistant", "content": ANSWER}], False)
    assert ids == encode(tok, hand.prompt + hand.answer + hand.after)

    # score.py gives the reward model the prompt and the response *text* (decoded without special tokens), which
    # the reward model renders with its own template: by design, since it may have another tokenizer. Here a
    # reward model of the next family reads this family's generations.
    rm_family = FAMILIES[(FAMILIES.index(family) + 1) % len(FAMILIES)]
    rm_path = kit.reward_model(rm_family)
    rm_tok = load_tok(rm_path)
    rm_end = rm_tok.convert_tokens_to_ids(HAND_WRITTEN[rm_family].end_of_turn)
    ds = load_from_disk(str(kit.stage(family, "generate")))
    prompts = [m for m, rs in zip(ds["messages"], ds["responses"]) for _ in rs]
    responses = [r for rs in ds["responses"] for r in rs]
    scorer = RewardModelScorer(str(rm_path))
    for prompt, response, rm_ids in zip(prompts, responses, scorer.encode(prompts, responses)):
        conversation = as_messages(prompt) + [{"role": "assistant", "content": response}]
        assert rm_ids == template_ids(rm_tok, conversation, add_generation_prompt=False)
        # One end-of-turn per closed turn of the RM's template (Mistral and Gemma fold the system turn into the
        # first user turn; Mistral closes assistant turns only): the policy's turn end is not in the text, so the
        # RM does not see a turn end twice.
        turns = [t for t in conversation if not (t["role"] == "system" and rm_family in ("mistral", "gemma"))]
        closed = [t for t in turns if rm_family != "mistral" or t["role"] == "assistant"]
        assert rm_ids.count(rm_end) == len(closed)
        if rm_tok.bos_token_id is not None:
            assert rm_ids.count(rm_tok.bos_token_id) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_filter_and_trainer_use_prompt_ids_plus_sampled_ids(kit, family):
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.chat import pad_id
    from rlhf_pipeline.algorithms.pairs import pair_logps

    gen = load_from_disk(str(kit.stage(family, "score")))
    by_id = {row["prompt_id"]: row for row in gen}
    longest_prompt = max(len(p) for p in gen["prompt_token_ids"])
    limit = 6
    too_long = sum(len(ids) > limit for samples in gen["response_token_ids"] for ids in samples)
    # Length limits apply to the ids as sampled: the longest prompt passes a limit of its own length and fails one
    # token less, and exactly the responses with more than `limit` sampled ids are left out.
    shorter = manifest(kit.stage(family, "filter", "--max-prompt-tokens", longest_prompt - 1))
    assert shorter["dropped"]["prompt_too_long"] == [len(p) for p in gen["prompt_token_ids"]].count(longest_prompt)
    pairs_dir = kit.stage(family, "filter", "--max-prompt-tokens", longest_prompt, "--max-response-tokens", limit)
    m = manifest(pairs_dir)
    assert "prompt_too_long" not in m["dropped"]
    assert m["responses_left_out"]["response_too_long"] == too_long > 0
    pairs = load_from_disk(str(pairs_dir))
    rows = pairs["train"].to_list() + pairs["test"].to_list()
    assert rows
    for row in rows:
        source = by_id[row["prompt_id"]]
        assert row["prompt_token_ids"] == source["prompt_token_ids"]
        for side in ("chosen", "rejected"):
            j = source["response_token_ids"].index(row[f"{side}_token_ids"])  # exactly one sampled response
            assert row[side] == source["responses"][j] and row[f"{side}_reward"] == source["rewards"][j]
            assert len(row[f"{side}_token_ids"]) <= limit

    # The trainer's batches (the pair losses and the reference pass, padded or packed) are prompt ids + sampled ids.
    tok = load_tok(kit.policy(family))
    model = AutoModelForCausalLM.from_pretrained(kit.policy(family))
    for pack_ratio in (0.0, 2.0):
        _, _, batch = pair_logps(model, rows, pad_id(tok), temperature=0.8, pack_ratio=pack_ratio)
        sequences = [(r["prompt_token_ids"], r["chosen_token_ids"]) for r in rows] + [
            (r["prompt_token_ids"], r["rejected_token_ids"]) for r in rows]
        for s, (p, response) in enumerate(sequences):
            where = batch.seq_ids == s
            assert batch.input_ids[where].tolist() == p + response
            assert batch.input_ids[where & batch.response_mask].tolist() == response


def test_tiny_model_cli_writes_the_family_stop_tokens(tmp_path):
    """``rlhf tiny-model --chat-format``: choices come from the table, and Llama-3's generation config stops on
    [<|end_of_text|>, <|eot_id|>] while its tokenizer's EOS is <|end_of_text|>, as Meta's instruct model shipped."""
    import dataclasses
    import typing

    from rlhf_pipeline.stages.tiny_model import TinyModelConfig
    from rlhf_pipeline.tiny import CHAT_FORMATS, CHAT_TEMPLATE, build_tokenizer

    field = {f.name: f for f in dataclasses.fields(TinyModelConfig)}["chat_format"]
    assert field.default == "tiny"
    hints = typing.get_type_hints(TinyModelConfig)
    assert typing.get_args(hints["chat_format"]) == tuple(CHAT_FORMATS)
    assert build_tokenizer().chat_template == CHAT_TEMPLATE  # the default stays the kit's own format

    assert run("tiny-model", "--output", tmp_path / "m", "--chat-format", "llama3") == 0
    tok = load_tok(tmp_path / "m")
    gen_eos = json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"]
    assert tok.eos_token == "<|end_of_text|>" and tok.pad_token is None
    assert gen_eos == tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
