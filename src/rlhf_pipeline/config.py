"""Stage configs: one dataclass per stage, parsed from kebab-case flags and an optional ``--config file.yaml``.

Every field carries its help text in ``field(metadata={"help": ...})``; the same field is a command-line flag
(``max_new_tokens`` -> ``--max-new-tokens``) and a YAML key (``max_new_tokens`` or ``max-new-tokens``). Values on
the command line win over the YAML file, which wins over the defaults. YAML values are checked against the
option's type and choices as flags are (numbers written as text, ``1e-6``, become numbers), and no float option
takes ``nan`` or ``inf``; each config's ``__post_init__`` checks ranges, so a bad value is one ``error:`` line
before anything runs (what may not exist yet, such as a later iteration's model, is checked by the stage itself).

Fields shared by several stages live in small dataclasses (``OutputOptions``, ``ControlTokenOptions``,
``ChatTemplateOptions``, ``sampling_options.SamplingOptions``) that stage configs inherit from, so a flag, its help
and its checks are declared once; one whose ``options_group`` names a help section gets its own section in
``--help``. A stage that needs another default for a shared field changes only that (:func:`override`), and passes a
group on to another config with :func:`options_of`. ``metadata={"semantic": False}`` marks fields that do not change
a stage's output (``--overwrite``, ``--num-proc``); they are left out when deciding whether a finished output can be
reused.

Why not transformers' ``HfArgumentParser`` (which TRL builds on): it maps the same dataclasses to flags (with dash
aliases, ``Literal`` and ``Enum`` choices, help from metadata), but it reads a YAML file *instead of* the command
line (``parse_yaml_file``), so "YAML, then flags that override it" needs TRL's ``TrlParser`` on top; it has no
notion of options that do not change the output (what decides reuse here), no help sections for shared groups, and
importing it loads transformers (seconds) before ``--help`` can answer. This module is those parts alone. Choices
are ``Literal`` types, derived where a registry defines them (``algorithms.AlgoName``, ``tiny.ChatFormatName``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Literal, Optional, Sequence, TypeVar, Union

from rlhf_pipeline.chat_templates import BUILTIN_TEMPLATES
from rlhf_pipeline.errors import PipelineError

C = TypeVar("C")

# A model's --dtype: auto (modeling.resolve_dtype: bfloat16 on a GPU that supports it, float32 elsewhere) or a dtype
DTYPES = ("auto", "float32", "bfloat16", "float16")
DtypeName = Literal[DTYPES]  # type: ignore[valid-type]


def option(default: Any = MISSING, help: str | Callable[[], str] = "", semantic: bool = True, reads: Any = None,
           **kwargs: Any) -> Any:
    """A config field with its help text. ``semantic=False`` means the value does not change the output. ``help`` may
    be a function, called when the help is shown: for a text derived from the algorithm registry, whose entries are
    registered after the options that describe them. ``reads`` (``rlhf train``'s algorithm options) is a predicate on
    an algorithm entry, true for the algorithms that read it (``algorithms.registry.check_reads`` refuses the option,
    given, for the others)."""
    metadata = {"help": help, "semantic": semantic, **({"reads": reads} if reads is not None else {})}
    return field(default=default, metadata=metadata, **kwargs)


def trust_remote_code_option(code: str = "model code", note: str = "") -> Any:
    """``--trust-remote-code``, declared here for every stage that loads a model or a tokenizer: off unless the user
    turns it on, with the same help everywhere (``code`` says whose code runs, ``note`` when it is needed)."""
    return option(False, help=f"Run custom {code} from the model's repo{note}; off by default, for repos you trust.")


def override(group: type, name: str, default: Any = MISSING, *, semantic: bool | None = None) -> Any:
    """The shared field ``name`` of ``group`` with another default (or ``semantic`` flag) for one stage; its help
    and its checks (the group's ``__post_init__``) stay where the group declares them."""
    (shared,) = [f for f in dataclasses.fields(group) if f.name == name]
    metadata = dict(shared.metadata, **({} if semantic is None else {"semantic": semantic}))
    if default is MISSING and shared.default_factory is not MISSING:
        return field(default_factory=shared.default_factory, metadata=metadata)
    return field(default=shared.default if default is MISSING else default, metadata=metadata)


def default_of(group: type, name: str) -> Any:
    """The default of ``group``'s field ``name``: for another stage's option that means the same under another name
    (rlhf eval's ``--score-batch-size`` is rlhf score's ``--batch-size``)."""
    (shared,) = [f for f in dataclasses.fields(group) if f.name == name]
    return shared.default


def options_of(config: Any, group: type) -> dict[str, Any]:
    """The values of ``group``'s fields in ``config`` (an instance of a config that inherits ``group``), to pass
    on to another stage's config: ``GenerateConfig(..., **options_of(eval_config, SamplingOptions))``."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(group)}


# How a stage's dataset input may be given (datasets_io.parse_ref reads it); quoted by the options' help.
DATASET_REF = ("a directory, a .json/.jsonl/.parquet file, or a Hub dataset ORG/NAME[#CONFIG][:SPLIT][@REVISION] "
               "(#CONFIG: a configuration, as rlhf iterate --push-to-hub writes each stage)")


@dataclass(kw_only=True)
class OutputOptions:
    """Where a stage writes, and what it does when the output already exists. ``writes`` is what its output is, for
    the help: ``"dataset"`` (the default) or ``"model"`` (the training stages)."""

    options_group: ClassVar[str] = "output options"
    writes: ClassVar[str] = "dataset"

    output: str = option(
        help="Output directory: {writes_layout}.", semantic=False
    )
    overwrite: bool = option(
        False,
        help="Replace an existing output made with a different config or inputs (it is otherwise refused).",
        semantic=False,
    )
    push_to_hub: Optional[str] = option(
        None,
        help="Also upload the output to this Hub {writes} repo (ORG/NAME). The token comes from HF_TOKEN.",
        semantic=False,
    )
    hub_config: Optional[str] = option(
        None,
        help="Where in --push-to-hub's repo the output goes: a configuration (subset) NAME of the dataset repo, its "
        "manifest at manifests/NAME.json (read it back as ORG/REPO#NAME), or a training stage's branch NAME of the "
        "model repo. Default: the default configuration (manifest.json), the main branch.",
        semantic=False,
    )
    private: bool = option(
        False, help="Create --push-to-hub's repo private (a repo that exists keeps its visibility).", semantic=False
    )


@dataclass(kw_only=True)
class ControlTokenOptions:
    """How the stages that render conversations (generate, score, eval, sft, train-rm, filter) read special-token
    strings written in prompts and responses (``chat.ControlTokens``)."""

    allow_special_tokens_in_text: bool = option(
        False,
        help="Read special-token strings written in prompts and responses (<|im_start|>, <|eot_id|>, ...) as the "
        "control tokens themselves, for data that stores them on purpose. By default they are text: only the chat "
        "template's own markup gives control tokens, so a response cannot forge a turn.",
    )


NO_CHAT_TEMPLATE = "none"  # --chat-template none: raw text, on purpose


@dataclass(kw_only=True)
class ChatTemplateOptions:
    """Which chat template the stages that render conversations (generate, score, eval, sft, train-rm, filter) use
    (``chat.use_chat_template``): the option, then the tokenizer's own; none at all is an error."""

    chat_template: Optional[str] = option(
        None,
        help="Render conversations with this chat template instead of the tokenizer's own: a Jinja template file, a "
        f"built-in name ({', '.join(BUILTIN_TEMPLATES)}), or '{NO_CHAT_TEMPLATE}' for raw prompt text (no "
        "'messages' rows then). Default: the tokenizer's template; a tokenizer without one is an error.",
    )


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help_sections(cls: type, first: type | None = None) -> list[tuple[str, set[str]]]:
    """(title, field names) of each shared group ``cls`` inherits that names a help section, in base-class order
    (``first``'s first: a field two groups declare is listed in the first), and the output options last (always:
    stages that declare their own ``--output`` list it there too)."""
    bases = sorted(cls.__mro__[1:], key=lambda base: base is not first)
    inherited = [
        (base.__dict__["options_group"], {f.name for f in dataclasses.fields(base)})
        for base in bases
        if dataclasses.is_dataclass(base) and "options_group" in base.__dict__ and base is not OutputOptions
    ]
    return inherited + [(OutputOptions.options_group, {f.name for f in dataclasses.fields(OutputOptions)})]


# What a stage's output is (OutputOptions.writes), in its options' help
_WRITES_LAYOUT = {"dataset": "a `datasets.save_to_disk` layout plus manifest.json",
                  "model": "the model (save_pretrained: safetensors, config, tokenizer) plus manifest.json, its "
                  "metrics and its checkpoints"}


def _help(cls: type, text: str | Callable[[], str]) -> str:
    """An option's help (called, when a function) with ``{writes}`` and ``{writes_layout}`` filled in for ``cls``
    (see OutputOptions)."""
    text = text() if callable(text) else text
    writes = getattr(cls, "writes", "dataset")
    return text.replace("{writes_layout}", _WRITES_LAYOUT[writes]).replace("{writes}", writes)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors on one line: the usage it prints first runs to dozens of lines for a
    stage such as rlhf train, and buried the error under it (``--help`` shows the usage). A value that is not one
    of an option's choices gets the closest one (``--algo dop``: did you mean dpo?)."""

    def error(self, message: str):  # type: ignore[override]
        import re

        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if wrong:
            listed = wrong.group(2)
            choices = re.findall(r"'([^']*)'", listed) or [c.strip() for c in listed.split(",")]
            close = difflib.get_close_matches(wrong.group(1).lower(), choices, n=1, cutoff=0.6)
            message += f"; did you mean {close[0]}?" if close else ""
        if "--help" not in message and "did you mean" not in message:
            message += f"; {self.prog} --help lists the options"
        self.exit(2, f"error: {self.prog}: {message}\n")


def build_parser(cls: type, prog: str, description: str | None = None, only: set[str] | None = None,
                 first: type | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one kebab-case flag per dataclass field: the stage's own options first, then one
    section per shared group (sampling options, output options). ``only``: the fields to show (a help view, such as
    ``rlhf train --algo X --help``); the others are left out. ``first``: the group whose section lists a field that
    several groups declare (by default the first in base-class order)."""
    parser = _Parser(prog=prog, description=description or (cls.__doc__ or "").strip(), allow_abbrev=False)
    stage_group = parser.add_argument_group("stage options")
    sections = _help_sections(cls, first)
    groups = [stage_group] + [parser.add_argument_group(title) for title, _ in sections]
    hints = typing.get_type_hints(cls)
    mappings = [f.name for f in dataclasses.fields(cls) if _is_mapping(hints[f.name])]
    example = "train" if "train" in mappings else mappings[0] if mappings else ""
    merged = (f" A mapping's flag overrides it key by key: {_flag(example)} '{{key: value}}' changes that key of the "
              "file's mapping and keeps the others (null takes one away; a key whose value is a mapping gets the "
              "flag's whole)." if mappings else "")
    stage_group.add_argument(
        "--config", metavar="FILE.yaml", default=None, help="Read options from a YAML file; flags override it." + merged
    )

    def section(f: dataclasses.Field) -> int:
        return next((k + 1 for k, (_, names) in enumerate(sections) if f.name in names), 0)

    fields = sorted(dataclasses.fields(cls), key=section)  # stable: in declaration order within a section
    if only is not None:
        fields = [f for f in fields if f.name in only]
    for f in fields:
        tp, _ = _strip_optional(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "help": _help(cls, f.metadata.get("help", ""))}
        required = f.default is MISSING and f.default_factory is MISSING
        if required:
            kwargs["default"] = None
            kwargs["help"] += " (required)"
        else:
            kwargs["default"] = f.default if f.default is not MISSING else f.default_factory()
            if kwargs["default"] is not None and kwargs["default"] is not False:
                kwargs["help"] += f" (default: {kwargs['default']})"
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is Literal:
            choices = typing.get_args(tp)
            kwargs["choices"] = choices
            kwargs["type"] = type(choices[0])
        elif typing.get_origin(tp) in (list, Sequence):
            (item,) = typing.get_args(tp)
            kwargs["nargs"] = "+"
            kwargs["action"] = _RepeatableList
            kwargs["type"] = item
            kwargs["metavar"] = f.name.upper().rstrip("S")
        elif _is_mapping(tp):
            kwargs["type"] = _mapping
            kwargs["action"] = _MergedMapping
            kwargs["metavar"] = "YAML"
        elif tp in (int, float, str):
            kwargs["type"] = tp
            kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(tp, f.name.upper())
        else:  # pragma: no cover - a config author's mistake, caught by the config tests
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported option type {tp!r}")
        groups[section(f)].add_argument(_flag(f.name), **kwargs)
    return parser


class _RepeatableList(argparse.Action):
    """A list option: ``--reward-fn a b`` and ``--reward-fn a --reward-fn b`` both give ``[a, b]`` (argparse's
    ``nargs="+"`` alone keeps only the last use, silently). The first use on the command line replaces the default
    (or the YAML value: ``set_defaults`` makes it the default), so flags still win over the YAML file; argparse's own
    ``extend`` would add to it instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        # the namespace starts with the default object itself: while it is still there, this is the first use
        setattr(namespace, self.dest, list(values) if current is self.default else [*current, *values])


def _is_mapping(tp: Any) -> bool:
    tp, _ = _strip_optional(tp)
    return tp is dict or typing.get_origin(tp) is dict


class _MergedMapping(argparse.Action):
    """A mapping option: each use on the command line is merged into the mapping so far (the YAML file's, which
    ``set_defaults`` makes the default, then the earlier uses), key by key, its own keys winning. So
    ``--train '{gradient_accumulation_steps: 32}'`` changes that one option of the config's train section and keeps
    the others; a key set to null takes the config's value away (the stage's default applies). One level deep: a
    key whose value is itself a mapping (``lane_env``'s ``sample``) takes the flag's mapping whole."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, {**(current or {}), **values})


def _mapping(text: str) -> dict[str, Any]:
    """A mapping option on the command line, written in YAML flow style: ``--train '{learning_rate: 1e-6}'``."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise argparse.ArgumentTypeError(f"not valid YAML: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping such as '{{key: value}}', got {text!r}")
    return value


def did_you_mean(name: str, known: Iterable[str], hint: str = "; --help lists the options") -> str:
    """The end of an unknown-option error: the closest known name (a misspelling), else where to look."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else hint


def _load_yaml(path: str, cls: type) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise PipelineError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise PipelineError(f"--config {path}: not valid YAML ({e}); fix the syntax") from None
    if not isinstance(data, dict):
        raise PipelineError(f"--config {path}: expected a mapping of option names to values, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise PipelineError(f"--config {path}: unknown option '{key}'{did_you_mean(name, names)}")
        out[name] = _yaml_value(f"--config {path}: {key}", value, hints[name])
    return out


def _yaml_value(where: str, value: Any, tp: Any) -> Any:
    """A YAML value checked against its option's type, as argparse checks a flag's: numbers written as text
    (PyYAML reads ``1e-6`` as a string) become numbers; anything else of the wrong type is an error naming the key."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise PipelineError(f"{where}: has no value; give it one or remove the line")
    origin = typing.get_origin(tp)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool:
        if isinstance(value, bool):
            return value
        expected = "true or false"
    elif origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, type(choices[0])) and value in choices:
            return value
        raise PipelineError(f"{where}: {value!r} is not one of the choices ({', '.join(map(str, choices))})")
    elif tp is int:
        if number and float(value).is_integer():
            return int(value)
        expected = "a whole number"
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return int(value)
    elif tp is float:
        if number:
            return float(value)
        expected = "a number"
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return float(value)
    elif tp is str:
        if isinstance(value, str) or number:
            return str(value)
        expected = "text"
    elif origin in (list, Sequence):
        (item,) = typing.get_args(tp)
        return [_yaml_value(where, v, item) for v in (value if isinstance(value, list) else [value])]
    elif _is_mapping(tp):
        if isinstance(value, dict):
            return value
        expected = "a mapping such as {key: value}"
    else:  # pragma: no cover - build_parser refuses other types
        return value
    raise PipelineError(f"{where}: expected {expected}, got {value!r}")


def parse_config(cls: type[C], argv: Sequence[str] | None, prog: str) -> C:
    """Parse ``argv`` (and ``--config``) into an instance of the dataclass ``cls``."""
    parser = build_parser(cls, prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_load_yaml(pre.config, cls))
    parsed, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [name for action in parser._actions for name in action.option_strings]
        given = next((a.partition("=")[0] for a in unknown if a.startswith("--")), None)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}"
                     + (did_you_mean(given, flags, hint=f"; {prog} --help lists the options") if given else ""))
    ns = vars(parsed)
    ns.pop("config")
    missing = [
        _flag(f.name)
        for f in dataclasses.fields(cls)
        if f.default is MISSING and f.default_factory is MISSING and ns.get(f.name) is None
    ]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    for name, value in ns.items():  # argparse's float() takes "nan" and "inf"; no option means either
        if _strip_optional(hints[name])[0] is float and isinstance(value, float) and not math.isfinite(value):
            raise PipelineError(f"{prog}: {_flag(name)} must be a finite number, got {value}")
    try:
        return cls(**ns)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"{prog}: {e}") from None


def check_test_size(value: float) -> None:
    """``--test-size``: a row count (a whole number), or a fraction below 1; 0 means no test split."""
    if value < 0:
        raise ValueError("--test-size must be >= 0 (a row count, or a fraction below 1; 0 = none)")
    if value >= 1 and not float(value).is_integer():
        raise ValueError(f"--test-size {value:g}: use a fraction below 1 or a whole number of rows")


def semantic_dict(config: Any) -> dict[str, Any]:
    """The fields of ``config`` that change a stage's output (used to decide whether a finished run is reusable)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.metadata.get("semantic", True)}


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
