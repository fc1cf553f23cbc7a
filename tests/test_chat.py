"""Prompt validation and tokenization: one template application, one BOS, stop tokens from the model."""

import json
import sys
import types

import pytest
from datasets import Dataset

from rlhf_pipeline.chat import (
    as_text,
    encode_conversations,
    encode_prompts,
    load_tokenizer,
    stop_token_ids,
    validate_prompts,
)
from rlhf_pipeline.errors import PipelineError


def test_prompt_column_missing_names_the_file_and_the_fix():
    ds = Dataset.from_dict({"question": ["hi"]})
    with pytest.raises(PipelineError, match=r"data.jsonl: has neither a 'prompt' nor a 'messages' column.*rename"):
        validate_prompts(ds, "data.jsonl")


@pytest.mark.parametrize(
    "column, values, match",
    [
        ("prompt", ["fine", "   "], r"row 1: 'prompt' is empty"),
        ("messages", [[{"role": "user", "content": "hi"}], []], r"row 1: 'messages' is empty"),
        (
            "messages",
            [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]],
            r"row 0: 'messages' ends with an assistant turn",
        ),
    ],
)
def test_bad_prompt_rows_are_named(column, values, match):
    with pytest.raises(PipelineError, match=match):
        validate_prompts(Dataset.from_dict({column: values}), "p.jsonl")


def test_prompt_wins_over_messages():
    ds = Dataset.from_dict({"prompt": ["q"], "messages": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]})
    assert validate_prompts(ds, "uf") == "prompt"


def test_template_applied_once_with_a_single_bos(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    (ids,) = encode_prompts(tok, ["Write a short review of the park Oak Hollow."])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")  # the generation prompt
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short review of the park Oak Hollow."}],
        add_generation_prompt=True, tokenize=False,
    )
    # The trap this avoids: re-encoding the rendered string adds the tokenizer's own BOS in front.
    assert tok(rendered)["input_ids"][:2] == [tok.bos_token_id, tok.bos_token_id]
    assert tok(rendered, add_special_tokens=False)["input_ids"] == ids


