"""The benchmark harness: timing and ratios, growth exponents, the written results, target checking, and the
trainer benchmark's data and padding arithmetic (the TRL side runs only where the `bench` extra is installed)."""

import json
import math

import pytest

from rlhf_pipeline.bench import common, run
from rlhf_pipeline.bench import trainer as bench_trainer
from rlhf_pipeline.bench.common import Entry, alternate, growth_exponent, write_results
from rlhf_pipeline.errors import PipelineError


class FakeClock:
    """``time.perf_counter`` that only moves when a benchmarked function says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def test_alternate_reports_medians_and_the_peer_over_ours_ratio(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", clock)
    ours_costs, peer_costs = iter([9.0, 1.0, 2.0, 10.0]), iter([9.0, 7.0, 5.0, 6.0])
    calls = []

    def ours():
        calls.append("ours")
        clock.spend(next(ours_costs))
        return "ours result"

    def peer():
        calls.append("peer")
        clock.spend(next(peer_costs))
        return "peer result"

    result = alternate(ours, peer, rounds=3)
    # A warm-up call of each (untimed: 9 s each), then the order swaps every round.
    assert calls == ["ours", "peer", "ours", "peer", "peer", "ours", "ours", "peer"]
    assert result["ours_seconds"] == [1.0, 2.0, 10.0] and result["peer_seconds"] == [7.0, 5.0, 6.0]
    assert result["ours_median"] == 2.0 and result["peer_median"] == 6.0
    assert result["ratio"] == pytest.approx(3.0)
    assert result["ours_value"] == "ours result" and result["peer_value"] == "peer result"


def test_alternate_without_warmup_times_every_call(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", clock)
    result = alternate(lambda: clock.spend(2.0), lambda: clock.spend(1.0), rounds=1, warmup=False)
    assert result["ours_seconds"] == [2.0] and result["peer_seconds"] == [1.0]
    assert result["ratio"] == pytest.approx(0.5)  # the peer was faster: a ratio below 1


def test_alternate_times_a_bound_in_the_same_rounds_as_both_sides(monkeypatch):
    """``also``: more callables timed within the same rounds, the order rotating, so that a bound on ours (the score
    entry's forwards alone) is measured beside it rather than after it."""
    clock = FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", clock)
    calls = []

    def side(name, cost):
        def run():
            calls.append(name)
            clock.spend(cost)
            return name
        return run

    result = alternate(side("ours", 2.0), side("peer", 6.0), rounds=3, also={"bound": side("bound", 1.5)})
    assert calls == ["ours", "peer", "bound",  # the warm-up
                     "ours", "peer", "bound", "peer", "bound", "ours", "bound", "ours", "peer"]
    assert result["bound_seconds"] == [1.5] * 3 and result["bound_median"] == 1.5 and result["bound_value"] == "bound"
    assert result["ratio"] == pytest.approx(3.0)


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_growth_exponent_recovers_a_power_law(power):
    sizes = [250, 1000, 4000]
    assert growth_exponent(sizes, [0.3 * s**power for s in sizes]) == pytest.approx(power)


def test_growth_exponent_of_a_fixed_cost_plus_linear_work_is_below_one():
    sizes = [100, 200, 400]
    assert 0 < growth_exponent(sizes, [5.0 + 0.01 * s for s in sizes]) < 1


def entries():
    return [
        Entry("fast_thing", 2.0, 8.0, "s", 4.0, 3.0, "Ours: x. Peer: y.", {"rounds": 1}),
        Entry("slow_thing", 1.0, 1.5, "s", 1.5, 2.0, "missed on purpose"),
        Entry("context_only", 0.5, 0.25, "fraction", 0.5, None, "no target"),
    ]


def test_write_results_writes_the_json_contract_and_a_table(tmp_path):
    write_results(tmp_path, entries(), {"mode": "quick"}, [{"title": "Stage time", "markdown": "| a | b |"}])
    payload = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [p["name"] for p in payload] == ["fast_thing", "slow_thing", "context_only"]
    for p in payload:
        assert {"name", "ours", "peer", "unit", "ratio", "target", "notes"} <= set(p)
    assert payload[0]["ratio"] == 4.0 and payload[2]["target"] is None and payload[0]["details"] == {"rounds": 1}
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "- mode: quick" in md
    assert "| `fast_thing` | 2 | 8 | s | 4.00 | ≥ 3 | — | yes |" in md
    assert "| `slow_thing` | 1 | 1.5 | s | 1.50 | ≥ 2 | — | **no** |" in md
    assert "| `context_only` | 0.5 | 0.25 | fraction | 0.50 | — | — | — |" in md
    assert "## Stage time" in md and "| a | b |" in md


def test_an_entry_with_a_ceiling_is_judged_on_the_fraction_of_it_it_reaches(tmp_path):
    """The score entry's case: a ratio target above this machine's ceiling (5 > 4) is reported, not judged; the
    fraction of the ceiling is (3.2 / 4 = 0.8 against 0.77: met; 2.9 / 4 = 0.725: missed). A reachable ratio target
    is still judged beside the fraction."""
    def entry(ratio, ceiling, target=5.0):
        return Entry("score", ours=1.0, peer=ratio, unit="s", ratio=ratio, target=target, notes="",
                     ceiling=ceiling, ceiling_target=0.77)

    met, missed = entry(3.2, 4.0), entry(2.9, 4.0)
    assert not met.target_reachable and met.ceiling_fraction == pytest.approx(0.8) and met.met is True
    assert missed.ceiling_fraction == pytest.approx(0.725) and missed.met is False
    assert met.status().startswith("ok:") and "(above this machine's ceiling)" in met.status()
    assert missed.status().startswith("MISSED:") and "0.72 of ceiling 4.00 vs 0.77" in missed.status()
    # a ratio target within reach (a GPU's ceiling is far above 5) is judged, and the fraction only reported
    assert entry(3.2, 4.0, target=3.5).met is False and entry(3.6, 4.0, target=3.5).met is True
    gpu = entry(6.0, 30.0)  # fraction 0.2: templating and I/O dominate once the forwards are cheap
    assert gpu.target_reachable and gpu.met is True and "vs 0.77" not in gpu.status()
    assert Entry("x", 1, 2, "s", 2.0, None, "", ceiling=None, ceiling_target=0.77).status() == "—"
    write_results(tmp_path, [met, missed], {}, [])
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| `score` | 1 | 3.2 | s | 3.20 | ≥ 5 (not judged here) | 0.80 of 4.00 (≥ 0.77) | yes |" in md
    assert "| `score` | 1 | 2.9 | s | 2.90 | ≥ 5 (not judged here) | 0.72 of 4.00 (≥ 0.77) | **no** |" in md
    assert json.loads((tmp_path / "benchmarks.json").read_text())[0]["ceiling"] == 4.0


def test_bench_names_the_missed_targets_after_writing_everything(tmp_path, monkeypatch):
    from rlhf_pipeline.bench import stages

    monkeypatch.setattr(stages, "run", lambda config, workdir: (entries(), []))
    config = run.BenchConfig(output=str(tmp_path / "out"), quick=True, only="stages")
    with pytest.raises(PipelineError, match="targets missed: slow_thing"):
        run.main(config)
    assert len(json.loads((tmp_path / "out" / "benchmarks.json").read_text())) == 3
    assert not (tmp_path / "out" / "scratch").exists()  # removed unless --keep-scratch


def test_bench_options_are_checked():
    with pytest.raises(ValueError, match="--only must be one of trainer, lora, stages"):
        run.BenchConfig(output="x", only="score")
    with pytest.raises(ValueError, match="--rounds"):
        run.BenchConfig(output="x", rounds=0)
    assert run.BenchConfig(output="x", quick=True).num_rounds == 2
    assert run.BenchConfig(output="x").num_rounds == 3


def test_trainer_bench_pairs_have_the_promised_length_spread(tmp_path):
    from datasets import load_from_disk

    real = bench_trainer.make_pairs(tmp_path / "pairs", 64, eos_id=2, seed=0)
    ds = load_from_disk(str(tmp_path / "pairs"))["train"]
    prompts, chosen, rejected = ds["prompt_token_ids"], ds["chosen_token_ids"], ds["rejected_token_ids"]
    assert all(16 <= len(p) <= 256 for p in prompts)
    assert all(16 <= len(r) <= 512 and r[-1] == 2 for r in list(chosen) + list(rejected))
    assert max(len(p) for p in prompts) > 200 and min(len(p) for p in prompts) < 40  # a spread, not one length
    assert real == sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(prompts, chosen, rejected))
    assert all(16 <= t < bench_trainer.VOCAB for p in prompts for t in p)


