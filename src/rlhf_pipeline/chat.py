"""Prompts, chat templates and tokenization: the one place text becomes token ids for the policy.

A prompt row has a ``prompt`` string or a ``messages`` list of ``{role, content}``; ``prompt`` wins when both are
present (UltraFeedback-style data keeps the whole conversation, answer included, in ``messages``). The chat
template is applied exactly once and its rendering encoded without adding special tokens (what
``apply_chat_template(..., tokenize=True)`` does), so the engine never sees the double BOS that re-encoding a rendered
string with them gives. Large batches are rendered and encoded in chunks over threads (:func:`encode_texts`), and the
conversations of one prompt have the prompt's part encoded once (:class:`SharedPrefix`), with the same ids.
No token id or template slice is hard-coded: stop tokens come from the tokenizer and the generation config.

Which template: :func:`use_chat_template` sets the one a stage renders with on its tokenizer (``--chat-template``, a
built-in of ``chat_templates`` or a Jinja file, else the tokenizer's own; none at all is an error naming the fix, and
``none`` renders raw text on purpose) and returns it as a :class:`ChatTemplate`, whose ``record()`` the manifests
carry; every renderer here reads ``tokenizer.chat_template``, so all of them, the direct Jinja rendering included,
render with that one.

Control tokens: a message's content is text. A tokenizer reads a special-token string written inside a rendered
conversation (``<|im_start|>``, ``<|eot_id|>``) as the special token itself, so a response or prompt that spells one
would forge turns the reward model, the judge or the policy then reads. Every conversation is checked against the
tokenizer's special-token strings (:class:`ControlTokens`); the clean ones (all real data, as a rule) take the paths
above unchanged, and one whose content spells a special token is encoded so that only the template's own markup
gives special-token ids (:meth:`ControlTokens.encode_guarded`). ``allow_special_tokens=True`` (the stages'
``--allow-special-tokens-in-text``) reads such strings as tokens again, for data that stores control tokens on purpose.
"""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from rlhf_pipeline.chat_templates import BUILTIN_TEMPLATES
from rlhf_pipeline.config import NO_CHAT_TEMPLATE
from rlhf_pipeline.contracts import PROMPT_COLUMNS
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.files import MODEL_HINT, first_line, reading
from rlhf_pipeline.machine import usable_cores

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


# ShareGPT's speakers (turns of ``{"from", "value"}``, the ``conversations`` column of many chat datasets) as the
# roles of ``{role, content}`` turns, as TRL's ``maybe_convert_to_chatml`` reads them.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def is_sharegpt(turns: Any) -> bool:
    """Whether ``turns`` is a list of ShareGPT turns (a ``from`` and a ``value``, no ``role``)."""
    return (isinstance(turns, list) and bool(turns)
            and all(isinstance(t, dict) and "from" in t and "value" in t and "role" not in t for t in turns))