def test_messages_and_prompt_give_the_same_ids(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    a = encode_prompts(tok, ["hello there"])
    b = encode_prompts(tok, [[{"role": "user", "content": "hello there"}]])
    assert a == b


def test_conversation_ends_with_the_turn_end(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    (ids,) = encode_conversations(tok, ["q"], ["a fine answer"])
    assert ids[-1] == tok.eos_token_id and ids.count(tok.bos_token_id) == 1


def test_stop_tokens_include_generation_config_eos(tiny_policy, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_policy, model)
    tok = load_tokenizer(str(model))
    assert stop_token_ids(tok, str(model)) == [tok.eos_token_id]
    cfg = json.loads((model / "generation_config.json").read_text())
    end_of_turn = tok.convert_tokens_to_ids("<|user|>")  # stands in for Llama-3's <|eot_id|>
    cfg["eos_token_id"] = [tok.eos_token_id, end_of_turn]
    (model / "generation_config.json").write_text(json.dumps(cfg))
    assert stop_token_ids(tok, str(model)) == [tok.eos_token_id, end_of_turn]


def test_as_text():
    assert as_text("plain") == "plain"
    assert as_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "u"


@pytest.mark.parametrize("family", ["tiny", "llama3", "chatml", "mistral", "gemma", "no_template"])
def test_chunked_threaded_encoding_gives_transformers_own_ids(family, tmp_path):
    """``encode_texts`` renders and encodes a large batch in chunks over threads, calling the Rust encoder directly:
    the ids must be exactly what ``apply_chat_template(tokenize=True)`` (or the tokenizer itself, without a template)
    gives, for every chat format, over more conversations than one chunk, with texts that look like special tokens,
    unicode, whitespace and empty responses. A tokenizer whose backend truncates is left to transformers.
    ``allow_special_tokens=True`` keeps every text on the fast path, reading special-token strings as transformers
    does (texts that spell one otherwise take ``ControlTokens``' path: tests/test_control_tokens.py)."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="tiny" if family == "no_template" else family)
    if family == "no_template":
        tok.chat_template = None
    texts = ["hello there", "<|eot_id|> is not a turn end here", "naïve café — ünïcode ✓", "  spaced  ", "",
             "a longer answer " * 9, "<s></s>[INST]", "\n\nnew\nlines\n"]
    n = chat.ENCODE_CHUNK * 2 + 37
    prompts = [f"prompt {i}: {texts[i % len(texts)]}" if i % 3 else
               [{"role": "user", "content": f"q{i} {texts[(i + 1) % len(texts)]}"}] for i in range(n)]
    if family == "no_template":
        prompts = [p if isinstance(p, str) else p[0]["content"] for p in prompts]
    responses = [texts[(i * 7) % len(texts)] + f" {i}" * (i % 4) for i in range(n)]
    assert chat._direct_backend(tok) is not None  # the fast path is the one under test

    if tok.chat_template:
        convs = [chat.as_messages(p) + [{"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]
        expected = tok.apply_chat_template(convs, tokenize=True, return_dict=True)["input_ids"]
        expected_prompts = tok.apply_chat_template([chat.as_messages(p) for p in prompts], tokenize=True,
                                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        expected = tok([chat.as_text(p) + r for p, r in zip(prompts, responses)], add_special_tokens=True)["input_ids"]
        expected_prompts = tok(prompts, add_special_tokens=True)["input_ids"]
    assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == [list(x) for x in expected]
    assert encode_prompts(tok, prompts, allow_special_tokens=True) == [list(x) for x in expected_prompts]

    tok.backend_tokenizer.enable_truncation(8)  # transformers turns it off for its own call: so must the fast path
    assert chat._direct_backend(tok) is None
    assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == [list(x) for x in expected]


def _conversations_of_shared_prompts(n: int):
    """``n`` conversations, four per prompt as ``rlhf score`` reads them, with responses that start alike, differ at
    their first character, start with whitespace, are empty, repeat, or look like special tokens (the tests encode
    them with ``allow_special_tokens=True``, as transformers reads them: the fast paths are what they test)."""
    starts = ["I found it fine", "I found it bad", "Yes", "  spaced", "", "<|end|> not a turn end", "<|eot_id|>x",
              "\n\nnew lines", "naïve café ✓", "Yes"]
    prompts = [f"prompt {i // 4}: write about item {i // 4}" if (i // 4) % 3 else
               [{"role": "user", "content": f"q{i // 4}"}] for i in range(n)]
    responses = [starts[(i * 3) % len(starts)] + f" {i}" * (i % 2) for i in range(n)]
    return prompts, responses


def _expected_ids(tok, prompts, responses):
    from rlhf_pipeline.chat import as_messages

    convs = [as_messages(p) + [{"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]
    return [list(x) for x in tok.apply_chat_template(convs, tokenize=True, return_dict=True)["input_ids"]]


def _recording_cuts(monkeypatch):
    from rlhf_pipeline import chat

    cuts = []
    real = chat.SharedPrefix._cut

    def cut(self, a, b):
        result = real(self, a, b)
        cuts.append(result[0])
        return result

    monkeypatch.setattr(chat.SharedPrefix, "_cut", cut)
    return cuts


@pytest.mark.parametrize("family", ["tiny", "llama3", "chatml", "mistral", "gemma"])
def test_the_conversations_of_one_prompt_share_its_encoding_and_get_transformers_own_ids(family, monkeypatch):
    """Consecutive conversations of one prompt have their shared start (up to the last added token before the
    responses differ) encoded once: the ids are still exactly ``apply_chat_template``'s, for every chat format."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format=family)
    assert chat.SharedPrefix.of(tok.backend_tokenizer) is not None
    cuts = _recording_cuts(monkeypatch)
    prompts, responses = _conversations_of_shared_prompts(chat.ENCODE_CHUNK * 2 + 20)
    assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == _expected_ids(
        tok, prompts, responses)
    assert len(cuts) >= len(prompts) // 4 - 3 and all(c > 0 for c in cuts)  # the shared path ran, on every group


def _metaspace_tokenizer(prepend_scheme: str):
    """A small SentencePiece-style BPE (Metaspace pre-tokenizer) trained on the spot, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    backend.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    words = ["hello there", "fine thanks", "assistant user", "a longer answer with words", "prompt item write"] * 20
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<|im_start|>", "<|im_end|>"])
    backend.train_from_iterator(words, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
                         "{% endfor %}")
    return tok


def _cut_after_last(tok, text: str, token: str) -> list[int]:
    cut = text.rindex(token) + len(token)
    backend = tok.backend_tokenizer
    return [i for part in (text[:cut], text[cut:]) for i in backend.encode(part, add_special_tokens=False).ids]


@pytest.mark.parametrize("prepend_scheme, shared", [("first", False), ("always", True)])
def test_a_pre_tokenizer_that_marks_the_first_piece_keeps_whole_texts(prepend_scheme, shared, monkeypatch):
    """Metaspace with ``prepend_scheme="first"`` prepends its space to the text's first piece only, so a text cut
    after an added token does not encode as its two parts: such a tokenizer is encoded whole; with "always" the
    parts are the whole, and the shared start is used. Both give ``apply_chat_template``'s ids."""
    from rlhf_pipeline import chat

    tok = _metaspace_tokenizer(prepend_scheme)
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"},
                                    {"role": "assistant", "content": "fine thanks"}], tokenize=False)
    whole = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert (_cut_after_last(tok, text, "<|im_start|>") == whole) is shared  # the rule is needed, and exact
    assert (chat.SharedPrefix.of(tok.backend_tokenizer) is not None) is shared
    cuts = _recording_cuts(monkeypatch)
    prompts, responses = _conversations_of_shared_prompts(chat.ENCODE_CHUNK + 40)
    assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == _expected_ids(
        tok, prompts, responses)
    assert bool(cuts) is shared