def test_large_vocab_bench_pairs_have_long_responses_over_the_whole_vocabulary(tmp_path):
    from datasets import load_from_disk

    t = bench_trainer
    real = t.make_pairs(tmp_path / "pairs", 6, eos_id=2, seed=0, vocab=t.LARGE_VOCAB, prompt_lengths=t.LARGE_PROMPTS,
                        response_lengths=t.LARGE_RESPONSES)
    ds = load_from_disk(str(tmp_path / "pairs"))["train"]
    responses = list(ds["chosen_token_ids"]) + list(ds["rejected_token_ids"])
    assert t.LARGE_RESPONSES == (768, 1024) and t.LARGE_VOCAB == 128_256
    assert all(768 <= len(r) <= 1024 and r[-1] == 2 for r in responses)
    assert all(16 <= len(p) <= 128 for p in ds["prompt_token_ids"])
    ids = [i for r in responses for i in r[:-1]]
    assert min(ids) >= 16 and max(ids) < t.LARGE_VOCAB and max(ids) > 120_000  # the whole 128k range is used
    assert real == sum(2 * len(p) + len(c) + len(r) for p, c, r in
                       zip(ds["prompt_token_ids"], ds["chosen_token_ids"], ds["rejected_token_ids"]))


def test_the_full_logits_dpo_loss_is_the_formula(tiny_policy):
    """The reference behind memory_peak_vs_trl_large_vocab's exact check: one pair, by hand from full logits."""
    import torch
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float64).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float64).eval()
    with torch.no_grad():
        reference.lm_head.weight.mul_(1.5)
        row = {"prompt_token_ids": [5, 6, 7], "chosen_token_ids": [8, 9], "rejected_token_ids": [10]}

        def logp(model, ids, first):  # sum of log p(ids[t] | ids[:t]) for t >= first
            lp = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
            return sum(float(lp[t - 1, ids[t]]) for t in range(first, len(ids)))

        chosen, rejected = [5, 6, 7, 8, 9], [5, 6, 7, 10]
        margin = (logp(policy, chosen, 3) - logp(policy, rejected, 3)) - (
            logp(reference, chosen, 3) - logp(reference, rejected, 3))
        expected = math.log1p(math.exp(-0.1 * margin))  # -log sigmoid(beta * margin)
        got = bench_trainer.full_logits_dpo_loss(policy, reference, [row], beta=0.1)
    assert abs(margin) > 1e-3  # a reference that differs: not the trivial log 2
    assert got == pytest.approx(expected, abs=1e-12)


