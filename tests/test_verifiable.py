"""Verifiable rewards: pass@k and maj@k (evalstats), the built-in reward functions (rewards.verifiable), and
--reference-column through rlhf score and rlhf eval."""

import json
import math
import re
import time
from itertools import combinations
from pathlib import Path

import pytest

from conftest import run, write_jsonl
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.evalstats import (
    at_k_summary,
    k_ladder,
    maj_at_k,
    maj_at_k_summary,
    pass_at_k,
    pass_at_k_summary,
)
from rlhf_pipeline.rewards import verifiable as V

# ---------------------------------------------------------------------------------------------------------------
# pass@k and maj@k


def test_pass_at_k_hand_worked():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    # k=1 is the fraction correct: 2/5
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-12)
    # n=4, c=1, k=3: 1 - C(3,3)/C(4,3) = 1 - 1/4
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75, abs=1e-12)
    # none correct: 0; all correct: 1
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0


def test_pass_at_k_is_one_when_fewer_than_k_are_wrong():
    # n - c < k: every draw of k holds a correct sample (n=4, c=2, k=3: 2 wrong < 3)
    assert pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0
    # n - c == k: exactly one draw of k misses: 1 - 1/C(4,2) with c=2, k=2
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 9, 16])
def test_pass_at_k_equals_the_naive_binomial_and_the_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            naive = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(naive, abs=1e-12), (n, c, k)
            if n <= 9:  # every draw of k of the n samples, the first c of them correct
                draws = list(combinations(range(n), k))
                hit = sum(any(i < c for i in d) for d in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_a_float():
    # C(2000, 1000) overflows a float: the product form stays in [0, 1] and matches exact integer arithmetic
    n, c, k = 2000, 3, 1000
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python's int / int division is exact to a float
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_k_ladder():
    assert k_ladder(1) == [1]
    assert k_ladder(4) == [1, 2, 4]
    assert k_ladder(6) == [1, 2, 4, 6]
    assert k_ladder(8) == [1, 2, 4, 8]


def test_maj_at_k_by_hand():
    answers = ["3", "4", "4", "3", "3"]
    correct = [1, 0, 0, 1, 1]
    assert maj_at_k(answers, correct, 1) == 1.0  # "3"
    assert maj_at_k(answers, correct, 2) == 1.0  # "3" and "4" tie: the earliest, "3"
    assert maj_at_k(answers, correct, 3) == 0.0  # "4" twice
    assert maj_at_k(answers, correct, 4) == 1.0  # 2 - 2: "3" came first
    assert maj_at_k(answers, correct, 5) == 1.0
    # no answer casts no vote; none at all is wrong
    assert maj_at_k([None, "7", None], [0, 1, 0], 1) == 0.0
    assert maj_at_k([None, "7", None], [0, 1, 0], 3) == 1.0
    assert maj_at_k([None, None, "5", "6", "6"], [0, 0, 1, 0, 0], 5) == 0.0


def test_summaries_are_means_over_prompts_with_stderr():
    correct = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    s = pass_at_k_summary(correct)
    assert list(s) == ["1", "2", "4"]
    # pass@1 per prompt: 1/4, 2/4, 0 -> mean 0.25, sd 0.25, stderr 0.25/sqrt(3)
    assert s["1"]["mean"] == pytest.approx(0.25) and s["1"]["stderr"] == pytest.approx(0.25 / math.sqrt(3))
    # pass@2: 1 - C(3,2)/C(4,2) = 0.5, 1 - 1/6, 0
    assert s["2"]["mean"] == pytest.approx((0.5 + 5 / 6) / 3)
    assert s["4"]["mean"] == pytest.approx(2 / 3)
    m = maj_at_k_summary([["a", "b", "b", "b"], ["x", "x", "y", "y"], ["p", "q", "r", "s"]], correct)
    # maj@1: 1, 1, 0; maj@2: 1 ("a" first), 1, 0; maj@4: "b" wrong -> 0, "x" first of the 2-2 tie -> 1, 0
    assert [m[k]["mean"] for k in ("1", "2", "4")] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert at_k_summary([{1: 1.0}])["1"] == {"mean": 1.0, "stderr": None}


# ---------------------------------------------------------------------------------------------------------------
# The reward functions


def test_extract_answer_and_normalisation():
    assert V.extract_answer(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"  # the last, braces nested
    assert V.extract_answer("She sold 24.\n#### 1,234") == "1,234"
    assert V.extract_answer("Thus the final answer is $42$. Done") == "42"
    assert V.extract_answer("The answer is 0.5.") == "0.5"  # the decimal point stays, the full stop goes
    assert V.extract_answer("I think 7") is None
    assert V.extract_answer(r"\boxed{ }") is None
    assert V.normalize_answer("  The  Answer, ") == "the answer"
    assert V.normalize_answer("1,234,567.5") == "1234567.5"
    assert V.normalize_answer("(1, 234)") == "(1, 234)"  # a space after the comma: not a thousands separator
    assert V.normalize_answer("(1,2)") == "(1,2)"
    # a leading decimal point is part of the number (it was stripped as punctuation: ".5" read as 5)
    assert V.extract_answer("The answer is .5") == ".5" and V.normalize_answer(".5.") == ".5"
    assert V.extract_answer("The answer is 18 cookies.") == "18 cookies"  # the answer as written (exact_match's)
    # the last answer counts, on the same line too (the first one on a line was taken, with the rest of the line)
    assert V.extract_answer("The answer is 6. Wait, I made a mistake. The correct answer is 7.") == "7"
    assert V.extract_answer("To get the answer: add 3 and 4. So the answer is 7.") == "7"
    assert V.extract_answer("The answer is 7. No: the answer is 6.") == "6"
    assert V.extract_answer("#### 41 (wrong) #### 42") == "42"
    # ... that is followed by one: a trailing "the answer is" with nothing after it leaves the one before
    assert V.extract_answer("The answer is 42. That is the answer is") == "42"
    assert V.extract_answer("The answer is\n42") == "42" and V.extract_answer("so the answer is") is None
    assert V.extract_answer("#### 42\nThe answer is 41") == "42"  # GSM8K's marker before "answer is", as before
    # ... but a remark after the answer (a lower-case word that goes on) is not taken for it
    for remark in ["I double-checked the answer: it is correct.", "The answer is the total number of apples.",
                   "Let me double-check that the answer is consistent with step 2.",
                   "The answer is reasonable since 20 < 30.", "Note: the answer is in units of 10^3 meters"]:
        assert V.extract_answer(f"The answer is 20. {remark}") == "20", remark
    assert V.extract_answer("So the answer is 12 only if x = 3. It fails, so the answer is (C).") == "(C)"
    assert V.extract_answer("The answer is not 1984. The answer is Animal Farm.") == "Animal Farm"
    assert V.extract_answer("The answer is 1.4. Exactly, the answer is sqrt(2).") == "sqrt(2)"
    assert V.extract_answer("The answer is no. Wait, the answer is yes") == "yes"  # every one a word: the last


def test_math_equal_on_real_cases():
    pytest.importorskip("math_verify")
    responses = [
        r"Half of it: \boxed{\frac{1}{2}}",   # 1/2 vs 0.5
        "Adding up.\n#### 1,234",              # thousands separator, GSM8K style
        r"\boxed{\frac{\sqrt{2}}{2}}",         # sqrt(2)/2 in another form
        r"\boxed{3}",                           # wrong
        r"So the answer is $\frac{1}{2}$.",     # "answer is" form, in TeX
        "it is 0.5",                            # no final answer: wrong
        "#### 1233",                            # wrong number
    ]
    references = ["0.5", "1234", r"\sqrt{2}/2", "4", "0.5", "0.5", "Work... #### 1,234"]
    assert V.math_equal([""] * 7, responses, answer=references) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # GSM8K answers with a unit (math-verify read "18 cookies" inside \boxed{} as a product of letters), and a
    # leading decimal point both ways
    assert V.math_equal([""] * 7, ["The answer is 18 cookies.", "#### 18 eggs", "The answer is .5", "The answer is .5",
                                   "The answer is 18 apples.", "Answer: $1,000 dollars", "#### -3.5 points"],
                        answer=["#### 18", "18", "0.5", "5", "18", "1000", "-3.5"]) == [1.0] * 3 + [0.0] + [1.0] * 3
    # words that change the value, or join the number to more, keep the answer whole: not the bare number
    wrong = ["The answer is 1 million.", "The answer is 3 dozen.", "The answer is 2 pi.", "The answer is 5 squared.",
             "The answer is 5 or 6.", "The answer is 3 to 4 days", "The answer is 3 hours and 20 minutes."]
    assert V.math_equal([""] * 7, wrong, answer=["1", "3", "2", "5", "5", "3", "3"]) == [0.0] * 7
    # an answer hedging over candidates is wrong, though math-verify reads these as their last value; alternatives
    # read as a set compare as sets (a reference of several roots)
    hedged = ["The answer is 1 (or 2 or 3 or 42)", r"\boxed{41 \lor 42}", r"\boxed{41 \vee 42}",
              "The answer is 41 or 42."]
    assert V.math_equal([""] * 4, hedged, answer=["42"] * 4) == [0.0] * 4
    assert V.math_equal([""] * 3, [r"\boxed{x = 2 \text{ or } x = 3}", "The answer is 2 or 3.", r"\boxed{2 \lor 3}"],
                        answer=[r"x=2 \text{ or } x=3", "2, 3", "2, 3"]) == [1.0, 1.0, 0.0]
    # not a hedge: the reference itself, and a restatement whose every alternative is right; but a reference that
    # restates itself does not let a response list candidates
    assert V.math_equal([""] * 5, [r"The answer is \text{(A) or (C)}", "The answer is 0.5 (or 1/2).",
                                   "The answer is 42 (or 41).", "The answer is 1 (or 0.5)", r"\boxed{5 \lor 12}"],
                        answer=[r"\text{(A) or (C)}", "1/2", "42", r"\frac{1}{2} (or 0.5)", "12 (or 12.0)"]
                        ) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # the canonical answer a response votes for
    assert V.math_equal.extract_answer(responses[1]) == "1234"
    assert V.math_equal.extract_answer(responses[5]) is None
    # a plain number votes by its value, its unit left out as math_equal reads it: one vote, not four
    same = ["The answer is 42", "The answer is 42 apples.", "The answer is $42.00", "#### 42.0", "#### 42%"]
    assert {V.math_equal.extract_answer(r) for r in same} == {"42"}
    assert [V.math_equal.extract_answer(r) for r in ["#### 1,234.50", "#### .50", "#### 1 million"]] == [
        "1234.5", "0.5", "1 million"]
    assert V.math_equal.extract_answer("#### −5") == V.math_equal.extract_answer("#### -5.0") == "-5"
    long = ["#### 1267650600228229401496703205376", "#### 1267650600228229401496703205377"]  # beyond 28 digits
    assert [V.math_equal.extract_answer(r) for r in long] == [r[5:] for r in long]


def test_math_equal_works_off_the_main_thread():
    """math-verify's timeout is signal.alarm, which raises off the main thread: math_equal turns it off there."""
    pytest.importorskip("math_verify")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        values = pool.submit(V.math_equal, ["", ""], [r"\boxed{0.5}", r"\boxed{2}"], reference=["1/2", "3"]).result()
    assert values == [1.0, 0.0]


def test_math_equal_without_math_verify_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError("No module named 'math_verify'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(PipelineError, match=re.escape("pip install 'rlhf-pipeline[verify]'")):
        V.math_equal([""], [r"\boxed{1}"], reference=["1"])


def test_exact_match():
    responses = ["The answer is 1,234.", " YES ", r"\boxed{Paris}", "Paris is lovely", "#### 72"]
    references = ["1234", "yes.", "paris", "Paris", "Natalia sold 48/2 = 24 clips in May.\n#### 72"]
    assert V.exact_match([""] * 5, responses, reference=references) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert V.exact_match.extract_answer(" YES ") == "yes"  # the whole response when no final answer is found


def test_regex_match_and_a_bad_pattern():
    assert V.regex_match(["", "", ""], ["abc", "xyz", "ABC"], solution=["b+", "^a", "(?i)^abc$"]) == [1.0, 0.0, 1.0]
    with pytest.raises(PipelineError, match=r"response 1 of the batch \(prompt_id p2\): the reference 'a\(' is not"):
        V.regex_match(["", ""], ["a", "b"], answer=["a", "a("], prompt_id=["p1", "p2"])


def test_a_pattern_that_backtracks_without_end_is_stopped_and_named(monkeypatch):
    """``^(a|a)+$`` on 'aaa...!' backtracks exponentially (2^40 ways): the score stage would hang on one response."""
    monkeypatch.setattr(V, "REGEX_SECONDS", 0.2)
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"response 0 of the batch \(prompt_id p1\): the reference '\^\(a\|a\)\+\$' "
                                            r"took over 0.2 s to match a response of 41 characters"):
        V.regex_match([""], ["a" * 40 + "!"], answer=["^(a|a)+$"], prompt_id=["p1"])
    assert time.monotonic() - started < 10
    # the patterns that make re backtrack without end and that the regex module matches at once stay plain matches
    assert V.regex_match(["", ""], ["a" * 40 + "!", "a" * 40], answer=["^(a+)+$"] * 2) == [0.0, 1.0]


def test_boxed_format():
    responses = [r"\boxed{4}", r"\boxed{}", r"\boxed{1} or \boxed{2}", "4", r"\boxed{4", r"so \boxed{ \frac{1}{2} }."]
    assert V.boxed_format([""] * 6, responses) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_reference_column_lookup_order_and_missing():
    # "reference" (what --reference-column passes) comes before "answer"
    assert V.exact_match([""], ["a"], reference=["a"], answer=["b"]) == [1.0]
    assert V.exact_match([""], ["a"], ground_truth=["a"]) == [1.0]
    with pytest.raises(PipelineError, match="no column reference, answer, solution or ground_truth .*label"):
        V.exact_match([""], ["a"], label=["x"])
    with pytest.raises(PipelineError, match="no reference answer"):
        V.exact_match([""], ["a"], answer=[None], prompt_id=["p0"])


def test_verifiable_summary_only_for_0_1_reward_functions():
    from rlhf_pipeline.stages.eval import verifiable_summary
    from rlhf_pipeline.stages.score import RewardSource

    responses = [["#### 3", "#### 3"], ["#### 1", "#### 2"]]  # two prompts' samples, aligned with the rewards
    source = RewardSource("reward_fn", "rlhf_pipeline.rewards.verifiable:exact_match", "reward_fn")
    s = verifiable_summary(source, responses, [[0.0, 0.0], [1.0, 0.0]])
    assert s["pass_at_k"]["1"]["mean"] == pytest.approx(0.25) and s["pass_at_k"]["2"]["mean"] == pytest.approx(0.5)
    assert s["maj_at_k"]["1"]["mean"] == pytest.approx(0.5) and s["maj_at_k"]["2"]["mean"] == pytest.approx(0.5)
    assert verifiable_summary(source, responses, [[0.5, 1.0], [0.0, 0.0]]) == {}
    regex = RewardSource("reward_fn", "rlhf_pipeline.rewards.verifiable:regex_match", "reward_fn")
    assert set(verifiable_summary(regex, responses, [[1.0, 0.0], [0.0, 0.0]])) == {"pass_at_k"}


# ---------------------------------------------------------------------------------------------------------------
# Through the CLI

# A reward with an extract_answer of its own, for maj@k end to end: right when the response's first character is
# one of the reference's characters; a response votes for its first character.
FIRST_CHAR = '''
def first_char(prompts, responses, **columns):
    return [1.0 if r[:1] and r[:1] in ref else 0.0 for r, ref in zip(responses, columns["reference"])]


first_char.extract_answer = lambda response: response[:1] or None
'''

PROMPTS = ["Write a short review of the movie Blue Canyon.", "Describe the park in one sentence.",
           "What did you think of the lake?", "Give a one-sentence review of Night Train."]


def sample_args(policy, prompts, out, n=4):
    return ["--model", policy, "--prompts", prompts, "--output", out, "--n", n, "--max-new-tokens", 8,
            "--temperature", 1.0, "--seed", 3]


def test_eval_reports_pass_at_k_and_maj_at_k_computed_from_its_samples(tiny_policy, tmp_path, capsys):
    from datasets import load_from_disk

    # Regexes that some sampled responses match and some do not (a vowel, a space, anything, a digit).
    answers = ["[aeiou]", " ", ".", "[0-9]"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "gold": a} for p, a in zip(PROMPTS, answers)])
    fn = tmp_path / "first.py"
    fn.write_text(FIRST_CHAR)
    out = tmp_path / "eval"
    capsys.readouterr()
    assert run("eval", *sample_args(tiny_policy, prompts, out), "--reference-column", "gold",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:regex_match", "--reward-fn", f"{fn}:first_char") == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    samples = load_from_disk(str(out / "samples"))
    assert samples["gold"] == answers  # the prompts' column came through generate

    regex = results["scores"]["reward_fn_regex_match"]
    correct = [[1 if re.search(a, r) else 0 for r in rs] for a, rs in zip(samples["gold"], samples["responses"])]
    assert samples["rewards_reward_fn_regex_match"] == correct
    assert 0 < sum(map(sum, correct)) < 16  # some pass, some do not: the numbers below are not trivially 0 or 1
    assert list(regex["pass_at_k"]) == ["1", "2", "4"] and "maj_at_k" not in regex
    for k in (1, 2, 4):
        per_prompt = [1 - math.comb(4 - sum(c), k) / math.comb(4, k) for c in correct]
        assert regex["pass_at_k"][str(k)]["mean"] == pytest.approx(sum(per_prompt) / 4, abs=1e-12)
    mean1 = regex["pass_at_k"]["1"]["mean"]
    assert f"reward_fn_regex_match: mean reward {mean1:.4f}" in printed
    assert f"pass@1 {mean1:.3f}, pass@4 {regex['pass_at_k']['4']['mean']:.3f}" in printed

    first = results["scores"]["reward_fn_first_char"]
    right = [[1 if r[:1] and r[:1] in a else 0 for r in rs] for a, rs in zip(samples["gold"], samples["responses"])]
    assert samples["rewards_reward_fn_first_char"] == right
    for k in (1, 2, 4):
        majority = []
        for a, rs in zip(samples["gold"], samples["responses"]):
            votes = [r[:1] for r in rs[:k] if r[:1]]
            best = max(votes, key=lambda v: (votes.count(v), -votes.index(v))) if votes else None
            majority.append(1.0 if best is not None and best in a else 0.0)
        assert first["maj_at_k"][str(k)]["mean"] == pytest.approx(sum(majority) / 4, abs=1e-12)


def test_a_missing_reference_column_is_one_line_naming_the_dataset(tiny_policy, tmp_path, capsys, caplog):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": "x"} for p in PROMPTS[:2]])
    capsys.readouterr()
    assert run("eval", *sample_args(tiny_policy, prompts, tmp_path / "eval", n=2), "--reference-column", "gold",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:exact_match") == 1
    err = capsys.readouterr().err
    assert "p.jsonl: has no column 'gold' for --reference-column (its columns: prompt, answer)" in err
    assert not (tmp_path / "eval").exists()

    # rlhf score: the generations (which carry the prompts' columns) lack it
    gen = tmp_path / "gen"
    assert run("generate", *sample_args(tiny_policy, prompts, gen, n=2)) == 0
    capsys.readouterr()
    assert run("score", "--input", gen, "--output", tmp_path / "s1", "--reference-column", "gold",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:exact_match") == 1
    err = capsys.readouterr().err
    assert "has no column 'gold' for --reference-column" in err and "answer" in err
    assert err.count("\n") == 1, err

    # no --reference-column, and none of the columns a verifiable reward looks for: refused before anything is
    # sampled (eval) or scored, rather than after (a rerun with the option would then be another run's config)
    unlabelled = write_jsonl(tmp_path / "u.jsonl", [{"prompt": p, "label": "x"} for p in PROMPTS[:2]])
    assert run("eval", *sample_args(tiny_policy, unlabelled, tmp_path / "eval_u", n=2),
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:math_equal") == 1
    err = capsys.readouterr().err
    assert "u.jsonl: math_equal needs each prompt's ground truth, and the data has no column reference, answer, " \
           "solution or ground_truth (its columns: label, prompt); pass --reference-column NAME" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "eval_u").exists(), err
    gen_u = tmp_path / "gen_u"
    assert run("generate", *sample_args(tiny_policy, unlabelled, gen_u, n=2)) == 0
    capsys.readouterr()
    assert run("score", "--input", gen_u, "--output", tmp_path / "s_u",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:exact_match") == 1
    err = capsys.readouterr().err
    assert "gen_u: exact_match needs each prompt's ground truth" in err and "label" in err, err
    assert not (tmp_path / "s_u" / "manifest.json").exists()
    # with the column named, every response is wrong: scored, and said to teach nothing
    assert run("score", "--input", gen_u, "--output", tmp_path / "s_u", "--reference-column", "label",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:exact_match") == 0
    assert "exact_match gave every one of the 4 responses 0.0: no response is preferred" in caplog.text

    # a bad pattern in the reference column: one line, naming the rows and the prompt
    rows = [{"prompt": PROMPTS[0], "answer": "a"}, {"prompt": PROMPTS[1], "answer": "(unclosed"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    gen2 = tmp_path / "gen2"
    assert run("generate", *sample_args(tiny_policy, bad, gen2, n=2)) == 0
    capsys.readouterr()
    assert run("score", "--input", gen2, "--output", tmp_path / "s2", "--reference-column", "answer",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:regex_match") == 1
    err = capsys.readouterr().err
    assert "regex_match on rows 0..1" in err and "the reference '(unclosed' is not a regular expression" in err
    assert err.count("\n") == 1, err
    assert not (tmp_path / "s2" / "manifest.json").exists()


def test_score_passes_the_named_column_as_reference(tiny_policy, tmp_path):
    from datasets import load_from_disk

    # "answer" would be found by default; --reference-column gold must win over it
    rows = [{"prompt": p, "answer": "^$", "gold": "."} for p in PROMPTS[:2]]
    gen = tmp_path / "gen"
    assert run("generate", *sample_args(tiny_policy, write_jsonl(tmp_path / "p.jsonl", rows), gen, n=2)) == 0
    assert run("score", "--input", gen, "--output", tmp_path / "s", "--reference-column", "gold",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:regex_match") == 0
    scored = load_from_disk(str(tmp_path / "s"))
    assert scored["rewards"] == [[1.0 if r else 0.0 for r in rs] for rs in scored["responses"]]
    assert run("score", "--input", gen, "--output", tmp_path / "s_default",
               "--reward-fn", "rlhf_pipeline.rewards.verifiable:regex_match") == 0
    default = load_from_disk(str(tmp_path / "s_default"))
    assert default["rewards"] == [[0.0 if r else 1.0 for r in rs] for rs in default["responses"]]
    assert json.loads((Path(tmp_path / "s") / "manifest.json").read_text())["config"]["reference_column"] == "gold"


@pytest.mark.parametrize("body, raised", [("return 1 / 0", "ZeroDivisionError: division by zero"),
                                          ("import sys; sys.exit(2)", "SystemExit: 2")])
def test_an_extract_answer_that_raises_is_the_users_error_with_the_prompt_named(tmp_path, body, raised):
    """maj@k reads the answers through the function's own extract_answer: user code, so what it raises (sys.exit
    too, which ended rlhf eval without a word) is its traceback and one line naming the prompt."""
    from rlhf_pipeline.errors import UserCodeError
    from rlhf_pipeline.stages.eval import verifiable_summary
    from rlhf_pipeline.stages.score import RewardSource

    (tmp_path / "votes.py").write_text(
        "def reward(prompts, responses, **columns):\n    return [1.0] * len(responses)\n\n"
        f"def extract(response):\n    if response == 'bad':\n        {body}\n    return response\n\n"
        "reward.extract_answer = extract\n")
    spec = f"{tmp_path}/votes.py:reward"
    source = RewardSource("reward_fn", spec, "reward_fn")
    good = verifiable_summary(source, [["3", "3"], ["4", "5"]], [[1.0, 1.0], [0.0, 1.0]])
    assert good["maj_at_k"]["1"]["mean"] == 0.5
    with pytest.raises(UserCodeError) as error:
        verifiable_summary(source, [["3", "3"], ["4", "bad"]], [[1.0, 1.0], [0.0, 1.0]])
    assert str(error.value) == (f"the reward function {spec}: its extract_answer raised on the responses of prompt 1: "
                                f"{raised}")