def test_no_cut_after_a_token_that_strips_the_whitespace_after_it(monkeypatch):
    """An added token with ``rstrip`` eats the whitespace that follows it, so the response's leading spaces vanish
    in the whole text but not in a part encoded alone: no cut is made after it."""
    from tokenizers import AddedToken

    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="tiny")
    tok.backend_tokenizer.add_special_tokens([AddedToken("<|assistant|>", rstrip=True, normalized=False, special=True)])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  spaced"}],
                                   tokenize=False)
    whole = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert _cut_after_last(tok, text, "<|assistant|>") != whole
    cuts = _recording_cuts(monkeypatch)
    prompts, responses = _conversations_of_shared_prompts(chat.ENCODE_CHUNK + 40)
    assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == _expected_ids(
        tok, prompts, responses)
    assert cuts and not any(cuts)  # every group kept whole: the only token before the responses strips


def test_special_tokens_read_as_text_keep_whole_texts(monkeypatch):
    """With ``split_special_tokens`` the template's special tokens are encoded as text, so no piece ends at them and
    nothing is cut; the ids are still transformers' own."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="chatml")
    tok.split_special_tokens = True
    tok.backend_tokenizer.encode_special_tokens = True
    assert chat._direct_backend(tok) is not None and chat.SharedPrefix.of(tok.backend_tokenizer) is None
    prompts, responses = _conversations_of_shared_prompts(chat.ENCODE_CHUNK + 40)
    assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == _expected_ids(
        tok, prompts, responses)


def test_a_cut_the_rules_miss_is_caught_on_each_chunk_and_encoded_whole(monkeypatch, caplog):
    """The last guard: the first group of every chunk is also encoded whole and compared. With the rule that keeps
    a cut out of a longer added token switched off, ``<|assistant|>I`` (an added token) swallows the first letter of
    responses that start with I, which a cut after ``<|assistant|>`` misses; the comparison catches it, warns, and
    the chunk is encoded whole."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="tiny")
    tok.add_special_tokens({"additional_special_tokens": ["<|assistant|>I"]})
    monkeypatch.setattr(chat.SharedPrefix, "_cut_after", lambda self, token: token in self.ids)
    n = chat.ENCODE_CHUNK + 40
    prompts = [f"prompt {i // 2}" for i in range(n)]
    responses = ["I agree" if i % 2 == 0 else "Sure" for i in range(n)]
    with caplog.at_level("WARNING", logger="rlhf_pipeline.chat"):
        assert encode_conversations(tok, prompts, responses, allow_special_tokens=True) == _expected_ids(
            tok, prompts, responses)
    assert "encoding them whole" in caplog.text


_CONVERSATION_SHAPES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<|im_end|> naïve ✓\n\n"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
]


def _counting_apply_chat_template(monkeypatch, tok, **extra):
    """Record the number of conversations of every ``apply_chat_template`` call (passing ``extra`` to the template)."""
    calls = []
    real = type(tok).apply_chat_template

    def counting(self, conversations, **kwargs):
        calls.append(len(conversations))
        return real(self, conversations, **extra, **kwargs)

    monkeypatch.setattr(type(tok), "apply_chat_template", counting)
    return calls