def test_rebel_fixed_padding_fraction_is_real_tokens_over_the_fixed_grid(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"prompt_token_ids": [[5] * 100, [5] * 24], "chosen_token_ids": [[6] * 300, [6] * 48],
            "rejected_token_ids": [[7] * 20, [7] * 40]}
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "pairs"))
    real = (2 * 100 + 300 + 20) + (2 * 24 + 48 + 40)
    expected = real / (2 * 2 * (1024 + 2048))
    assert bench_trainer.rebel_fixed_padding_fraction(tmp_path / "pairs") == pytest.approx(expected)
    assert math.isclose(expected, 656 / 12288)


def test_our_dpo_loss_equals_trls_on_a_fixed_batch(tmp_path):
    """The check behind trainer_vs_trl_precomputed, at the benchmark's model size; needs the bench extra."""
    pytest.importorskip("trl")
    model, data = tmp_path / "model", tmp_path / "pairs"
    bench_trainer.make_model(model)
    bench_trainer.make_pairs(data, 4, eos_id=2, seed=1)
    check = bench_trainer.loss_agreement(model, data, rows=4)
    assert check["abs_diff"] <= 1e-5
    assert abs(check["ours"] - math.log(2)) > 1e-3  # a perturbed reference: not the trivial step-0 loss