def from_sharegpt(turns: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """ShareGPT turns as ``{role, content}`` turns (:data:`SHAREGPT_ROLES`); a speaker outside it is an error naming
    ``where`` (the file and row)."""
    out = []
    for turn in turns:
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise PipelineError(f"{where}: a ShareGPT turn is from {speaker!r}; the speakers read are "
                                f"{', '.join(SHAREGPT_ROLES)}: rename it, or convert the rows to {{role, content}} "
                                "turns in a 'messages' column")
        out.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return out


def _holds_sharegpt(feature: Any) -> bool:
    """Whether a list feature's items are ShareGPT turns (``from`` and ``value`` fields, no ``role``)."""
    item = getattr(feature, "feature", None)
    if item is None and isinstance(feature, list) and feature:
        item = feature[0]
    return isinstance(item, dict) and {"from", "value"} <= set(item) and "role" not in item


def use_prompt_column(ds: Dataset, name: str, source: str) -> Dataset:
    """``ds`` with its column ``name`` (``--prompt-column``) as the prompt column every stage reads: renamed to
    ``prompt`` when it holds text, to ``messages`` when it holds turns; ShareGPT turns (:func:`from_sharegpt`) are
    written as ``{role, content}`` turns there."""
    from datasets import LargeList, List, Sequence, Value

    if name not in ds.column_names:
        raise PipelineError(f"{source}: --prompt-column {name}: no such column (columns: {', '.join(ds.column_names)})")
    feature = ds.features[name]
    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        target = "prompt"
    elif isinstance(feature, (list, List, LargeList, Sequence)):
        target = "messages"
    else:
        raise PipelineError(f"{source}: --prompt-column {name}: holds {feature}, neither text nor a list of "
                            "{role, content} turns")
    others = [c for c in PROMPT_COLUMNS if c in ds.column_names and c != name]
    if others:
        raise PipelineError(f"{source}: --prompt-column {name}: it also has a '{others[0]}' column, which the stages "
                            f"would read as the prompt; drop or rename that column")
    if target == "messages" and _holds_sharegpt(feature):
        def convert(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
            return {target: [None if turns is None else from_sharegpt(turns, f"{source}: row {row}")
                             for turns, row in zip(batch[name], indices)]}

        return ds.map(convert, batched=True, with_indices=True, remove_columns=[name],
                      desc=f"reading ShareGPT turns of '{name}'")
    return ds if name == target else ds.rename_column(name, target)


def prompt_column(ds: Dataset, source: str) -> str:
    """The column that holds the prompt (``prompt`` first, then ``messages``), or a clear error."""
    for name in PROMPT_COLUMNS:
        if name in ds.column_names:
            return name
    hint = ("; its 'conversations' column looks like ShareGPT's turns: --prompt-column conversations reads them"
            if "conversations" in ds.column_names and _holds_sharegpt(ds.features["conversations"]) else "")
    raise PipelineError(
        f"{source}: has neither a 'prompt' nor a 'messages' column (columns: {', '.join(ds.column_names)}); "
        "name the prompts' column with --prompt-column, or rename it to 'prompt' (text) or 'messages' (a list of "
        "{role, content})" + hint
    )


# A message's role as chat templates write it into their markup (``<|im_start|>ROLE``): a name. Contents may hold
# anything (special-token strings in them are read as text: ControlTokens), but a role holding markup would forge turns.
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")


def check_roles(messages: Sequence[Any], where: str) -> None:
    """Raise a PipelineError naming ``where`` (the file and row) when a message's role is not a plain name."""
    for turn in messages:
        role = turn.get("role") if isinstance(turn, dict) else None
        if isinstance(role, str) and not _ROLE.fullmatch(role):
            raise PipelineError(
                f"{where}: a turn's role {role[:60]!r} is not a plain name (a letter, then letters, digits, '_', '-' "
                "or '.'): the chat template writes roles into its markup, where this one could forge turns; use "
                "user, assistant or system"
            )


def check_message_roles(ds: Dataset, column: str, source: str) -> None:
    """:func:`check_roles` over a dataset's ``messages`` column (a stage that reads generations or data made
    elsewhere): the distinct roles are read with Arrow, and only a bad one makes the rows be read, to name the first."""
    if column != "messages":
        return
    import pyarrow.compute as pc

    flat = pc.list_flatten(ds.with_format("arrow")[column])
    roles = pc.unique(pc.struct_field(flat, "role")).to_pylist() if len(flat) else []
    if all(role is None or _ROLE.fullmatch(role) for role in roles):
        return
    for row, messages in enumerate(ds[column]):
        check_roles(messages or [], f"{source}: row {row}")


def check_prompt(value: Any, column: str, row: int, source: str) -> None:
    """Raise a PipelineError naming the row if a prompt value is empty or malformed."""
    where = f"{source}: row {row}"
    if column == "prompt":
        if value is None:
            raise PipelineError(f"{where}: has no 'prompt' (null or missing); remove the row or give it a prompt")
        if not isinstance(value, str):
            raise PipelineError(f"{where}: 'prompt' is {type(value).__name__}, not text; make it a string")
        if not value.strip():
            raise PipelineError(f"{where}: 'prompt' is empty; remove the row or give it a prompt")
        return
    if not isinstance(value, list):
        raise PipelineError(f"{where}: 'messages' is {type(value).__name__}, not a list; give it a list of "
                            "{role, content} turns")
    if not value:
        raise PipelineError(f"{where}: 'messages' is empty; give it a list of {{role, content}} turns")
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
            raise PipelineError(f"{where}: every turn in 'messages' needs a 'role' and a text 'content'")
    check_roles(value, where)
    if value[-1]["role"] == "assistant":
        raise PipelineError(
            f"{where}: 'messages' ends with an assistant turn; end it with the user turn to answer "
            "(drop the assistant reply, or use a 'prompt' column)"
        )
    if value[-1]["role"] == "system" or not any(turn["role"] == "user" for turn in value):
        what = "ends with a system turn" if value[-1]["role"] == "system" else "has no user turn"
        raise PipelineError(f"{where}: 'messages' {what}; end it with the user turn to answer")
    if not any(turn["content"].strip() for turn in value):
        raise PipelineError(f"{where}: every turn in 'messages' is empty; remove the row or fill it")


def validate_prompts(ds: Dataset, source: str) -> str:
    """Check every prompt row; return the prompt column's name."""
    column = prompt_column(ds, source)
    for row, value in enumerate(ds[column]):
        check_prompt(value, column, row, source)
    return column


def as_messages(value: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """A prompt as a conversation: a ``prompt`` string becomes one user turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [{"role": t["role"], "content": t["content"]} for t in value]


def as_text(value: str | list[dict[str, str]]) -> str:
    """A prompt as plain text for reward functions: the string itself, or the last user turn."""
    if isinstance(value, str):
        return value
    users = [t["content"] for t in value if t["role"] == "user"]
    return users[-1] if users else value[-1]["content"]


def load_tokenizer(path: str, trust_remote_code: bool = False, padding_side: str | None = None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    with reading("tokenizer", path, MODEL_HINT, only_damaged=True):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if padding_side is not None:
        tok.padding_side = padding_side
    return tok


# ----------------------------------------------------------------------------------------------------------------
# Which chat template a stage renders with (--chat-template, config.ChatTemplateOptions)

CHAT_TEMPLATE_FIX = (f"pass --chat-template {'|'.join(BUILTIN_TEMPLATES)}|FILE to render with one, or "
                     f"--chat-template {NO_CHAT_TEMPLATE} for raw prompt text")


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template a stage renders with, and where it came from: ``tokenizer`` (the model's own), ``builtin``
    (``name`` in ``chat_templates.BUILTIN_TEMPLATES``), ``file`` (``name`` is its path) or ``none`` (raw text)."""

    source: str
    text: Optional[str] = None
    name: Optional[str] = None

    @property
    def sha(self) -> Optional[str]:
        """A short hash of the template text (None without one): what the stages compare."""
        return None if self.text is None else hashlib.sha256(self.text.encode()).hexdigest()[:12]

    def record(self) -> dict[str, Any]:
        """What a manifest records of it (``chat_template``)."""
        return {"source": self.source, **({"name": self.name} if self.name else {}), "sha256": self.sha}

    def describe(self) -> str:
        what = {"tokenizer": "the tokenizer's own", "builtin": f"built-in {self.name}", "file": f"file {self.name}",
                "none": "none (raw text)"}[self.source]
        return what if self.sha is None else f"{what} (sha256 {self.sha})"


def read_chat_template(value: Optional[str]) -> Optional[ChatTemplate]:
    """The template ``--chat-template VALUE`` names (None: the tokenizer's own, decided by :func:`use_chat_template`):
    a built-in name, ``none``, or a Jinja file, checked to parse."""
    if value is None:
        return None
    if value == NO_CHAT_TEMPLATE:
        return ChatTemplate("none")
    if value in BUILTIN_TEMPLATES:
        return ChatTemplate("builtin", BUILTIN_TEMPLATES[value], value)
    path = Path(value).expanduser()
    if not path.is_file():
        raise PipelineError(f"--chat-template {value}: no such file, and not a built-in template "
                            f"({', '.join(BUILTIN_TEMPLATES)}) or {NO_CHAT_TEMPLATE}; give a Jinja template file or "
                            "one of those names")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PipelineError(f"--chat-template {value}: cannot be read as text ({e}); give a Jinja template "
                            "file") from None
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(text)
    except TemplateSyntaxError as e:
        raise PipelineError(f"--chat-template {value}: not a Jinja template (line {e.lineno}: {e.message}); "
                            "fix the file") from None
    if not text.strip():
        raise PipelineError(f"--chat-template {value}: the file is empty; give a Jinja chat template")
    return ChatTemplate("file", text, str(path))


def use_chat_template(tokenizer: PreTrainedTokenizerBase, value: Optional[str], model: str,
                      required: bool = True) -> ChatTemplate:
    """Set the template ``tokenizer`` renders with, and return it: ``--chat-template VALUE`` when given (a built-in,
    a file, or ``none``, which removes the tokenizer's own), else the tokenizer's own template. A tokenizer with none
    and no option is a PipelineError naming ``model`` and the fix when the stage must render (``required``); else
    it renders raw text. Every renderer below reads ``tokenizer.chat_template``, so each renders with this one, and a
    training stage's saved tokenizer carries it."""
    chosen = read_chat_template(value)
    if chosen is not None:
        tokenizer.chat_template = chosen.text
        return chosen
    if tokenizer.chat_template:
        return ChatTemplate("tokenizer", tokenizer.get_chat_template())
    if required:
        raise PipelineError(f"{model}: its tokenizer has no chat template; {CHAT_TEMPLATE_FIX}")
    return ChatTemplate("none")


def recorded_chat_template(record: Optional[dict[str, Any]]) -> Optional[str]:
    """The ``--chat-template`` value that renders as a manifest's ``chat_template`` record says the data was rendered
    (None: the tokenizer's own, or not recorded: manifests from before it, with ``use_chat_template`` only)."""
    if not record:
        return None
    if record["source"] in ("builtin", "none"):
        return record.get("name", NO_CHAT_TEMPLATE)
    if record["source"] == "file" and Path(record["name"]).is_file():
        return record["name"]
    return None


def check_same_template(used: ChatTemplate, record: Optional[dict[str, Any]], source: str, what: str) -> None:
    """A PipelineError when ``used`` is not the template a manifest's ``chat_template`` ``record`` says ``source``
    was rendered with (nothing to check in a manifest without one)."""
    if not record or record.get("sha256") == used.sha:
        return
    recorded = ChatTemplate(record["source"], None, record.get("name"))
    hint = recorded_chat_template(record) or (record.get("name") if record["source"] == "file" else None)
    fix = (f"pass --chat-template {hint}" if hint else "pass the sampling model's tokenizer, or its template as "
           "--chat-template FILE")
    raise PipelineError(f"{source} was rendered with the chat template {recorded.describe()} (sha256 "
                        f"{record.get('sha256')}), but {what} renders with {used.describe()}; {fix}")


def raw_conversation_error(source: str, row: int) -> PipelineError:
    """The error for a ``messages`` row (a conversation) that a stage without a chat template cannot render."""
    return PipelineError(f"{source}: row {row} is a 'messages' conversation, which --chat-template "
                         f"{NO_CHAT_TEMPLATE} cannot render as raw text; give a chat template (--chat-template "
                         f"{'|'.join(BUILTIN_TEMPLATES)}|FILE) or plain 'prompt' text")


# A text in which two vocabularies of one size (Llama-2's and Mistral-7B's: 32,000 each) give ids of different tokens:
# words, digits, runs of spaces, punctuation, accents, CJK, an emoji. Token ids made by one model's tokenizer and
# read by another such model pass every range check and train on noise, so the stages that make token ids record
# the probe's ids under the key below, and the stages that read them check that those ids mean the probe text to the
# tokenizer they use.
TOKENIZER_PROBE = "The quick brown fox, 1234567 jumps!  Naïve café: 東京 ½ 🙂\n\tdone."
TOKENIZER_PROBE_KEY = "tokenizer_probe"


def tokenizer_probe(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids of :data:`TOKENIZER_PROBE` under ``tokenizer``, without special tokens."""
    return list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])


def check_same_tokenizer(recorded: Optional[Sequence[int]], tokenizer: PreTrainedTokenizerBase, source: str,
                         whose: str, fix: str) -> None:
    """Raise a PipelineError when the token ids of ``source`` were made by a tokenizer whose ids mean other text
    than ``tokenizer``'s (``whose``: which one it is, in words): the probe ids its manifests recorded, decoded by
    ``tokenizer``, are not the probe text as ``tokenizer`` itself reads it back. What the ids mean is compared, not
    how the text was cut: the same vocabulary may split text otherwise under another backend or transformers
    release (a tokenizer's pre-tokenizer fixed since, say), and its ids still mean what they did. Data without a
    record (made elsewhere, or before the record existed) is not checked."""
    if recorded is None:
        return
    own = tokenizer_probe(tokenizer)
    if list(recorded) == own:
        return

    def text(ids: Sequence[int]) -> Optional[str]:
        try:
            return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 - ids this tokenizer cannot decode mean nothing to it
            return None

    theirs = text(recorded)
    if theirs is not None and theirs == text(own):
        return
    raise PipelineError(f"{source}: its token ids mean other text under {whose} than under the tokenizer that made "
                        f"them (a probe text recorded with the data decodes to other text), so they would be read as "
                        f"other words; {fix}")


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS (many chat models ship no pad token).
    Padded positions are masked out, so which id fills them does not change any result."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


ENCODE_CHUNK = 128  # texts per call of the Rust encoder when a batch is spread over threads


def _direct_backend(tokenizer: PreTrainedTokenizerBase):
    """The Rust tokenizer of a fast tokenizer, when calling it directly gives exactly what ``tokenizer(texts)`` gives:
    no truncation or padding set on it, and special tokens read as the tokenizer reads them (transformers resets
    both before each call, with the defaults); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(backend, "encode_special_tokens", False)) != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def encode_texts(tokenizer: PreTrainedTokenizerBase, items: Sequence[Any], to_text: Callable[[list], list[str]],
                 add_special_tokens: bool, keys: Sequence[Any] | None = None,
                 meanwhile: Callable[[], None] | None = None) -> list[list[int]]:
    """Token ids of ``to_text(items)``, exactly as ``tokenizer(to_text(items), add_special_tokens=...)`` gives them,
    rendered and encoded in chunks of :data:`ENCODE_CHUNK`: while this thread renders a chunk (a chat template is
    Python), the Rust encoder, which releases the GIL, encodes the chunks before it on the other cores (with
    ``TOKENIZERS_PARALLELISM=false``, which only stops the encoder's own thread pool, too), and once this thread's
    own work is done it encodes the chunks no worker has started.

    ``keys`` (one per item): consecutive items with equal keys share the start of their text (the conversations of
    one prompt), which is then encoded once for them where that gives the same ids (:class:`SharedPrefix`).
    ``meanwhile`` runs on this thread once every chunk is rendered, while the workers encode them (a reward model
    loads there: rendering first keeps the encoder fed, as both need the GIL); an error from it is raised once the
    chunks in flight end."""
    items = list(items)
    backend = _direct_backend(tokenizer)
    if backend is None or len(items) <= ENCODE_CHUNK:
        texts = to_text(items) if items else []
        ids = [list(x) for x in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]] if texts else []
        if meanwhile is not None:
            meanwhile()
        return ids

    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which ids do not need: the same ids
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    shared = SharedPrefix.of(backend) if keys is not None and not add_special_tokens else None

    def encode(texts: list[str], chunk_keys: Sequence[Any] | None) -> list[list[int]]:
        if shared is not None:
            return shared.encode(batch, texts, chunk_keys)
        return [encoding.ids for encoding in batch(texts, add_special_tokens=add_special_tokens)]

    # One core is this thread's (rendering, then ``meanwhile``): the workers take the others (on one core, the one
    # worker shares it), and this thread encodes the chunks none of them has started once its own work is done, so
    # no core waits and none is shared by three.
    chunks: list[tuple[list[str], Sequence[Any] | None]] = []
    parts: list[Future] = []
    done: dict[int, list[list[int]]] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(usable_cores()) - 1))) as pool:
        try:
            for i in range(0, len(items), ENCODE_CHUNK):
                chunks.append((to_text(items[i : i + ENCODE_CHUNK]),
                               None if keys is None else keys[i : i + ENCODE_CHUNK]))
                parts.append(pool.submit(encode, *chunks[-1]))
            if meanwhile is not None:
                meanwhile()
            for k in reversed(range(len(parts))):  # the last first: the workers take them from the front
                if parts[k].cancel():
                    done[k] = encode(*chunks[k])
        except BaseException:
            for part in parts:  # nothing more is started; the chunks in flight end before this is raised
                part.cancel()
            raise
        return [ids for k, part in enumerate(parts) for ids in (done[k] if k in done else part.result())]


