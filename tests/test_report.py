"""rlhf report: fake run directories in, plots and report.md out."""

import json
import sys
from pathlib import Path

import pytest

from rlhf_pipeline.stages.report import collect, fmt
from rlhf_pipeline.stages.report import cli as report_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ["reward_per_iteration.png", "loss.png", "logp_drift.png", "response_length.png"]


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def write_metrics(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def manifest(stage: str, wall: float) -> dict:
    return {"stage": stage, "wall_time_s": wall, "rows_in": 4, "rows_out": 4, "config": {}, "sampling": {}}


def results(mean: float, stderr: float, win_rate=None, wins=None, ties=None, losses=None,
            tokens=10.0, stop=0.5) -> dict:
    score = {"scorer": "reward_fn", "mean": mean, "stderr": stderr, "baseline_mean": None, "baseline_stderr": None,
             "win_rate": win_rate, "wins": wins, "ties": ties, "losses": losses}
    if win_rate is not None:
        score.update(baseline_mean=0.1, baseline_stderr=0.01)
    return {"model": "m", "baseline": "base" if win_rate is not None else None, "num_prompts": 8, "n": 2,
            "response_tokens_mean": tokens, "stop_fraction": stop, "scores": {"reward_fn": score}}


def train_metrics(steps: int, loss0: float) -> list[dict]:
    """Step-0 pre-training eval, then train lines 1..steps and a final eval at the last step."""
    records = [{"step": 0, "loss/eval": loss0, "reward/accuracy": 0.5,
                "logp/chosen_logratio": 0.0, "logp/rejected_logratio": 0.0}]
    for s in range(1, steps + 1):
        records.append({"step": s, "loss/train": loss0 - 0.01 * s, "reward/train_accuracy": 0.6,
                        "logp/train_chosen_logratio": 0.1 * s, "logp/train_rejected_logratio": -0.2 * s,
                        "grad_norm": 1.0, "lr": 1e-6})
    records.append({"step": steps, "loss/eval": loss0 - 0.05, "reward/accuracy": 0.75,
                    "logp/chosen_logratio": 0.05 * steps, "logp/rejected_logratio": -0.1 * steps})
    return records


def save_generations(path: Path, lengths: list[list[int]], reasons: list[list[str]]) -> None:
    from datasets import Dataset

    Dataset.from_dict({
        "prompt_id": list(range(len(lengths))),
        "response_token_ids": [[list(range(n)) for n in row] for row in lengths],
        "finish_reasons": reasons,
    }).save_to_disk(str(path))


@pytest.fixture
def full_run(tmp_path) -> Path:
    """iter_0 eval + two full iterations + sft/ and reward_model/ + summary.json."""
    run = tmp_path / "run"
    write_json(run / "iter_0" / "eval" / "results.json", results(0.123456, 0.0123456, tokens=12.0, stop=0.25))
    specs = {1: (10, 0.7, 0.3456, 0.02345, 0.625, 5, 0, 3), 2: (6, 0.69, 0.5678, 0.03456, 0.75, 6, 0, 2)}
    for t, (steps, loss0, mean, stderr, wr, w, ti, lo) in specs.items():
        it = run / f"iter_{t}"
        for k, stage in enumerate(["generate", "score", "filter", "train", "eval"]):
            write_json(it / stage / "manifest.json", manifest(stage, 10.0 * t + k + 0.5))
        write_metrics(it / "train" / "metrics.jsonl", train_metrics(steps, loss0))
        write_json(it / "eval" / "results.json", results(mean, stderr, wr, w, ti, lo, tokens=14.0 + t, stop=0.5))
    # iteration 1 samples 2 prompts x 2 responses: lengths 3, 5, 4, 8 -> mean 5; 3 of 4 stopped
    save_generations(run / "iter_1" / "generate", [[3, 5], [4, 8]], [["stop", "stop"], ["stop", "length"]])
    save_generations(run / "iter_2" / "generate", [[6, 6], [6, 6]], [["stop", "length"], ["length", "length"]])
    write_json(run / "sft" / "manifest.json", manifest("sft", 42.0))
    write_metrics(run / "sft" / "metrics.jsonl", [{"step": 0, "loss/eval": 3.0}, {"step": 1, "loss/train": 2.9},
                                                  {"step": 2, "loss/train": 2.5}, {"step": 2, "loss/eval": 2.4321}])
    write_json(run / "reward_model" / "manifest.json", manifest("train-rm", 17.0))
    write_metrics(run / "reward_model" / "metrics.jsonl", [
        {"step": 0, "loss/eval": 0.69, "reward/accuracy": 0.5},
        {"step": 4, "loss/train": 0.6, "reward/train_accuracy": 0.7},
        {"step": 4, "loss/eval": 0.5555, "reward/accuracy": 0.8125},
    ])
    write_json(run / "summary.json", {"demo": "ok"})
    return run


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0.01  # not a blank canvas


def test_full_run(full_run, capsys):
    assert report_cli([str(full_run)]) == 0
    for name in PLOTS:
        assert_png(full_run / "plots" / name)
    md = (full_run / "report.md").read_text()
    assert f"`{full_run}`" in md.splitlines()[0]
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "0.1235 ± 0.01235" in rows["0"]
    assert "0.3456 ± 0.02345" in rows["1"] and "0.625 (5/0/3)" in rows["1"]
    assert "0.5678 ± 0.03456" in rows["2"] and "0.75 (6/0/2)" in rows["2"]
    # train loss first -> last, final eval loss and accuracy of iteration 1
    assert "0.69 → 0.6" in rows["1"] and "| 0.65 |" in rows["1"] and "| 0.75 |" in rows["1"]
    # generate: mean tokens 5, 3/4 stopped; eval: 15 tokens, 0.5 stopped
    assert "| 5 | 0.75 | 15 | 0.5 |" in rows["1"]
    assert "| 6 | 0.25 | 16 | 0.5 |" in rows["2"]
    assert "10.5 / 11.5 / 12.5 / 13.5 / 14.5" in rows["1"]
    cells = [c.strip() for c in rows["0"].split("|")[1:-1]]
    assert cells[2:8] == ["–"] * 6  # iteration 0: no win rate, training or generate data
    assert cells[8:10] == ["12", "0.25"]
    assert "8 prompts × 2 samples; baseline `base` (iterations 1, 2)" in md
    assert "- Scorers: reward_fn = `reward_fn`." in md  # what each column's scorer is (the demo's: gold_reward)
    assert "final eval loss 2.432" in md and "wall time 42 s" in md
    assert "final eval accuracy 0.8125" in md and "last train accuracy 0.7" in md
    for name in PLOTS:
        assert f"(plots/{name})" in md and "Not drawn" not in md
    assert '"demo": "ok"' in md
    assert "wrote" in capsys.readouterr().out


def test_collect_offsets_and_stats(full_run):
    data = collect(full_run)
    its = {it["iteration"]: it for it in data["iterations"]}
    assert sorted(its) == [0, 1, 2]
    assert [its[t]["max_step"] for t in (0, 1, 2)] == [0, 10, 6]
    assert [its[t]["step_offset"] for t in (0, 1, 2)] == [0, 0, 10]
    assert its[1]["generate"] == {"num_prompts": 2, "num_responses": 4, "response_tokens_mean": 5.0,
                                  "stop_fraction": 0.75}
    assert its[2]["generate"]["stop_fraction"] == 0.25
    assert its[0]["generate"] is None and its[0]["metrics"] == []
    assert its[2]["manifests"]["train"]["wall_time_s"] == 23.5
    assert data["sft"]["metrics"][-1]["loss/eval"] == 2.4321
    assert data["reward_model"]["manifest"]["stage"] == "train-rm"


@pytest.mark.parametrize("overlap", [0, 1])
def test_each_iterations_samples_are_placed_at_the_policy_that_sampled_them(tmp_path, overlap, monkeypatch):
    """An overlapped run's iteration t samples with policy t-2 (policy 0 for t <= 2): the report said t-1 for every
    run, in its text and in the response-length plot's positions. A resumed run's wall time is marked."""
    from rlhf_pipeline.stages.report import _length_points, _markdown

    run = tmp_path / "run"
    for t in (1, 2, 3):
        sampler = max(t - 1 - overlap, 0)
        model = str(run / f"iter_{sampler}" / "train") if sampler else "/models/sft"
        write_json(run / f"iter_{t}" / "generate" / "manifest.json",
                   {**manifest("generate", 1.0), "config": {"model": model}})
        save_generations(run / f"iter_{t}" / "generate", [[t, t]], [["stop", "stop"]])
        train = {**manifest("train", 9.5), "training": {"resumed_from_step": 4 if t == 2 else 0}}
        write_json(run / f"iter_{t}" / "train" / "manifest.json", train)
        write_json(run / f"iter_{t}" / "eval" / "manifest.json",  # an evaluation that continued an unfinished one
                   {**manifest("eval", 2.0), **({"resumed": True} if t == 3 else {})})
    data = collect(run)
    expected = [0, 1, 2] if overlap == 0 else [0, 0, 1]
    assert [it["sampler"] for it in data["iterations"]] == expected
    monkeypatch.chdir(run)
    assert [it["sampler"] for it in collect(Path("."))["iterations"]] == expected  # rlhf report .
    moved = run.rename(tmp_path / "moved")
    assert [it["sampler"] for it in collect(moved)["iterations"]] == expected
    run = moved
    assert _length_points(data["iterations"])["gen_tokens"] == [(s, t) for s, t in zip(expected, (1.0, 2.0, 3.0))]
    text = _markdown(data, [])
    if overlap:
        assert ("generate sampled from the policy its manifest names (iteration 1: policy 0, iteration 2: policy 0, "
                "iteration 3: policy 1)") in text
    else:
        assert "generate sampled from policy t−1," in text
    walls = [line.split("|")[-2].strip() for line in text.splitlines() if line.startswith("| ") and "wall" not in line]
    assert [w.split(" / ")[3:] for w in walls] == [["9.5", "2"], ["9.5+", "2"], ["9.5", "2+"]]


def test_a_starting_policy_from_another_run_is_placed_at_policy_0(tmp_path):
    """An overlapped run that starts from another run's iter_1/train samples iteration 2 with it: policy 0, as
    iterate.json names the start, not policy 1 of this run."""
    start = str(tmp_path / "older" / "iter_1" / "train")
    run = tmp_path / "run"
    write_json(run / "iterate.json", {"model": start, "overlap": 1})
    for t in (1, 2, 3):
        model = start if t <= 2 else str(run / "iter_1" / "train")
        write_json(run / f"iter_{t}" / "generate" / "manifest.json",
                   {**manifest("generate", 1.0), "config": {"model": model}})
        write_json(run / f"iter_{t}" / "train" / "manifest.json",
                   {**manifest("train", 9.5), "training": {"sampler": {"model": model, "is_trained_policy": False}}})
    assert [it["sampler"] for it in collect(run)["iterations"]] == [0, 0, 1]


def test_collect_offsets_skip_untrained_iterations(tmp_path):
    run = tmp_path / "run"
    write_metrics(run / "iter_1" / "train" / "metrics.jsonl",
                  [{"step": 0, "loss/eval": 1.0}, {"step": 7, "loss/train": 1.0}])
    (run / "iter_2" / "generate").mkdir(parents=True)  # an iteration in progress: no data yet
    write_metrics(run / "iter_3" / "train" / "metrics.jsonl", [{"step": 3, "loss/train": 1.0}])
    write_metrics(run / "iter_10" / "train" / "metrics.jsonl", [{"step": 2, "loss/train": 1.0}])
    data = collect(run)
    assert [(it["iteration"], it["step_offset"], it["max_step"]) for it in data["iterations"]] == [
        (1, 0, 7), (2, 7, 0), (3, 7, 3), (10, 10, 2)]


def test_partial_run(tmp_path):
    run = tmp_path / "run"
    write_json(run / "iter_0" / "eval" / "results.json", results(0.2, 0.01))
    write_metrics(run / "iter_1" / "train" / "metrics.jsonl",
                  [{"step": 0, "loss/eval": 1.5}, {"step": 1, "loss/train": 1.4}, {"step": 2, "loss/train": 1.2}])
    assert report_cli([str(run)]) == 0
    for name in ["reward_per_iteration.png", "loss.png", "response_length.png"]:
        assert_png(run / "plots" / name)
    assert not (run / "plots" / "logp_drift.png").exists()
    md = (run / "report.md").read_text()
    assert "0.2 ± 0.01" in md and "1.4 → 1.2" in md
    assert "*Not drawn (plots/logp_drift.png): no logp/*_logratio" in md
    assert "(plots/logp_drift.png)" not in md.replace("Not drawn (plots/logp_drift.png)", "")
    assert "## SFT and reward model" not in md


def test_no_eval_mentions_missing_reward_plot_and_removes_stale_one(tmp_path):
    run = tmp_path / "run"
    write_metrics(run / "iter_1" / "train" / "metrics.jsonl", [{"step": 1, "loss/train": 1.4}])
    (run / "plots").mkdir(parents=True)
    (run / "plots" / "reward_per_iteration.png").write_bytes(PNG_SIGNATURE)  # from an older report
    out = tmp_path / "elsewhere"
    assert report_cli(["--run-dir", str(run), "--output", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Not drawn (plots/reward_per_iteration.png): no iter_<t>/eval/results.json" in md
    assert "Not drawn (plots/response_length.png)" in md
    assert_png(out / "plots" / "loss.png")
    assert not (out / "report.md.tmp").exists() and not list(out.glob(".*tmp*"))
    assert (run / "plots" / "reward_per_iteration.png").exists()  # --output elsewhere: the run dir is untouched
    assert report_cli([str(run)]) == 0
    assert not (run / "plots" / "reward_per_iteration.png").exists()


def test_positional_run_dir_with_options(full_run, tmp_path):
    out = tmp_path / "out"
    assert report_cli([str(full_run), "--output", str(out)]) == 0
    assert (out / "report.md").is_file() and (out / "plots" / "loss.png").is_file()
    assert not (full_run / "report.md").exists()


def test_empty_directory_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "iter_1").mkdir(parents=True)
    assert report_cli([str(empty)]) == 1
    err = capsys.readouterr().err
    assert str(empty) in err and "no run data" in err
    assert not (empty / "report.md").exists()


def test_missing_directory_is_an_error(tmp_path, capsys):
    assert report_cli([str(tmp_path / "nope")]) == 1
    assert str(tmp_path / "nope") in capsys.readouterr().err


def test_bad_json_names_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "iter_0" / "eval").mkdir(parents=True)
    (run / "iter_0" / "eval" / "results.json").write_text("{not json")
    assert report_cli([str(run)]) == 1
    assert str(run / "iter_0" / "eval" / "results.json") in capsys.readouterr().err


def test_cut_off_last_metrics_line_is_skipped(tmp_path):
    run = tmp_path / "run"
    path = run / "iter_1" / "train" / "metrics.jsonl"
    write_metrics(path, [{"step": 1, "loss/train": 1.0}, {"step": 2, "loss/train": 0.9}])
    path.write_text(path.read_text() + '{"step": 3, "loss/tr')
    assert collect(run)["iterations"][0]["max_step"] == 2


def test_missing_matplotlib_is_an_error(full_run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report_cli([str(full_run)]) == 1
    assert "rlhf-pipeline[report]" in capsys.readouterr().err


def test_fmt():
    assert fmt(None) == "–"
    assert fmt(3) == "3"
    assert fmt(0.123456) == "0.1235"
    assert fmt(1234.5678) == "1235"
    assert fmt(123456.7) == "123457"
    assert fmt(1.5e-6) == "1.5e-06"


def test_length_controlled_reference_judge_and_pass_at_k(full_run, capsys):
    """A run whose evaluations have LC win rates, reference answers, an LLM judge and pass@k: the table shows each
    beside the raw figure, and the judge/pass@k plot is drawn (a run without them leaves it out)."""
    assert report_cli([str(full_run)]) == 0
    assert "judge_and_pass_at_k" not in (full_run / "report.md").read_text()
    assert "| reward_fn reward (mean ± stderr) |" in (full_run / "report.md").read_text()  # no gain in these evals
    for t in (0, 1, 2):
        path = full_run / f"iter_{t}" / "eval" / "results.json"
        r = json.loads(path.read_text())
        s = r["scores"]["reward_fn"]
        if t:
            s.update(lc_win_rate=0.5 + 0.05 * t, lc_stderr=0.02, win_rate_stderr=0.05, gain=0.25, gain_stderr=0.015)
        s["reference"] = {"mean": 0.2, "stderr": 0.01, "win_rate": 0.3 + 0.1 * t, "wins": 1, "ties": 0, "losses": 1,
                          "lc_win_rate": 0.25 + 0.1 * t, "lc_stderr": 0.03}
        s["pass_at_k"] = {"1": {"mean": 0.1 * t, "stderr": 0.01}, "2": {"mean": 0.15 * t, "stderr": 0.02}}
        s["maj_at_k"] = {"2": {"mean": 0.12 * t, "stderr": 0.02}}
        r["judge"] = {"model": "judge-m", "reference": {"win_rate": 0.4 + 0.1 * t, "win_rate_stderr": 0.06,
                                                        "lc_win_rate": 0.35 + 0.1 * t, "lc_stderr": 0.04,
                                                        "consistency": 0.75}}
        path.write_text(json.dumps(r))
    assert report_cli([str(full_run)]) == 0
    assert_png(full_run / "plots" / "judge_and_pass_at_k.png")
    md = (full_run / "report.md").read_text()
    assert "(plots/judge_and_pass_at_k.png)" in md
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    header = [c.strip() for c in rows["iter"].split("|")[1:-1]]
    cells = dict(zip(header, [c.strip() for c in rows["2"].split("|")[1:-1]]))
    assert cells["reward_fn win rate ± stderr (W/T/L), LC"] == "0.75 ± 0.05 (6/0/2), LC 0.6 ± 0.02"
    reward = cells["reward_fn reward (mean ± stderr; gain over the baseline ± paired stderr)"]
    assert reward == "0.5678 ± 0.03456; gain +0.25 ± 0.015"
    assert cells["reward_fn win rate vs references, LC"] == "0.5, LC 0.45 ± 0.03"  # an eval that has no stderr
    assert cells["judge vs reference: win rate, LC (consistency)"] == "0.6 ± 0.06, LC 0.55 ± 0.04 (0.75)"
    # the verdicts a judge could not read, and a judge that read none (no win rate: said so, not "not in the run")
    from rlhf_pipeline.stages.report import _judge_cell

    assert _judge_cell({"win_rate": 0.5, "consistency": 1.0, "unreadable": 3, "verdicts": 8, "left_out": 2}) == (
        "0.5 (1); 3 of 8 verdicts unreadable, 2 left out")
    assert _judge_cell({"win_rate": None, "unreadable": 8, "verdicts": 8, "left_out": 4}) == (
        "no verdict read (8 of 8 verdicts unreadable, 4 left out)")
    assert cells["reward_fn pass@k, maj@k (1 and n) ± stderr"] == (
        "pass@1 0.2 ± 0.01, pass@2 0.3 ± 0.02, maj@2 0.24 ± 0.02")


def test_a_reward_models_win_rates_plot_the_preferences_its_length_control_is_fitted_on():
    """A reward model's length-controlled win rate is fitted on Bradley-Terry preferences, not on the counted wins:
    the plot draws their mean beside the two, so a gap between counted and length-controlled is not all length's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlhf_pipeline.stages.report import _plot_win_rates

    model = {"win_rate": 1.0, "lc_win_rate": 0.731, "lc_stderr": 0.01,
             "length_controlled": {"preferences": "bradley-terry", "raw_win_rate": 0.731, "length_coef": 0.0}}
    function = {"win_rate": 1.0, "lc_win_rate": 1.0, "lc_stderr": 0.0,
                "length_controlled": {"preferences": "outcome", "raw_win_rate": 1.0, "length_coef": 0.0}}
    for scores, expected in [(model, [1.0, 0.731]), (function, [])]:
        fig, ax = plt.subplots()
        assert _plot_win_rates(ax, [(1, scores, "baseline"), (2, scores, "baseline")])
        dotted = [line for line in ax.get_lines() if "mean preference" in str(line.get_label())]
        assert [list(line.get_ydata()) for line in dotted] == ([[0.731, 0.731]] if expected else [])
        plt.close(fig)