def test_the_gpu_score_script_runs_end_to_end_on_a_cpu(tmp_path):
    """scripts/bench_score_gpu.py at toy size on a CPU: both sides run, agree, and the report is written."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_score_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_score_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "score.json"
    assert script.main(["--device", "cpu", "--sizes", "tiny", "--prompts", "4", "--n", "3", "--rounds", "1",
                        "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["size"] == "tiny" and row["sequences"] == 12 and row["scorer_mode"] == "last_token"
    assert row["ratio"] > 0 and row["max_relative_reward_difference"] <= 1e-4
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--sizes", "huge"])


def _gpu_bench_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_gpu_trainer_scripts_flops_full_lora_and_reference_by_hand():
    """scripts/bench_gpu.py's model FLOPs: two sequences of 3 and 4 tokens (Σ T = 7, Σ T² = 25), N = 1,000, 2 layers
    of hidden 8, 10 adapter parameters; and the adapters' count on a tiny Llama, worked out layer by layer."""
    pytest.importorskip("peft")
    from transformers import LlamaConfig

    script = _gpu_bench_script()
    attention_train, attention_ref = 12 * 2 * 8 * 25, 4 * 2 * 8 * 25  # 4,800 and 1,600
    assert script.flops(7, 25, 1000, 2, 8, train=True) == 6 * 1000 * 7 + attention_train == 46_800
    # LoRA: forward 2N + input gradients 2N, no weight gradients of the frozen N; 6 per adapter parameter
    assert script.flops(7, 25, 1000, 2, 8, train=True, lora_params=10) == (4000 + 60) * 7 + attention_train == 33_220
    assert script.flops(7, 25, 1000, 2, 8, train=False) == 2 * 1000 * 7 + attention_ref == 15_600
    assert script.flops(7, 25, 1000, 2, 8, train=False, lora_params=10) == 15_600  # the reference: the base model's

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=176, vocab_size=512, tie_word_embeddings=False)
    # rank 4 on q 64->64, k 64->32, v 64->32, o 64->64, gate/up 64->176, down 176->64 of each layer; no LM head
    per_layer = 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 3 * (64 + 176))
    assert script.lora_param_count(config, 4) == 2 * per_layer == 9_344


def test_the_gpu_trainer_scripts_mfu_step_by_step_by_hand():
    """Each timed step's MFU is its own FLOPs over its own seconds (step_mfu), and the window's figure is their
    FLOPs-weighted whole: one warmup step (not timed), then a step of the two sequences of 3 and 4 tokens (46,800
    FLOPs, as above) in 1 s and a step of twice those sequences in 4 s, at a peak of 93,600 FLOP/s."""
    script = _gpu_bench_script()
    spec = {"flops_params": 1000, "model": {"num_hidden_layers": 2, "hidden_size": 8}, "warmup": 1,
            "modes": {"full": {"lora_params": 0, "lora_rank": 0, "lora_alpha": None}}}
    one, two = {"real": 7, "sq": 25, "positions": 7}, {"real": 14, "sq": 50, "positions": 14}
    raw = {"side": "ours", "mode": "full", "trainable_params": 1000, "t0": 0.0, "seconds_setup": 0.5,
           "seconds_ref": 0.5, "step_stats": [one, one, two], "step_ends": [3.0, 4.0, 8.0], "peak_rss_bytes": 0,
           "first_loss": 0.69, "first_grad_norm": 1.0}
    out = script.summarise(raw, spec, 93_600.0)
    assert out["step_seconds"] == [1.0, 4.0]
    assert out["step_mfu"] == [0.5, 0.25]  # 46,800 / 1 / 93,600 and 93,600 / 4 / 93,600
    assert out["mfu_steps"] == pytest.approx((46_800 + 93_600) / 5 / 93_600)  # 0.3: the steps' whole, not a mean
    assert script.summarise(raw, spec, None)["step_mfu"] is None  # no peak known (a CPU): no MFU at all


def test_the_gpu_trainer_scripts_sides_may_carry_their_own_budget():
    """``--sides``: our sides with ``@TOKENS`` (their own micro-batch budget; 0 = by pair count), nothing else."""
    script = _gpu_bench_script()
    assert script.parse_side("ours_compile@16384") == ("ours_compile", 16384)
    assert script.parse_side("ours@0") == ("ours", 0)
    assert script.parse_side("trl_precomputed") == ("trl_precomputed", None)
    for bad in ("trl@8192", "ours@", "ours@-1", "ours@8k", "mine"):
        with pytest.raises(ValueError, match="our sides optionally with @TOKENS"):
            script.parse_side(bad)
    with pytest.raises(SystemExit, match="--profile-sides trl: name our sides that run"):
        script.main(["--device", "cpu", "--tiny", "--sides", "ours,trl", "--profile", "--profile-sides", "trl"])
    with pytest.raises(SystemExit, match="--profile-sides and --profile-trace go with --profile"):
        script.main(["--device", "cpu", "--tiny", "--sides", "ours", "--profile-sides", "ours"])