@pytest.mark.parametrize("family", ["tiny", "llama3", "chatml", "mistral", "gemma"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_template_rendered_directly_gives_apply_chat_templates_text(family, add_generation_prompt, monkeypatch):
    """``_render`` renders the compiled template itself (with what ``apply_chat_template`` hands it) instead of
    calling ``apply_chat_template`` per batch: the text is the same for every chat format and conversation shape,
    and ``apply_chat_template`` is called once per batch, on its first conversation, as the check."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format=family)
    shapes = [c for c in _CONVERSATION_SHAPES if family != "mistral" or c[0]["role"] != "system"]
    convs = [shapes[i % len(shapes)] for i in range(40)]
    if not add_generation_prompt:
        convs = [c for c in convs if c[-1]["role"] == "assistant"] * 3
    expected = tok.apply_chat_template(convs, add_generation_prompt=add_generation_prompt, tokenize=False)
    calls = _counting_apply_chat_template(monkeypatch, tok)
    render = chat._render(tok, add_generation_prompt)
    assert render(convs) == expected
    assert render(convs[1:]) == expected[1:]
    assert calls == [1, 1]  # only the check: the batch itself was rendered directly


def test_batches_of_other_than_plain_text_messages_are_left_to_apply_chat_template(monkeypatch):
    """``apply_chat_template`` drops None values and turns str subclasses into str before the template sees them, so
    a batch holding such a message (here far from its first conversation, which the check compares) is rendered by
    it, not directly: the text is still its own."""
    import enum

    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    class Role(str, enum.Enum):
        USER = "user"

    tok = build_tokenizer(chat_format="chatml")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | default('(none)') }}|{% endfor %}"
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for odd in ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
                [{"role": Role.USER, "content": "q"}, {"role": "assistant", "content": "a"}]):
        convs = [plain] * 20 + [odd] + [plain] * 5
        expected = tok.apply_chat_template(convs, tokenize=False)
        assert expected[20] in ("user: q|assistant: (none)|", "user: q|assistant: a|")
        calls = _counting_apply_chat_template(monkeypatch, tok)
        assert chat._render(tok, False)(convs) == expected
        assert calls == [len(convs)]
        monkeypatch.undo()


def test_a_direct_rendering_that_differs_falls_back_to_apply_chat_template(monkeypatch, caplog):
    """If a transformers release hands its templates something more (here: a variable the template prints), the
    first conversation's check catches it, warns once, and every batch of that template from then on is
    ``apply_chat_template``'s, in later calls too; a transformers without the helpers used is left to
    ``apply_chat_template`` from the start."""
    import transformers.utils.chat_template_utils as ctu

    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    monkeypatch.setattr(chat, "_RENDERED_OTHERWISE", set())
    tok = build_tokenizer(chat_format="chatml")
    plain_template = tok.chat_template
    tok.chat_template = "{{ release_variable | default('') }}" + plain_template
    convs = list(_CONVERSATION_SHAPES[:3]) * 5
    calls = _counting_apply_chat_template(monkeypatch, tok, release_variable="new")
    expected = tok.apply_chat_template(convs, tokenize=False)
    assert expected[0].startswith("new<|im_start|>")
    calls.clear()
    with caplog.at_level("WARNING", logger="rlhf_pipeline.chat"):
        assert chat._render(tok, False)(convs) == expected
        assert "using apply_chat_template" in caplog.text
        assert calls == [1, len(convs)]
        caplog.clear()
        calls.clear()
        assert chat._render(tok, False)(convs[2:]) == expected[2:]  # a later call: decided once
        assert calls == [len(convs) - 2] and not caplog.text

        # a release without the helpers (transformers' own functions keep theirs), with a template that would match
        tok.chat_template = plain_template
        expected = tok.apply_chat_template(convs, tokenize=False)
        calls.clear()
        monkeypatch.setitem(sys.modules, ctu.__name__, types.ModuleType(ctu.__name__))
        assert chat._render(tok, False)(convs) == expected
        assert calls == [len(convs)] and not caplog.text


def test_a_conversation_the_template_refuses_gets_transformers_own_error(monkeypatch):
    """Templates use the globals ``apply_chat_template`` gives them (``namespace``, ``raise_exception``), and the
    direct rendering has them. A ``raise_exception`` on a conversation past the first leaves the batch to
    ``apply_chat_template``, which raises its own error for it."""
    from jinja2.exceptions import TemplateError

    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="chatml")
    tok.chat_template = ("{% set ns = namespace(turns=0) %}{% for m in messages %}{% if m['role'] == 'tool' %}"
                         "{{ raise_exception('no tool turns') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}|"
                         "{% set ns.turns = ns.turns + 1 %}{% endfor %}{{ ns.turns }}")
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    convs = [plain] * 20 + [[{"role": "tool", "content": "x"}]] + [plain] * 3
    calls = _counting_apply_chat_template(monkeypatch, tok)
    render = chat._render(tok, False)
    assert render(convs[:20]) == ["user: q|assistant: a|2"] * 20 and calls == [1]  # rendered directly
    calls.clear()
    with pytest.raises(TemplateError, match="no tool turns"):
        render(convs)
    assert calls == [len(convs)]


class _RecordingBackend:
    """The real Rust encoder, recording who encodes what: ``encode_batch_fast`` calls ``on_call(texts)`` first, on
    the thread that encodes them."""

    def __init__(self, real, on_call):
        self.real, self.on_call = real, on_call

    def __getattr__(self, name):
        return getattr(self.real, name)

    def encode_batch_fast(self, texts, add_special_tokens):
        self.on_call(texts)
        return self.real.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


def _one_worker_recording(monkeypatch, tok, on_call):
    """``encode_texts`` with one worker beside the calling thread, and ``on_call`` before each chunk is encoded."""
    from rlhf_pipeline import chat

    monkeypatch.setattr(chat, "_direct_backend", lambda tokenizer: _RecordingBackend(tok.backend_tokenizer, on_call))
    monkeypatch.setattr(chat, "usable_cores", lambda: [0, 1])


def test_chunks_no_worker_has_started_are_encoded_by_the_calling_thread(monkeypatch):
    """The calling thread renders, runs ``meanwhile``, then encodes the chunks still queued (last first) instead of
    waiting for the workers: with the one worker held on its first chunk until the caller is done, the caller
    encodes all the rest, and the ids are transformers' own, in order."""
    import threading

    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="chatml")
    chunks = 5
    caller, callers_chunks = threading.current_thread(), []
    worker_started, release = threading.Event(), threading.Event()

    def on_call(texts):
        if threading.current_thread() is caller:
            callers_chunks.append(len(texts))
            if len(callers_chunks) == chunks - 1:
                release.set()
            return
        worker_started.set()
        if not release.wait(20):
            release.set()  # fail once, not once per chunk
            raise AssertionError("the calling thread never took the queued chunks")

    _one_worker_recording(monkeypatch, tok, on_call)
    texts = [f"text {i} " + "word " * (i % 7) for i in range(chat.ENCODE_CHUNK * chunks)]
    ids = chat.encode_texts(tok, texts, list, add_special_tokens=False,
                            meanwhile=lambda: worker_started.wait(20))  # the worker holds the first chunk
    assert callers_chunks == [chat.ENCODE_CHUNK] * (chunks - 1)
    assert ids == [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("fails_in", ["render", "encode"])
def test_an_error_while_rendering_or_encoding_is_raised_and_nothing_more_is_encoded(fails_in, monkeypatch):
    """A template that fails on a later chunk, or a chunk the calling thread fails to encode, is the error raised,
    and the chunks no worker has started are not encoded: the one worker, holding the first chunk until every other
    is cancelled, encodes that one only."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="chatml")
    caller, futures, encoded, worker_started = threading.current_thread(), [], [], threading.Event()

    class Recording(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            futures.append(super().submit(*args, **kwargs))
            return futures[-1]

    submitted = 4 if fails_in == "render" else 5  # the chunks handed to the pool before the error

    def on_call(texts):
        if threading.current_thread() is caller:
            return
        encoded.append(texts[0])
        worker_started.set()
        # Hold the first chunk until every chunk is submitted and every later one cancelled. The worker can start
        # before the first submit has returned (futures still empty), so it waits for the whole list, not for
        # whatever is in it yet: waiting on an empty list let it take the next chunk when the caller was slow.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
                len(futures) == submitted and all(f.cancelled() for f in futures[1:])):
            time.sleep(0.001)

    monkeypatch.setattr(chat, "ThreadPoolExecutor", Recording)
    _one_worker_recording(monkeypatch, tok, on_call)
    items = [f"chunk {i // chat.ENCODE_CHUNK}" for i in range(chat.ENCODE_CHUNK * 4)] + ["bad"]

    def to_text(chunk):
        if "bad" not in chunk:
            return list(chunk)
        if fails_in == "render":
            assert worker_started.wait(20)
            raise ValueError("the template refuses this conversation")
        return [None]  # the encoder refuses None

    with pytest.raises(ValueError if fails_in == "render" else TypeError):
        chat.encode_texts(tok, items, to_text, add_special_tokens=False, meanwhile=lambda: worker_started.wait(20))
    assert encoded == ["chunk 0"] and len(futures) == submitted
