"""A pairwise LLM judge, as pure functions: the prompt it is given, how its verdict is read, and how the verdicts of
both orders make one preference. ``rlhf eval --judge MODEL`` (``stages.eval``) samples the judge with rlhf generate's
engines (vLLM or HF generate, greedy) on the prompts :func:`judge_prompts` builds.

The template (``TEMPLATE``, version ``TEMPLATE_VERSION``) asks any chat model to compare answer A with answer B to
the same request, give a short reason, and end with ``[[A]]``, ``[[B]]`` or ``[[C]]`` (a tie), the verdict format of
MT-Bench's pairwise judge (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena",
arXiv:2306.05685). Every comparison is judged twice, once with the evaluated response as A and once as B, so that
a judge that prefers a position cancels out: the preference for the evaluated response is the mean of its scores
in the two orders (1 for a win, 1/2 for a tie, 0 for a loss). The verdict is the last marker in the judge's answer;
an answer with none cannot be read, and is counted, never guessed; a comparison without both verdicts read has no
preference and is left out of the win rate (one order's verdict alone carries that order's position bias).
"""

from __future__ import annotations

import re
from typing import Sequence

TEMPLATE_VERSION = "pairwise-v2"  # v2: a conversation's every turn in [Request] (v1: its last user turn alone)
TEMPLATE = """You are comparing two answers to the same request. Decide which answer serves the request better: \
correct, helpful and to the point, at whatever length the request needs. The order in which the answers are shown \
says nothing about their quality, and a longer answer is not a better one for being longer.

[Request]
{prompt}

[Answer A]
{answer_a}

[Answer B]
{answer_b}

Give your reason in one or two sentences. Then write your verdict on the last line: [[A]] if answer A is better, \
[[B]] if answer B is better, or [[C]] if they are equally good."""

_MARKER = re.compile(r"\[\[\s*([ABC])\s*\]\]")
# The evaluated response's score for a verdict, by the position it was shown in (0: as A, 1: as B).
_SCORE = {0: {"A": 1.0, "B": 0.0, "C": 0.5}, 1: {"A": 0.0, "B": 1.0, "C": 0.5}}


def request_text(prompt: str | Sequence[dict]) -> str:
    """What the judge is shown as the request: a prompt's text, or a conversation's turns in order, each under its
    role (``System: ...``, ``User: ...``, ``Assistant: ...``), since the answers respond to all of them (a system
    prompt's constraints, an earlier turn's question). A conversation of one user turn is that turn's text."""
    if isinstance(prompt, str):
        return prompt
    turns = list(prompt)
    if len(turns) == 1 and turns[0]["role"] == "user":
        return turns[0]["content"]
    return "\n\n".join(f"{turn['role'].capitalize()}: {turn['content']}" for turn in turns)


def judge_prompt(prompt: str, answer_a: str, answer_b: str) -> str:
    """The judge's request for one comparison (a user message; the judge's own chat template wraps it)."""
    return TEMPLATE.format(prompt=prompt, answer_a=answer_a, answer_b=answer_b)


def judge_prompts(prompt: str, ours: str, theirs: str) -> tuple[str, str]:
    """Both orders of one comparison: the evaluated response shown first, then second."""
    return judge_prompt(prompt, ours, theirs), judge_prompt(prompt, theirs, ours)


def parse_verdict(text: str) -> str | None:
    """``"A"``, ``"B"`` or ``"C"`` from a judge's answer: the last ``[[X]]`` marker in it; None when it has none."""
    found = _MARKER.findall(text or "")
    return found[-1] if found else None


def combine_orders(first: str | None, second: str | None) -> float | None:
    """The evaluated response's preference from its verdicts when shown first (as A) and second (as B): the mean of
    its two scores, None unless both were read. One order's verdict alone carries that order's position bias in full
    (a judge that always answers A, whose second answer could not be read, would win every such comparison)."""
    if first is None or second is None:
        return None
    return (_SCORE[0][first] + _SCORE[1][second]) / 2


def judge_summary(verdicts: Sequence[tuple[str | None, str | None]]) -> dict:
    """Counts over comparisons (each a pair of verdicts, evaluated response first then second): how many verdicts
    were read, how often both orders agree, and how often the judge chose the answer shown first."""
    read = [v for pair in verdicts for v in pair if v is not None]
    both = [(a, b) for a, b in verdicts if a is not None and b is not None]
    agree = sum(_SCORE[0][a] == _SCORE[1][b] for a, b in both)
    decided = [v for v in read if v != "C"]
    return {
        "comparisons": len(verdicts),
        "verdicts": 2 * len(verdicts),
        "unreadable": 2 * len(verdicts) - len(read),
        "no_verdict": sum(a is None and b is None for a, b in verdicts),
        "left_out": len(verdicts) - len(both),  # without both verdicts: no preference (combine_orders)
        "consistency": agree / len(both) if both else None,
        "first_position_rate": sum(v == "A" for v in decided) / len(decided) if decided else None,
        "tie_rate": sum(v == "C" for v in read) / len(read) if read else None,
    }