def test_a_lower_is_better_entry_is_judged_on_ours_against_its_target(tmp_path):
    """memory_growth_* entries: ``ours`` is an exponent, met when at most the target; the table and the status say so."""
    flat = Entry("memory_growth_x", ours=0.05, peer=1.0, unit="exponent", ratio=0.05, target=0.2, notes="n",
                 lower_is_better=True)
    grows = Entry("memory_growth_y", ours=0.61, peer=1.0, unit="exponent", ratio=0.61, target=0.2, notes="n",
                  lower_is_better=True)
    assert flat.met is True and grows.met is False
    assert flat.status() == "ok: 0.05 vs at most 0.2" and grows.status().startswith("MISSED")
    write_results(tmp_path, [flat, grows], {}, [])
    table = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| `memory_growth_y` | 0.61 | 1 | exponent | 0.61 | ours ≤ 0.2 | — | **no** |" in table


def test_memory_bench_inputs_and_commands_cover_every_stage(tmp_path, tiny_policy):
    """The memory bench's synthetic inputs load, and each stage's command runs on them (at 20 rows, in process)."""
    from datasets import load_from_disk

    from rlhf_pipeline.bench import memory
    from conftest import run as rlhf

    inputs = memory.make_inputs(tmp_path / "inputs", 20, tiny_policy)
    assert {name: load_from_disk(str(path)).num_rows for name, path in inputs.items()} == {
        "prompts": 20, "generations": 20, "scored": 20, "pairs": 20}
    for stage in memory.STAGES:
        assert rlhf(*memory.stage_argv(stage, inputs, tiny_policy, tmp_path / stage)[0:]) == 0, stage


def test_the_gpu_trainer_scripts_report_keeps_each_finished_side_when_the_run_is_cut(tmp_path, monkeypatch):
    """scripts/bench_gpu.py writes its report after every side: a run killed during its second side (a lease's end)
    leaves the first side's figures, the second marked pending, and how many runs were still to come."""
    import json

    script = _gpu_bench_script()
    real_spawn, calls = script.spawn, []

    def spawn(side, *args, **kwargs):
        calls.append(side)
        if len(calls) == 2:
            report = json.loads((tmp_path / "bench.json").read_text())  # what a kill here would leave
            assert report["sides"]["ours"]["tokens_per_s_steps"] > 0
            assert report["sides"]["ours_bf16"] == {"side": "ours_bf16", "mode": "full", "pending": True}
            assert report["runs_pending"] == 1
            raise KeyboardInterrupt  # the run is cut while the second side runs
        return real_spawn(side, *args, **kwargs)

    monkeypatch.setattr(script, "spawn", spawn)
    with pytest.raises(KeyboardInterrupt):
        script.main(["--device", "cpu", "--tiny", "--sides", "ours,ours_bf16", "--workdir", str(tmp_path / "work"),
                     "--peak-tflops", "0.01", "--output", str(tmp_path / "bench.json")])
    assert calls == ["ours", "ours_bf16"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "work"]  # no partial file left beside it
    # each step's MFU, as the run counted it, equals that recomputed from the report alone (--step-mfu REPORT)
    # (the report's step times are rounded to 1e-4 s, its MFUs to 1e-4: the recomputed ones differ by that alone)
    report = json.loads((tmp_path / "bench.json").read_text())
    ours = report["sides"]["ours"]
    assert len(ours["step_mfu"]) == len(ours["step_seconds"]) == report["config"]["steps"]
    recomputed = script.step_mfu_of_report(report)
    assert list(recomputed) == ["ours"]
    for again, counted, seconds in zip(recomputed["ours"], ours["step_mfu"], ours["step_seconds"]):
        # the step time's rounding moves the recomputed MFU by up to its share of the time; each MFU's by 0.5e-4
        assert abs(again - counted) <= 1.01 * (counted * 0.5e-4 / seconds + 1e-4)
    # pairs that cannot be made again (another numpy, another make_pairs) are refused, not counted
    config = report["config"]
    moved = {**report, "config": {**config, "real_tokens_all_pairs": config["real_tokens_all_pairs"] + 1}}
    with pytest.raises(SystemExit, match="cannot make that run's pairs again"):
        script.step_mfu_of_report(moved)


