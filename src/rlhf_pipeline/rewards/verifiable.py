"""Verifiable rewards: built-in reward functions that check a response against a ground-truth answer (1.0 right,
0.0 wrong), for ``rlhf score`` and ``rlhf eval``::

    rlhf eval --model runs/sft --prompts gsm8k_test.jsonl --n 8 --reference-column answer \\
        --reward-fn rlhf_pipeline.rewards.verifiable:math_equal --output runs/eval_math

Each is an ordinary reward function (``fn(prompts, responses, **columns) -> list[float]``, see
:mod:`rlhf_pipeline.rewards`) and reads the ground truth from the keyword ``reference``: the column that
``--reference-column NAME`` names is passed as ``reference``; without that option, the first of the columns
``reference``, ``answer``, ``solution``, ``ground_truth`` that the dataset has (:data:`REFERENCE_COLUMNS`). The
prompt dataset's extra columns travel through ``rlhf generate``, so a jsonl of ``{"prompt": ..., "answer": ...}``
is all it takes.

- :func:`math_equal`: the response's final answer is mathematically equal to the reference, checked by
  ``math-verify`` (``pip install 'rlhf-pipeline[verify]'``): ``\\boxed{\\frac{1}{2}}`` equals ``0.5``, ``1,234``
  equals ``1234``. A response with no final answer (see :func:`extract_answer`) is wrong.
- :func:`exact_match`: the final answer (or, when none is found, the whole response) equals the reference after
  :func:`normalize_answer`.
- :func:`regex_match`: the reference is a regular expression; right when ``re.search`` finds it in the response.
- :func:`boxed_format`: a format check, no reference: exactly one ``\\boxed{...}``, and it is not empty.

The final answer (:func:`extract_answer`): the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``); else what
follows the last GSM8K-style ``#### ``; else what follows the last "answer is" / "answer:" ("The final answer is
$42$." gives ``42``; a remark after it, "the answer is consistent with step 2", is not taken for the answer, see
:func:`_last_answer`). :func:`math_equal` then reads a plain number's unit words as the number ("18 cookies" is 18;
"1 million" and "5 squared" stay whole). The reference goes through the same extraction, so a GSM8K ``answer``
column (a worked solution ending in ``#### 72``) serves as it is; a reference with none of these is taken whole.

Majority voting: :func:`math_equal` and :func:`exact_match` carry ``extract_answer(response) -> str | None``, the
canonical answer a response votes for (the normalised final answer; under :func:`math_equal` a plain number by its
value, its unit words left out), which ``rlhf eval`` uses for maj@k. Answers are otherwise compared as normalised
strings, so ``0.5`` and ``\\frac{1}{2}`` are two different votes (math-verify compares two expressions; it does
not give a canonical form to count).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any, Sequence

from rlhf_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

# Where the reference answers are read from when --reference-column is not given: the first of these columns.
REFERENCE_COLUMNS = ("reference", "answer", "solution", "ground_truth")
# Seconds math-verify may spend parsing one answer, or comparing two, before the response counts as wrong.
MATH_VERIFY_TIMEOUT = 5

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# What introduces a final answer, which runs to the end of its line or sentence
_GSM8K = re.compile(r"####\s*")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
# An answer that offers alternatives ("41 or 42", "41 \lor 42")
_ALTERNATIVES = re.compile(r"\bor\b|\\lor(?![A-Za-z])|\\vee(?![A-Za-z])", re.IGNORECASE)
# Stripped from both ends of an answer: whitespace, sentence punctuation, quotes, markdown emphasis, TeX's $; a
# period from the end only (".5" is a number).
_SURROUNDING = " \t\r\n.,;:!?\"'`*$"
_LEADING = _SURROUNDING.replace(".", "")
# math_equal reads a plain number followed by words only as the number: "18 cookies", "$1,000 dollars", "3.5 km"
# (math-verify would read the words as a product of letters). Not when a word changes the value or joins the number
# to more ("1 million", "3 dozen", "2 pi", "5 squared", "5 or 6", "3 to 4"), nor with a digit among the words ("3
# hours and 20 minutes").
_NUMBER_THEN_WORDS = re.compile(r"([-+−]?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?)\s+([A-Za-z][A-Za-z' -]*)")
_VALUE_WORDS = {"or", "and", "to", "plus", "minus", "times", "over", "divided", "by", "of", "per", "point", "half",
                "halves", "third", "thirds", "quarter", "quarters", "fourths", "dozen", "dozens", "score", "hundred",
                "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions", "trillion",
                "squared", "cubed", "pi", "percent", "degrees", "radians", "i", "e", "x", "y", "n", "k"}


def _boxed_contents(text: str) -> list[str]:
    """The content of every ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` with balanced braces, in order (one not
    closed is left out)."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def _strip_math(answer: str) -> str:
    """An answer without surrounding whitespace, ``$...$``, ``\\(...\\)`` and a sentence's final period."""
    answer = answer.strip()
    if answer.startswith("\\(") and answer.endswith("\\)"):
        answer = answer[2:-2]
    return _strip(answer)


def _strip(answer: str) -> str:
    return answer.lstrip(_LEADING).rstrip(_SURROUNDING)


def _without_unit(answer: str) -> str:
    """``18 cookies`` -> ``18``: a plain number's trailing words (see :data:`_NUMBER_THEN_WORDS`) left out."""
    match = _NUMBER_THEN_WORDS.fullmatch(answer)
    if match is None or _VALUE_WORDS & set(match.group(2).casefold().replace("-", " ").split()):
        return answer
    return match.group(1)


def extract_answer(text: str) -> str | None:
    """The final answer of a response (see the module docstring): the last ``\\boxed{}``, else the last ``#### X``,
    else the last "answer is X" (up to the end of its line or sentence; not a remark, :func:`_last_answer`); None
    when there is none or it is empty."""
    boxed = _boxed_contents(text)
    if boxed:
        return _strip_math(boxed[-1]) or None
    return _last_answer(_GSM8K, text) or _last_answer(_ANSWER_IS, text)


# A candidate that reads as a remark rather than an answer: it starts with a lower-case word and goes on ("it is
# correct", "consistent with step 2", "not 1984"); "yes", "sqrt(2)", "x = 3" and "(C)" do not
_REMARK = re.compile(r"[a-z]{2,}\s")


def _last_answer(introduced_by: re.Pattern, text: str) -> str | None:
    """What follows the last of ``introduced_by``'s matches that is followed by an answer, up to the end of its line
    or sentence (a period followed by a space or the end: not a decimal point). The last, as a response that
    corrects itself ("The answer is 6. Wait: the answer is 7.") means its last, a second answer on the same line
    included; but not a remark after the answer ("The answer is 20. I checked that the answer is consistent with
    step 2."): a candidate that starts with a lower-case word and goes on is taken only when every one does."""
    candidates = []
    for match in introduced_by.finditer(text):
        line = text[match.end():].split("\n", 1)[0]
        answer = _strip_math(re.split(r"\.(?:\s|$)", line, maxsplit=1)[0])
        if answer:
            candidates.append(answer)
    answers = [a for a in candidates if not _REMARK.match(a)]
    return (answers or candidates or [None])[-1]


def normalize_answer(answer: str) -> str:
    """How :func:`exact_match` compares answers: case folded; runs of whitespace made one space; whitespace,
    ``.,;:!?``, quotes, ``*`` and ``$`` stripped from both ends, a period from the end only (``.5`` is a number;
    brackets are kept: ``(1, 2)`` is a tuple); thousands separators removed from numbers (``1,234,567`` ->
    ``1234567``; a comma followed by three digits and no fourth)."""
    answer = _strip(re.sub(r"\s+", " ", answer.casefold()))
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", answer)


def no_reference(fn: str, columns, source: str | None = None) -> PipelineError:
    """The error of a reward function that reads a ground truth (``needs_reference``) given data without one."""
    have = ", ".join(sorted(c for c in columns if c != "finish_reasons")) or "none"
    return PipelineError(
        f"{source + ': ' if source else ''}{fn} needs each prompt's ground truth, and the data has no column "
        f"{', '.join(REFERENCE_COLUMNS[:-1])} or {REFERENCE_COLUMNS[-1]} (its columns: {have}); pass "
        "--reference-column NAME"
    )


def _references(columns: dict[str, Any], count: int, fn: str) -> list[str]:
    """The reference answer of each response, as text: the ``reference`` column (what --reference-column passes),
    else the first of :data:`REFERENCE_COLUMNS` present."""
    for name in REFERENCE_COLUMNS:
        if name in columns:
            values = list(columns[name])
            break
    else:
        raise no_reference(fn, columns)
    if len(values) != count:
        raise ValueError(f"{fn}: {len(values)} references for {count} responses")
    ids = columns.get("prompt_id")
    for i, value in enumerate(values):
        if value is None:
            at = f" (prompt_id {ids[i]})" if ids is not None else ""
            raise PipelineError(f"{fn}: response {i} of the batch{at} has no reference answer (null); give every "
                                "prompt one")
    return [str(v) for v in values]


def _reference_answer(reference: str) -> str:
    return extract_answer(reference) or _strip_math(reference)


# ---------------------------------------------------------------------------------------------------------------
# math_equal

def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise PipelineError("math_equal needs the math-verify package: pip install 'rlhf-pipeline[verify]'") from None
    return math_verify


@functools.lru_cache(maxsize=1)
def _warn_no_timeout() -> None:
    log.warning("math_equal runs outside the main thread, where math-verify's timeout (signal.alarm) cannot work: "
                "parsing and comparing run without a time limit")


def _timeout() -> int | None:
    """math-verify's time limit: it uses ``signal.alarm``, which Python allows on the main thread only (elsewhere it
    raises ValueError: math-verify would fail every call). ``rlhf score`` calls reward functions on its main thread
    (each process of an ``accelerate launch`` has its own); off it (a user's thread pool), no limit, with a warning."""
    if threading.current_thread() is threading.main_thread():
        return MATH_VERIFY_TIMEOUT
    _warn_no_timeout()
    return None


def math_equal(prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> list[float]:
    """1.0 when the response's final answer (:func:`extract_answer`) is mathematically equal to the reference's,
    by math-verify's ``parse`` and ``verify``; 0.0 otherwise, a response without a final answer included. An answer
    math-verify cannot parse, or that takes longer than :data:`MATH_VERIFY_TIMEOUT` seconds, is wrong, and so is
    one hedging over candidates that math-verify reads as one value (:func:`_hedged`)."""
    mv = _math_verify()
    references = _references(columns, len(responses), "math_equal")
    limit = _timeout()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]

    def parse(answer: str):
        # Boxed, so that math-verify's LaTeX extraction reads the whole answer (and plain numbers as well)
        return mv.parse("\\boxed{" + answer + "}", extraction_config=config, parsing_timeout=limit)

    golds: dict[str, Any] = {}
    values = []
    for response, reference in zip(responses, references):
        answer = extract_answer(response)
        if answer is None:
            values.append(0.0)
            continue
        if reference not in golds:
            golds[reference] = parse(_without_unit(_reference_answer(reference)))
        gold, target = golds[reference], parse(_without_unit(answer))
        ok = bool(gold) and bool(target) and mv.verify(gold, target, timeout_seconds=limit)
        if ok and _hedged(answer, target) and normalize_answer(answer) != normalize_answer(
                _reference_answer(reference)):
            # right only if every alternative is: a restatement ("0.5 (or 1/2)"), not a list of candidates
            parts = [p.strip(" ()[],;") for p in _ALTERNATIVES.split(answer)]
            ok = all(p and mv.verify(gold, parse(_without_unit(p)), timeout_seconds=limit) for p in parts)
        values.append(1.0 if ok else 0.0)
    return values


def _hedged(answer: str, parsed: list) -> bool:
    """Whether an answer offers alternatives ("1 (or 2 or 42)", ``41 \\lor 42``) that math-verify read as one value
    (it reads "41 or 42" as the set {41, 42}, which a number does not equal, but these as 42): a response must not
    be right for listing candidates (unless it is the reference itself, "(A) or (C)", or every alternative is)."""
    import sympy

    return bool(_ALTERNATIVES.search(answer)) and not isinstance(parsed[0], (sympy.Set, set, frozenset, tuple, list))


_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)%?")


def _canonical(response: str) -> str | None:
    """The answer a response votes for under :func:`math_equal`: normalised (:func:`normalize_answer`), and a plain
    number by its value, its unit words and a percent sign left out as math_equal reads it (``42``, ``42.0``,
    ``$42.00``, ``42%``, and ``42 apples`` are one vote)."""
    answer = extract_answer(response)
    if answer is None:
        return None
    text = normalize_answer(_without_unit(answer)).replace("−", "-")  # a typeset minus sign is a minus
    if _PLAIN_NUMBER.fullmatch(text):  # a percent sign left out, as math_equal grades 42% right against 42
        from decimal import Context, Decimal

        text = text.rstrip("%")
        value = Decimal(text)  # normalised at the number's own precision: two long numbers stay two votes
        text = "0" if value == 0 else format(value.normalize(Context(prec=len(text) + 1)), "f")
    return text or None


math_equal.extract_answer = _canonical  # type: ignore[attr-defined]
math_equal.needs_reference = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------------------
# exact_match, regex_match, boxed_format

def _exact_answer(response: str) -> str:
    answer = extract_answer(response)
    return normalize_answer(answer if answer is not None else response)


def exact_match(prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> list[float]:
    """1.0 when the final answer (or, when none is found, the whole response) equals the reference's after
    :func:`normalize_answer`."""
    references = _references(columns, len(responses), "exact_match")
    return [1.0 if _exact_answer(r) == normalize_answer(_reference_answer(ref)) else 0.0
            for r, ref in zip(responses, references)]


exact_match.extract_answer = lambda response: _exact_answer(response) or None  # type: ignore[attr-defined]
exact_match.needs_reference = True  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str):
    import regex  # re's syntax (its VERSION0), with a time limit on a match; a dependency of transformers

    return regex.compile(pattern)


# How long one match may take: a pattern of the data that backtracks catastrophically (``^(a+)+$``) would otherwise
# hold the score stage for hours on one response, saying nothing.
REGEX_SECONDS = 5.0


def regex_match(prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> list[float]:
    """1.0 when the reference, a Python regular expression, matches somewhere in the response (``re.search``; use
    ``^...$`` to match the whole response, ``(?i)`` to ignore case). A match that takes over ``REGEX_SECONDS`` is an
    error naming the pattern. The ``regex`` module matches it, which reads ``re``'s syntax alike but for a few
    additions ``re`` lacks or reads otherwise: fuzzy matching (``x{e<=1}``), POSIX classes (``[[:digit:]]``),
    variable-width lookbehind and ``\z``."""
    import regex

    references = _references(columns, len(responses), "regex_match")
    ids = columns.get("prompt_id")
    values = []
    for i, (response, pattern) in enumerate(zip(responses, references)):
        at = f"response {i} of the batch{f' (prompt_id {ids[i]})' if ids is not None else ''}"
        try:
            compiled = _compiled(pattern)
        except (re.error, regex.error) as e:
            raise PipelineError(f"{at}: the reference {pattern!r} is not a regular expression ({e}); fix it in the "
                                "prompt dataset") from None
        try:
            values.append(1.0 if compiled.search(response, timeout=REGEX_SECONDS) else 0.0)
        except TimeoutError:
            raise PipelineError(f"{at}: the reference {pattern!r} took over {REGEX_SECONDS:g} s to match a response "
                                f"of {len(response)} characters (nested repeats such as (a+)+ backtrack without "
                                "end); simplify it in the prompt dataset") from None
    return values


regex_match.needs_reference = True  # type: ignore[attr-defined]


def boxed_format(prompts: Sequence[str], responses: Sequence[str], **columns: Any) -> list[float]:
    """1.0 when the response has exactly one ``\\boxed{...}`` (or ``\\fbox``) and its content is not empty; needs no
    reference."""
    values = []
    for response in responses:
        boxed = _boxed_contents(response)
        one = len(_BOXED.findall(response)) == 1 and len(boxed) == 1 and boxed[0].strip() != ""
        values.append(1.0 if one else 0.0)
    return values