# Pre-tokenizers that treat every piece of text between two added tokens alike wherever it stands; Metaspace too,
# unless it prepends its space to the text's first piece only (prepend_scheme "first", checked below).
_PIECEWISE_PRE_TOKENIZERS = frozenset({
    "BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "FixedLength", "Metaspace", "Punctuation",
    "Sequence", "Split", "UnicodeScripts", "Whitespace", "WhitespaceSplit",
})


def _piecewise(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind not in _PIECEWISE_PRE_TOKENIZERS:
        return False
    if kind == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        return False
    return all(_piecewise(p) for p in pre_tokenizer.get("pretokenizers", ()))


class SharedPrefix:
    """Encode the conversations of one prompt with their shared start encoded once.

    A fast tokenizer cuts its input at every added token (``<|eot_id|>``, ``<|im_start|>``, ...) before it normalises,
    pre-tokenises and encodes anything, and encodes each piece between them on its own. So the ids of a text cut right
    after an added token ``T`` are the ids of the part up to the cut followed by the ids of the rest, provided that:
    ``T`` is matched there in both (no other added token contains it, so none can span the cut), ``T`` does not strip
    the whitespace after it (``rstrip``) and is matched before normalisation (``normalized=False``), no added token
    matches single words only (which can refuse a match), special tokens are not read as text
    (``split_special_tokens``), and the pre-tokenizer does not treat the text's first piece differently (Metaspace
    with ``prepend_scheme="first"``). :meth:`of` checks the tokenizer; for each group of texts
    the cut is after the last added token of their common start, the start is encoded once and must end in ``T``'s
    id, and the first group of each chunk is also encoded whole and compared, so a tokenizer these rules miss falls
    back to whole texts (with a warning) instead of giving other ids.
    """

    def __init__(self, pattern: re.Pattern, ids: dict[str, int], contents: list[str]):
        self.pattern, self.ids, self.contents = pattern, ids, contents
        self.safe: dict[str, bool] = {}

    @classmethod
    def of(cls, backend) -> SharedPrefix | None:
        import json

        pre = backend.pre_tokenizer
        if not _piecewise(None if pre is None else json.loads(pre.__getstate__())):
            return None
        if getattr(backend, "encode_special_tokens", False):  # special tokens read as text: no piece ends at them
            return None
        added = backend.get_added_tokens_decoder()
        if not added or any(t.single_word for t in added.values()):
            return None
        plain = {t.content: i for i, t in added.items() if not t.normalized and t.content}
        cuts = {c for c, i in plain.items() if not added[i].rstrip}
        if not cuts:
            return None
        contents = sorted(plain, key=len, reverse=True)  # longest first: the regex then matches leftmost-longest
        return cls(re.compile("|".join(map(re.escape, contents))), {c: plain[c] for c in cuts}, contents)

    def _cut_after(self, token: str) -> bool:
        if token not in self.safe:
            self.safe[token] = token in self.ids and not any(token in c for c in self.contents if c != token)
        return self.safe[token]

    def _cut(self, a: str, b: str) -> tuple[int, int]:
        """Where to cut the texts of a group whose first two are ``a`` and ``b``: after the last added token of their
        common start, and that token's id; (0, -1) when there is none to cut after."""
        lo, hi = 0, min(len(a), len(b))
        while lo < hi:  # the length of the common start, by halving (each comparison runs in C)
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        last = None
        for last in self.pattern.finditer(a, 0, lo):
            pass
        if last is None or not self._cut_after(last.group()):
            return 0, -1
        return last.end(), self.ids[last.group()]

    def encode(self, batch: Callable, texts: list[str], keys: Sequence[Any]) -> list[list[int]]:
        jobs: list[str] = []
        plan: list[tuple[int, int, int]] = []  # per text: (job of its shared start or -1, the id it ends in, job)
        check = None  # (text index, job of the whole text): the first shared text of the chunk, encoded whole too
        i = 0
        while i < len(texts):
            j = i + 1
            while j < len(texts) and keys[j] == keys[i]:
                j += 1
            cut, last_id = self._cut(texts[i], texts[i + 1]) if j - i > 1 else (0, -1)
            if cut:
                start, start_job = texts[i][:cut], len(jobs)
                jobs.append(start)
                for k in range(i, j):
                    if texts[k].startswith(start):
                        plan.append((start_job, last_id, len(jobs)))
                        jobs.append(texts[k][cut:])
                    else:
                        plan.append((-1, -1, len(jobs)))
                        jobs.append(texts[k])
                if check is None:
                    check = (i, len(jobs))
                    jobs.append(texts[i])
            else:
                for k in range(i, j):
                    plan.append((-1, -1, len(jobs)))
                    jobs.append(texts[k])
            i = j
        encoded = [e.ids for e in batch(jobs, add_special_tokens=False)]
        out, redo = [], []
        for k, (start, last_id, job) in enumerate(plan):
            if start < 0:
                out.append(encoded[job])
            elif encoded[start] and encoded[start][-1] == last_id:
                out.append(encoded[start] + encoded[job])
            else:  # the start did not end in the token cut after: this text whole
                out.append(None)
                redo.append(k)
        if check is not None and out[check[0]] is not None and out[check[0]] != encoded[check[1]]:
            log.warning("encoding the conversations of one prompt with their shared start once gave other ids than "
                        "encoding them whole; encoding them whole")
            return [e.ids for e in batch(texts, add_special_tokens=False)]
        for k, ids in zip(redo, batch([texts[k] for k in redo], add_special_tokens=False) if redo else ()):
            out[k] = ids.ids
        return out


# (template, add_generation_prompt) pairs whose direct rendering differed from apply_chat_template's in this process
_RENDERED_OTHERWISE: set[tuple[str, bool]] = set()


def _plain(conv: list) -> bool:
    """Messages of exactly a ``role`` and a ``content`` of type ``str``: what ``apply_chat_template`` hands such a
    template unchanged (it drops None values, and turns str subclasses into str)."""
    return all(type(m) is dict and len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str
               for m in conv)


def _render(tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool) -> Callable[[list], list[str]]:
    """Conversations (lists of ``{role, content}`` messages, as :func:`as_messages` makes them) -> their
    chat-template renderings, as ``apply_chat_template`` renders them before it tokenizes (with
    ``add_special_tokens=False``: the template writes its own).

    A batch whose messages are all plain text (:func:`_plain`) is rendered directly, with what
    ``apply_chat_template`` hands the template (the messages, ``tools`` and ``documents`` None,
    ``add_generation_prompt`` and the special tokens): on the way it copies and checks every message, a large part of
    its time on such messages, and changes none of them. Any other batch is left to ``apply_chat_template``. The first
    conversation of each batch is also rendered by ``apply_chat_template`` and compared, so a transformers release
    that hands the template anything else makes this process fall back to it for that template (with one warning)
    instead of giving other text; a batch whose direct rendering raises (a template's ``raise_exception``) is left to
    ``apply_chat_template`` too, for its own error.

    Each conversation gets the context jinja's ``Template.render`` makes, built from plain dicts: ``render`` copies the
    template's globals, a ``ChainMap``, key by key in Python into every context, which costs more than rendering a
    short chat template does."""

    def by_transformers(convs: list) -> list[str]:
        return tokenizer.apply_chat_template(convs, add_generation_prompt=add_generation_prompt, tokenize=False)

    try:
        from jinja2.runtime import new_context
        from transformers.utils.chat_template_utils import _compile_jinja_template, _plain_template_data

        source = tokenizer.get_chat_template()
        template = _compile_jinja_template(source)
        context = _plain_template_data({"tools": None, "documents": None,
                                        "add_generation_prompt": add_generation_prompt, **tokenizer.special_tokens_map})
        environment, body = template.environment, template.root_render_func
        template_globals = dict(template.globals)
    except Exception:  # another transformers or jinja: transformers' own rendering, whatever it is
        return by_transformers
    if environment.is_async:  # Template.render runs these through asyncio
        return by_transformers
    key = (source, add_generation_prompt)

    def render_one(conv: list) -> str:
        # Template.render(messages=conv, **context): the globals, then its arguments, over them
        variables = {**template_globals, "messages": conv, **context}
        return environment.concat(body(new_context(environment, template.name, template.blocks, variables, True,
                                                   template_globals)))

    def render(convs: list) -> list[str]:
        if key in _RENDERED_OTHERWISE or not convs or not all(_plain(conv) for conv in convs):
            return by_transformers(convs)
        try:
            texts = [render_one(conv) for conv in convs]
        except Exception:  # the template refuses a conversation: transformers' error for it
            return by_transformers(convs)
        if texts[0] != by_transformers(convs[:1])[0]:
            log.warning("rendering the chat template directly gave other text than apply_chat_template; "
                        "using apply_chat_template")
            _RENDERED_OTHERWISE.add(key)
            return by_transformers(convs)
        return texts

    return render


# Private-use characters that open the placeholder of a special-token string hidden in a message while its
# conversation is rendered (one a conversation does not contain); U+E0FF closes it
_MARKS = [chr(c) for c in range(0xE000, 0xE0FF)]


class ControlTokens:
    """The special-token strings of one tokenizer, and the encoding that reads them as text inside message contents.

    The strings are every special token the tokenizer has (``all_special_tokens`` and the added tokens marked
    special: what ``split_special_tokens`` splits), in one regex, longest first so that it matches as the tokenizer
    does (leftmost, longest); it is built once per tokenizer (:meth:`of`). :meth:`spelled` says whether a
    conversation's contents (or a plain text) contain one of them: only those take :meth:`encode_guarded`.

    :meth:`encode_guarded` renders a conversation with each special-token string in its contents replaced by a
    placeholder of private-use characters (``\\ue000<k>\\ue001``; a template that strips, capitalises or otherwise
    reworks a content keeps it whole), so every special token the rendering then holds is the template's own
    markup. The text is cut at those, as the tokenizer cuts its input at added tokens before it encodes the pieces
    between them (honouring a token's ``lstrip``/``rstrip``); the markup gives its ids, and each piece, placeholders
    put back, is encoded with special tokens read as text (a copy of the Rust tokenizer with
    ``encode_special_tokens``: the shared one is not switched, as other threads encode with it). For a tokenizer
    whose pre-tokenizer treats every piece alike (byte-level BPE) this gives the ids the whole text gives wherever
    no special token is spelled; around a spelled one the merges are those of the string as text, and a
    pre-tokenizer that treats the first piece otherwise (Metaspace ``prepend_scheme="first"``) may see a space
    before later pieces: acceptable for conversations that carry control-token text, which clean data never is.
    """

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        strings = set(tokenizer.all_special_tokens) | {t.content for t in added.values() if t.special}
        strings.discard("")
        by_content = {t.content: t for t in added.values()}
        self.tokenizer = weakref.ref(tokenizer)  # a strong one would keep the cache's key alive
        self.ids = {t: tokenizer.convert_tokens_to_ids(t) for t in strings}
        self.lstrip = {t for t in strings if t in by_content and by_content[t].lstrip}
        self.rstrip = {t for t in strings if t in by_content and by_content[t].rstrip}
        self.pattern = (re.compile("|".join(map(re.escape, sorted(strings, key=len, reverse=True))))
                        if strings else None)
        self._split: Callable[[list[str], bool], list[list[int]]] | None = None
        self.warned = False

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> ControlTokens:
        try:
            return cls._cache[tokenizer]
        except (KeyError, TypeError):
            control = cls(tokenizer)
            try:
                cls._cache[tokenizer] = control
            except TypeError:  # not weakly referenceable: built again next time
                pass
            return control

    def spelled(self, item: str | list[dict[str, str]]) -> bool:
        """Whether a text, or a conversation's contents, spell a special token."""
        if self.pattern is None:
            return False
        search = self.pattern.search
        if isinstance(item, str):
            return search(item) is not None
        return any(search(m["content"]) is not None for m in item)

    def split_encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of ``texts`` with special-token strings read as text."""
        if self._split is None:
            tokenizer = self.tokenizer()
            backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
            if backend is not None:
                from tokenizers import Tokenizer

                split = Tokenizer.from_str(backend.to_str())
                split.no_truncation()
                split.no_padding()
                split.encode_special_tokens = True
                self._split = lambda batch, add: [e.ids for e in split.encode_batch(batch, add_special_tokens=add)]
            else:
                self._split = lambda batch, add: [list(x) for x in self.tokenizer()(
                    batch, add_special_tokens=add, split_special_tokens=True)["input_ids"]]
        return self._split(texts, add_special_tokens) if texts else []

    def encode_guarded(self, convs: list[list[dict[str, str]]], render: Callable[[list], list[str]]) -> list[list[int]]:
        """Token ids of conversations rendered by ``render`` (:func:`_render`), special-token strings in their
        contents read as text (see the class docstring)."""
        hidden: list[tuple[str, list[str]]] = []  # per conversation: its mark, and the strings its placeholders hold
        masked = []
        for conv in convs:
            used = "".join(m["content"] for m in conv)
            mark = next(c for c in _MARKS if c not in used)  # 255 marks: no conversation holds them all
            strings: list[str] = []

            def hide(match: re.Match, mark=mark, strings=strings) -> str:
                strings.append(match.group())
                return f"{mark}{len(strings) - 1}\ue0ff"

            masked.append([{**m, "content": self.pattern.sub(hide, m["content"])} for m in conv])
            hidden.append((mark, strings))
        texts = render(masked)
        plan: list[list[int | str]] = []  # per conversation: markup ids and text pieces, in order
        for text, (mark, strings) in zip(texts, hidden):
            unmask = re.compile(re.escape(mark) + r"(\d+)\ue0ff")
            parts: list[int | str] = []
            start = 0
            for match in self.pattern.finditer(text):
                token, cut, end = match.group(), match.start(), match.end()
                if cut < start:  # inside the whitespace an rstrip token took
                    continue
                if token in self.lstrip:
                    cut = len(text[start:cut].rstrip()) + start
                if token in self.rstrip:
                    end = len(text) - len(text[end:].lstrip())
                if cut > start:
                    parts.append(unmask.sub(lambda m, strings=strings: strings[int(m.group(1))], text[start:cut]))
                parts.append(self.ids[token])
                start = end
            if start < len(text):
                parts.append(unmask.sub(lambda m, strings=strings: strings[int(m.group(1))], text[start:]))
            if not self.warned and any(isinstance(p, str) and mark in p for p in parts):
                self.warned = True
                log.warning("the chat template changed a message content's placeholder for a special-token string; "
                            "its characters are encoded as text")
            plan.append(parts)
        pieces = [p for parts in plan for p in parts if isinstance(p, str)]
        encoded = iter(self.split_encode(pieces, False))
        return [[i for p in parts for i in ([p] if isinstance(p, int) else next(encoded))] for parts in plan]


def _encode_checked(tokenizer: PreTrainedTokenizerBase, items: list, allow_special_tokens: bool,
                    clean: Callable[[list, list | None], list[list[int]]],
                    guarded: Callable[[ControlTokens, list], list[list[int]]],
                    keys: list | None = None) -> list[list[int]]:
    """``clean(items, keys)``, except for the items that spell a special token in a content (:class:`ControlTokens`),
    which ``guarded`` encodes: clean data takes exactly the paths it took before, at their speed."""
    if allow_special_tokens:
        return clean(items, keys)
    control = ControlTokens.of(tokenizer)
    spelled = [k for k, item in enumerate(items) if control.spelled(item)]
    if not spelled:
        return clean(items, keys)
    taken = set(spelled)
    rest = [k for k in range(len(items)) if k not in taken]
    out: list[list[int] | None] = [None] * len(items)
    for k, ids in zip(rest, clean([items[k] for k in rest], None if keys is None else [keys[k] for k in rest])):
        out[k] = ids
    for k, ids in zip(spelled, guarded(control, [items[k] for k in spelled])):
        out[k] = ids
    return out  # type: ignore[return-value]


def encode_plain(tokenizer: PreTrainedTokenizerBase, texts: list[str], allow_special_tokens: bool = False
                 ) -> list[list[int]]:
    """Token ids of texts outside a template (a response alone), without added special tokens: as
    ``tokenizer(texts, add_special_tokens=False)`` gives them, special-token strings read as text unless
    ``allow_special_tokens``."""
    return _encode_checked(
        tokenizer, list(texts), allow_special_tokens,
        lambda clean, _: [list(x) for x in tokenizer(clean, add_special_tokens=False)["input_ids"]] if clean else [],
        lambda control, spelled: control.split_encode(spelled, False))


class ChatTemplateRefused(PipelineError):
    """The chat template raised on a conversation (a template's ``raise_exception``: roles that do not alternate, a
    system turn it does not take, ...). ``index`` is the conversation's place in the list given to
    :func:`encode_prompts` or :func:`encode_conversations`, which a stage turns into the row of its input
    (:meth:`at`)."""

    def __init__(self, index: int, conversation: list, cause: Exception):
        self.index = index
        roles = ", ".join(str(m.get("role")) for m in conversation if isinstance(m, dict))
        self.reason = (f"the chat template refuses its conversation (roles: {roles}): {first_line(cause)}; change "
                       "its messages to what the template takes, or choose another --chat-template")
        super().__init__(f"conversation {index} of the batch: {self.reason}")

    def at(self, source: str, row: int) -> PipelineError:
        return PipelineError(f"{source}: row {row}: {self.reason}")


def _refusing(tokenizer: PreTrainedTokenizerBase, convs: list, add_generation_prompt: bool,
              error: Exception) -> Exception:
    """``error`` as a :class:`ChatTemplateRefused` naming the first conversation the template raises on, when it is
    a template's error (jinja's); else ``error`` itself."""
    from jinja2.exceptions import TemplateError

    if not isinstance(error, TemplateError):
        return error
    for k, conv in enumerate(convs):
        try:
            tokenizer.apply_chat_template([conv], add_generation_prompt=add_generation_prompt, tokenize=False)
        except TemplateError as e:
            return ChatTemplateRefused(k, conv, e)
    return error


def _encode_conversations_checked(tokenizer: PreTrainedTokenizerBase, convs: list, add_generation_prompt: bool,
                                  allow_special_tokens: bool, keys: list | None = None,
                                  meanwhile: Callable[[], None] | None = None) -> list[list[int]]:
    """Conversations through the template (:func:`_render`), special-token strings checked (:func:`_encode_checked`);
    a conversation the template refuses is a :class:`ChatTemplateRefused`."""
    render = _render(tokenizer, add_generation_prompt)
    try:
        return _encode_checked(
            tokenizer, convs, allow_special_tokens,
            lambda items, ks: encode_texts(tokenizer, items, render, add_special_tokens=False, keys=ks,
                                           meanwhile=meanwhile),
            lambda control, items: control.encode_guarded(items, render), keys=keys)
    except Exception as e:
        raise _refusing(tokenizer, convs, add_generation_prompt, e) from None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Iterable[str | list[dict[str, str]]], use_chat_template: bool = True,
    allow_special_tokens: bool = False,
) -> list[list[int]]:
    """Token ids of each prompt, ready for generation (generation prompt appended when a template is used).
    Special-token strings in a prompt are text unless ``allow_special_tokens`` (:class:`ControlTokens`)."""
    prompts = list(prompts)
    if use_chat_template and tokenizer.chat_template:
        return _encode_conversations_checked(tokenizer, [as_messages(p) for p in prompts], True, allow_special_tokens)
    if any(not isinstance(p, str) for p in prompts):
        raise PipelineError(
            "the tokenizer has no chat template, so 'messages' prompts cannot be rendered; "
            "use a chat model's tokenizer or give plain 'prompt' text"
        )
    return _encode_checked(tokenizer, prompts, allow_special_tokens,
                           lambda texts, _: encode_texts(tokenizer, texts, list, add_special_tokens=True),
                           lambda control, texts: control.split_encode(texts, True))


def encode_conversations(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str | list[dict[str, str]]], responses: list[str],
    meanwhile: Callable[[], None] | None = None, allow_special_tokens: bool = False,
) -> list[list[int]]:
    """Token ids of whole prompt + response conversations, as a reward model reads them (``meanwhile``: see
    :func:`encode_texts`). Consecutive conversations of one prompt (``rlhf score``'s n responses) have the prompt's
    part encoded once where that gives the same ids. Special-token strings in a prompt or response are text unless
    ``allow_special_tokens`` (:class:`ControlTokens`); ``meanwhile`` runs while the clean ones are encoded."""
    if tokenizer.chat_template:
        convs = [as_messages(p) + [{"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]
        return _encode_conversations_checked(tokenizer, convs, False, allow_special_tokens, keys=list(prompts),
                                             meanwhile=meanwhile)
    return _encode_checked(
        tokenizer, [as_text(p) + r for p, r in zip(prompts, responses)], allow_special_tokens,
        lambda texts, _: encode_texts(tokenizer, texts, list, add_special_tokens=True, meanwhile=meanwhile),
        lambda control, texts: control.split_encode(texts, True))


def _answer_end(tokenizer, rest: list[int], ends: list[int], answer: str) -> int:
    """The index in ``rest`` (the ids after the prompt) of the stop token that ends ``answer``: the first of ``ends``
    before which the answer's whole text has been written, else the last."""
    text = answer.strip()
    for end in ends[:-1]:
        if text in tokenizer.decode(rest[:end]):
            return end
    return ends[-1]


def encode_answers(
    tokenizer, prompts: list, answers: list[str], stop_ids: Iterable[int] = (), allow_special_tokens: bool = False
) -> tuple[list[list[int]], list[list[int]], int]:
    """(prompt ids, answer ids, rows whose template does not render the prompt as a prefix of the whole).

    The answer ends at the first stop token (``stop_ids``, the ids generation stops on, and the tokenizer's EOS) that
    follows its whole text, where sampling stops: the policy is trained on exactly the ids it will sample (an answer
    that spells a stop token, with ``allow_special_tokens``, keeps it as part of its text where the template writes a
    turn end after it; where decoding does not give the text back, the last stop token). Templates that put a
    newline after the turn's end token (ChatML's ``<|im_end|>\\n``, Gemma's ``<end_of_turn>\\n``), or the EOS after
    the last turn's end (Phi-3.5's ``<|end|>\\n<|endoftext|>``), would otherwise train tokens that sampling, stopped
    at the end token, never produces, and that the RL stages' sampled responses never contain. Where the rendering
    puts no stop token after the answer (raw text, ``--chat-template none``, or a template without a turn end), the
    EOS is added: sampling stops on it, so the policy must learn it.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stops = set(stop_ids) | set(eos)
    prompt_ids = encode_prompts(tokenizer, prompts, allow_special_tokens=allow_special_tokens)
    full_ids = encode_conversations(tokenizer, prompts, answers, allow_special_tokens=allow_special_tokens)
    answer_ids, fallbacks = [], 0
    for p, full, answer in zip(prompt_ids, full_ids, answers):
        if full[: len(p)] == p and len(full) > len(p):
            rest = full[len(p) :]
            ends = [i for i, t in enumerate(rest) if t in stops]
            answer_ids.append(rest[: _answer_end(tokenizer, rest, ends, answer) + 1] if ends else rest + eos)
        else:
            fallbacks += 1
            (ids,) = encode_plain(tokenizer, [answer], allow_special_tokens)
            answer_ids.append(ids + eos)
    return prompt_ids, answer_ids, fallbacks


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str, trust_remote_code: bool = False) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS plus the generation config's ``eos_token_id``.

    Chat models often stop on a turn-end token that is not the tokenizer's EOS (Llama-3: ``<|eot_id|>``); the
    generation config lists those, and both engines are given the same list.
    """
    from transformers import GenerationConfig

    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    local = Path(model_path)
    gen_eos = None
    if not local.exists() or (local / "generation_config.json").exists():
        try:
            gen_eos = GenerationConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).eos_token_id
        except OSError:  # a Hub model without generation_config.json
            log.info("%s has no generation_config.json; stopping on the tokenizer's EOS only", model_path)
    for i in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
        if i not in ids:
            ids.append(i)
    if not ids:
        raise PipelineError(f"{model_path}: neither the tokenizer nor the generation config names an EOS token")
    return ids