def test_the_gpu_trainer_scripts_deadline_stops_it_and_says_what_did_not_run(tmp_path, monkeypatch, capsys):
    """``--deadline``: a side that would start past it does not start; the report keeps the sides that ran, lists the
    rest as pending, and the exit status says the run is incomplete, also when only a later round was cut. A side
    started before it gets the time left as its timeout, and one stopped there says so."""
    import json

    script = _gpu_bench_script()
    now = [0.0]  # the bench's clock: setup takes no time, each side 15 s
    monkeypatch.setattr(script.time, "perf_counter", lambda: now[0])
    timeouts = []

    def spawn(side, mode, spec_path, timeout, *args):
        timeouts.append(timeout)
        now[0] += 15.0
        if timeout < 15:  # stopped by its timeout, as spawn reports it
            return {"error": f"timed out after {timeout:.0f} s"}
        return {"error": "stand-in side"}  # a side's figures are not what this checks

    monkeypatch.setattr(script, "spawn", spawn)
    common = ["--device", "cpu", "--tiny", "--sides", "ours,ours_bf16", "--workdir", str(tmp_path / "work"),
              "--output", str(tmp_path / "bench.json")]
    assert script.main([*common, "--deadline", "12", "--worker-timeout", "100"]) == 1
    assert timeouts == [12.0]  # the time left, under --worker-timeout; side 2 (at 15 s) never started
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["sides"]["ours"]["error"] == "stopped at --deadline 12 s (it had 12 s left to run)"
    assert report["sides"]["ours_bf16"]["pending"] and report["runs_pending"] == 1
    assert "| ours_bf16 | not run (--deadline) |" in capsys.readouterr().out

    # two rounds whose first runs succeed: 4 runs of 15 s. Against 40 s the third run gets the 10 s left and the
    # fourth never starts; against 50 s the last run is stopped. Either way every side has a good round, and the
    # run is still incomplete.
    def succeed(side, mode, spec_path, timeout, *args):
        timeouts.append(timeout)
        now[0] += 15.0
        return {"error": f"timed out after {timeout:.0f} s"} if timeout < 15 else {"stand_in": side}

    monkeypatch.setattr(script, "spawn", succeed)
    figures = {"tokens_per_s_steps": 1.0, "trainable_params": 1, "seconds_steps": 1.0, "mfu_steps": None,
               "mfu_steps_with_ref": None, "seconds_run": 1.0, "seconds_setup": 0.0, "seconds_ref": 0.0,
               "tokens_per_s_run": 1.0, "mfu_run": None, "real_token_fraction": 1.0, "peak_rss_gib": 1.0,
               "first_loss": 0.69, "first_grad_norm": 1.0}
    monkeypatch.setattr(script, "summarise", lambda raw, *a: dict(figures))
    for deadline, started, pending in (("40", [40.0, 25.0, 10.0], 1), ("50", [50.0, 35.0, 20.0, 5.0], None)):
        now[0], timeouts[:] = 0.0, []
        assert script.main([*common, "--deadline", deadline, "--rounds", "2"]) == 1, deadline
        assert timeouts == started
        report = json.loads((tmp_path / "bench.json").read_text())
        assert report.get("runs_pending") == pending and report["cut_by_deadline"] is True
        assert all(v["tokens_per_s_steps"] == 1.0 for v in report["sides"].values())  # each side's good round
        stopped = [v["rounds_failed"] for v in report["sides"].values() if "rounds_failed" in v]
        assert stopped == [[f"stopped at --deadline {deadline} s (it had {started[-1]:.0f} s left to run)"]]
    now[0], timeouts[:] = 0.0, []
    assert script.main([*common, "--deadline", "100", "--rounds", "2"]) == 0  # all four in time: complete
    assert "cut_by_deadline" not in json.loads((tmp_path / "bench.json").read_text())

    with pytest.raises(SystemExit, match="--deadline -5: no time left"):  # before the model is built
        script.main([*common, "--deadline", "-5"])
