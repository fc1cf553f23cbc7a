"""The PPO family (``rlhf train --algo ppo|grpo|rloo|reinforce_pp``) on groups the tiny kit's stages made.

Oracles: advantages against numbers worked by hand (arithmetic in the comments); the training loss against a naive
per-sample reference (one plain full-logits forward per sample, float64, the clipped surrogate written out here);
runs against what a user checks (exit codes, finite losses, every parameter moved, loadable outputs, manifest);
resume and a 2-process ZeRO-3 run against an uninterrupted 1-process run.
"""

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from rlhf_pipeline import algorithms
from rlhf_pipeline.algorithms import groups as rl
from rlhf_pipeline.training import loop as trainer
from conftest import (
    assert_same_gradient_norms,
    LENGTH_REWARD,
    crash_after_checkpoint,
    launch_cpu_zero3,
    logged,
    max_weight_diff,
    micro_batch_sizes,
    run,
    spy_token_budget_plans,
)

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


GROUP_ALGOS = algorithms.names(algorithms.GROUPS)  # every group algorithm the registry holds


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a shared CPU: torch's intra-op threads only wait on each other (a 32-step run measured ~10x
    slower with 2 threads than with 1 on a busy 2-core machine). Results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_policy, bundled_prompts) -> Path:
    """generate (n=4) -> score (reward fn) -> filter --mode groups (and --mode pairs, for the error test)."""
    d = tmp_path_factory.mktemp("groups_data")
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", tiny_policy, "--prompts", bundled_prompts, "--output", d / "gen", "--n", 4,
               "--max-new-tokens", 16, "--limit", 40) == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    assert run("filter", "--input", d / "scored", "--output", d / "groups", "--tokenizer", tiny_policy,
               "--mode", "groups", "--test-size", 8) == 0
    assert run("filter", "--input", d / "scored", "--output", d / "pairs", "--tokenizer", tiny_policy,
               "--test-size", 8) == 0
    # two reward sources, for GDPO: the length reward and one for short answers, each kept in rewards_<key>
    (d / "short.py").write_text("def reward(prompts, responses, **columns):\n"
                                "    return [-len(r) / 10 for r in responses]\n")
    assert run("score", "--input", d / "gen", "--output", d / "scored2", "--reward-fn", f"{d}/reward.py:reward",
               "--reward-fn", f"{d}/short.py:reward", "--reward-weights", 1, 0.5) == 0
    assert run("filter", "--input", d / "scored2", "--output", d / "groups_two_sources", "--tokenizer", tiny_policy,
               "--mode", "groups", "--test-size", 8) == 0
    return d


def split_for(algo: str) -> str:
    """GDPO trains on data scored by several sources; the others on the one-source groups."""
    return "groups_two_sources" if algorithms.get(algo).reward_sources else "groups"


def train_args(data: Path, policy: str, out: Path, algo: str, *extra, critic: str | None = None,
               split: str = "groups") -> list:
    args = ["train", "--algo", algo, "--model", policy, "--data", data / split, "--output", out, "--report-to", "none"]
    if critic is not None:
        args += ["--critic-model", critic]
    return [*args, *extra]


def unchanged_parameters(before: Path, after: Path) -> list[str]:
    wa, wb = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert wa.keys() == wb.keys()
    return [k for k in wa if torch.equal(wa[k], wb[k])]


# ---------------------------------------------------------------------------------------------------- naive oracles


def naive_logps(policy, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token, from one plain full-logits forward of prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = policy(input_ids=ids).logits[0]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    start = len(prompt) - 1  # position t predicts token t + 1
    return logp[torch.arange(start, start + len(response)), torch.tensor(list(response), dtype=torch.long)]


def naive_values(critic, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The critic's value at every position that predicts a response token: backbone + score head, plain forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    values = critic.score(critic.model(input_ids=ids).last_hidden_state[0]).squeeze(-1)
    # the reward model's own forward reads its score at the last token: the same head on the same hidden states
    assert values[-1].item() == pytest.approx(critic(input_ids=ids).logits[0, 0].item(), abs=1e-6)
    start = len(prompt) - 1
    return values[start : start + len(response)]


def flat_samples(ds, groups: range) -> list[dict]:
    """One dict per response of the given group rows (the flattening written out here, not rl.flatten_groups)."""
    out = []
    for g in groups:
        row = ds[g]
        for response, reward in zip(row["response_token_ids"], row["rewards"]):
            out.append({"group": g, "prompt_token_ids": list(row["prompt_token_ids"]),
                        "response_token_ids": list(response), "reward": float(reward)})
    return out


# ---------------------------------------------------------------------------------------------------- advantages

# Two groups: group 0 has 3 samples, group 1 has 2. Response lengths 2, 1, 3, 2, 1 (9 tokens).
#   old − ref per token (the k1 KL):  s0 [0.5, −1.0]   s1 [0.0]   s2 [1.0, 0.0, −0.5]   s3 [0.0, 1.0]   s4 [−1.0]
HAND = {
    "group": [0, 0, 0, 1, 1],
    "reward": [1.0, 2.0, 6.0, 0.0, 4.0],
    "old_logps": [[-1.0, -2.0], [-0.5], [-1.0, -1.0, -1.0], [-2.0, -1.0], [-3.0]],
    "ref_logps": [[-1.5, -1.0], [-0.5], [-2.0, -1.0, -0.5], [-2.0, -2.0], [-2.0]],
    "old_values": [[0.5, 1.0], [1.0], [2.0, 3.0, 4.0], [0.0, -1.0], [2.0]],
}


def advantages_of(params: "rl.RLParams", **override) -> dict:
    samples = {k: [list(v) if isinstance(v, list) else v for v in vs] for k, vs in {**HAND, **override}.items()}
    return rl.compute_advantages(samples, params)


def assert_rows(actual: list[list[float]], expected: list[list[float]], tol: float = 1e-9):
    assert [len(r) for r in actual] == [len(r) for r in expected]
    for a, e in zip(actual, expected):
        assert a == pytest.approx(e, abs=tol), (actual, expected)


def whiten(values: list[float]) -> list[float]:
    """(x − mean)/sqrt(population variance + 1e-8) over all tokens: the global whitening, written out."""
    mu, var = statistics.fmean(values), statistics.pvariance(values)
    return [(x - mu) / math.sqrt(var + 1e-8) for x in values]


def test_grpo_advantages_are_the_group_normalised_reward_on_every_token():
    # kl_mode loss: the KL goes into the loss, never into the rewards, so only the group statistics count.
    # Group 0, rewards [1, 2, 6]: mean 3, deviations [−2, −1, 3], unbiased variance (4 + 1 + 9)/2 = 7, std √7.
    # Group 1, rewards [0, 4]: mean 2, deviations [−2, 2], unbiased variance (4 + 4)/1 = 8, std √8.
    # A = deviation / (std + 1e-4) (TRL's eps), the same on every token of the sample.
    params = rl.RLParams(algo="grpo", kl_coef=0.1, kl_mode="loss", kl_estimator="k3")
    out = advantages_of(params)
    s7, s8 = math.sqrt(7) + 1e-4, math.sqrt(8) + 1e-4
    scores = [-2 / s7, -1 / s7, 3 / s7, -2 / s8, 2 / s8]
    assert out["score"] == pytest.approx(scores, abs=1e-12)
    assert out["score"] == pytest.approx([-0.755900, -0.377950, 1.133850, -0.707082, 0.707082], abs=1e-6)
    assert_rows(out["advantages"], [[scores[0]] * 2, [scores[1]], [scores[2]] * 3, [scores[3]] * 2, [scores[4]]])
    assert "returns" not in out


def test_rloo_advantages_with_a_k1_kl_reward_penalty():
    # Leave-one-out baselines on the sequence rewards: group 0 [1, 2, 6] (sum 9): baselines (9 − r)/2 = [4, 3.5, 1.5]
    # → [−3, −1.5, 4.5]; group 1 [0, 4]: baselines [4, 0] → [−4, 4].
    # kl_mode reward, β = 0.1, k1 = old − ref: token rewards −0.1·k1 on every token, + the RLOO score on the last;
    # with γ = 1 each token's advantage is the sum of the token rewards from it to the end:
    #   s0: rewards [−0.05, +0.1 − 3]         → [−2.95, −2.9]
    #   s1: rewards [0 − 1.5]                 → [−1.5]
    #   s2: rewards [−0.1, 0, +0.05 + 4.5]    → [4.45, 4.55, 4.55]
    #   s3: rewards [0, −0.1 − 4]             → [−4.1, −4.1]
    #   s4: rewards [+0.1 + 4]                → [4.1]
    params = rl.RLParams(algo="rloo", kl_coef=0.1, kl_mode="reward", kl_estimator="k1")
    out = advantages_of(params)
    assert out["score"] == pytest.approx([-3, -1.5, 4.5, -4, 4], abs=1e-12)
    assert_rows(out["advantages"], [[-2.95, -2.9], [-1.5], [4.45, 4.55, 4.55], [-4.1, -4.1], [4.1]])


def test_reinforce_pp_advantages_are_whitened_returns_to_go_with_the_kl_penalty():
    # Raw rewards (no group baseline), β = 0.1 k1 penalty per token, γ = 1, returns-to-go:
    #   s0: [−0.05, 0.1 + 1]       → [1.05, 1.1]
    #   s1: [0 + 2]                → [2.0]
    #   s2: [−0.1, 0, 0.05 + 6]    → [5.95, 6.05, 6.05]
    #   s3: [0, −0.1 + 0]          → [−0.1, −0.1]
    #   s4: [0.1 + 4]              → [4.1]
    # Over all 9 tokens: sum 26.1, mean 2.9; deviations [−1.85, −1.8, −0.9, 3.05, 3.15, 3.15, −3, −3, 1.2];
    # squares sum to 56.06, population variance 56.06/9 = 6.228889, std 2.495774; A = deviation / std.
    params = rl.RLParams(algo="reinforce_pp", kl_coef=0.1, kl_mode="reward", kl_estimator="k1", gamma=1.0)
    out = advantages_of(params)
    std = math.sqrt(56.06 / 9 + 1e-8)
    dev = [[-1.85, -1.8], [-0.9], [3.05, 3.15, 3.15], [-3.0, -3.0], [1.2]]
    assert_rows(out["advantages"], [[d / std for d in row] for row in dev])
    assert out["advantages"][2][0] == pytest.approx(3.05 / 2.495774, abs=1e-6)
    assert out["score"] == pytest.approx(HAND["reward"])


def test_ppo_advantages_are_whitened_gae_and_returns_are_unwhitened_gae_plus_values():
    # Token rewards as for REINFORCE++ above (raw reward on the last token, −0.1·k1 on each), critic values given.
    # GAE with γ = 1, λ = 0.5: δ_t = r_t + V_{t+1} − V_t (V = 0 past the end), A_t = δ_t + 0.5·A_{t+1}:
    #   s0: r [−0.05, 1.1], V [0.5, 1]:     δ1 = 1.1 − 1 = 0.1, A1 = 0.1; δ0 = −0.05 + 1 − 0.5 = 0.45, A0 = 0.5
    #   s1: r [2], V [1]:                   A = 1.0
    #   s2: r [−0.1, 0, 6.05], V [2, 3, 4]: δ2 = 2.05, A2 = 2.05; δ1 = 0 + 4 − 3 = 1, A1 = 1 + 1.025 = 2.025;
    #                                       δ0 = −0.1 + 3 − 2 = 0.9, A0 = 0.9 + 1.0125 = 1.9125
    #   s3: r [0, −0.1], V [0, −1]:         δ1 = −0.1 + 1 = 0.9, A1 = 0.9; δ0 = −1 − 0 = −1, A0 = −1 + 0.45 = −0.55
    #   s4: r [4.1], V [2]:                 A = 2.1
    # returns = A + V (before whitening): s0 [1.0, 1.1], s1 [2.0], s2 [3.9125, 5.025, 6.05], s3 [−0.55, −0.1], s4 [4.1]
    # advantages: the 9 raw A whitened together (population variance).
    params = rl.RLParams(algo="ppo", kl_coef=0.1, kl_mode="reward", kl_estimator="k1", gamma=1.0, lam=0.5)
    out = advantages_of(params)
    assert_rows(out["returns"], [[1.0, 1.1], [2.0], [3.9125, 5.025, 6.05], [-0.55, -0.1], [4.1]])
    raw = [0.5, 0.1, 1.0, 1.9125, 2.025, 2.05, -0.55, 0.9, 2.1]
    w = whiten(raw)
    assert_rows(out["advantages"], [w[0:2], w[2:3], w[3:6], w[6:8], w[8:9]])


def test_group_baselines_on_uneven_groups_and_normalized_rewards():
    # Group 0 has two samples [1, 3], group 1 a lone sample [5]: the lone one has no baseline and gets 0.
    uneven = dict(group=[0, 0, 1], reward=[1.0, 3.0, 5.0], old_logps=[[-1.0, -1.0], [-1.0], [-2.0]],
                  ref_logps=[[-1.0, -1.0], [-1.0], [-2.0]], old_values=[[0.0, 0.0], [0.0], [0.0]])
    # grpo: deviations ±1, unbiased std √2 → ∓1/(√2 + 1e-4) = ∓0.707057; rloo: 1 − 3 = −2 and 3 − 1 = 2.
    a = 1 / (math.sqrt(2) + 1e-4)
    grpo = rl.compute_advantages({k: list(v) for k, v in uneven.items()}, rl.RLParams(algo="grpo", kl_coef=0.0))
    assert_rows(grpo["advantages"], [[-a, -a], [a], [0.0]])
    rloo = rl.compute_advantages({k: list(v) for k, v in uneven.items()}, rl.RLParams(algo="rloo", kl_coef=0.0))
    assert_rows(rloo["advantages"], [[-2.0, -2.0], [2.0], [0.0]])

    # normalize_rewards standardises the 5 rewards [1, 2, 6, 0, 4] first: mean 2.6, deviations
    # [−1.6, −0.6, 3.4, −2.6, 1.4], squares sum 23.2, unbiased variance 5.8. RLOO is linear and the mean cancels in
    # r_i − mean of the others, so the scores are the raw RLOO scores [−3, −1.5, 4.5, −4, 4] divided by √5.8.
    params = rl.RLParams(algo="rloo", kl_coef=0.0, normalize_rewards=True)
    out = advantages_of(params)
    s = math.sqrt(5.8) + 1e-8
    assert out["score"] == pytest.approx([-3 / s, -1.5 / s, 4.5 / s, -4 / s, 4 / s], abs=1e-9)
    assert_rows(out["advantages"], [[-3 / s] * 2, [-1.5 / s], [4.5 / s] * 3, [-4 / s] * 2, [4 / s]])
    # reinforce_pp without KL: returns = the standardised reward on every token; the whitening of those
    # [z0, z0, z1, z2, z2, z2, z3, z3, z4] is the same as of the raw rewards (whitening ignores shift and scale).
    rpp = advantages_of(rl.RLParams(algo="reinforce_pp", kl_coef=0.0, normalize_rewards=True))
    w = whiten([1.0, 1.0, 2.0, 6.0, 6.0, 6.0, 0.0, 0.0, 4.0])
    assert_rows(rpp["advantages"], [w[0:2], w[2:3], w[3:6], w[6:8], w[8:9]], tol=1e-7)


def test_gamma_does_not_discount_grpo_advantages():
    params = rl.RLParams(algo="grpo", kl_coef=0.1, kl_mode="loss", kl_estimator="k3", gamma=0.5)
    out = advantages_of(params)
    for score, row in zip(out["score"], out["advantages"]):
        assert row == pytest.approx([score] * len(row), abs=1e-9)


# ---------------------------------------------------------------------------------------------------- the loss


def _reference_loss(policy, critic, rows, params, temperature):
    """Per sample: the clipped surrogate (and KL, value terms) by hand, aggregated as ``params.loss_aggregation``
    says: mean over tokens then over samples (sequence), mean over all tokens (token), or each sample's token sum
    over ``params.max_tokens``, then the mean (sequence_sum_norm). The value loss is a per-sample mean always."""
    policy_terms, kl_terms, value_terms, clipped = [], [], [], 0
    low, high = params.clip, params.clip if params.clip_high is None else params.clip_high
    for r in rows:
        lp = naive_logps(policy, r["prompt_token_ids"], r["response_token_ids"], temperature)
        old, adv = torch.tensor(r["old_logps"], dtype=lp.dtype), torch.tensor(r["advantages"], dtype=lp.dtype)
        if "correction" in r:  # the rollout correction's weight on each token's policy-gradient term
            adv = adv * torch.tensor(r["correction"], dtype=lp.dtype)
        if params.importance == "sequence":  # GSPO: one ratio, exp of the mean log-ratio, on every token
            ratio = torch.exp((lp - old).mean()).expand_as(lp)
        else:
            ratio = torch.exp(lp - old)
        if params.algo == "cispo":  # REINFORCE under a capped, stop-gradient importance weight
            cap = 1 + params.clip_high
            clipped += int((ratio > cap).sum())
            policy_terms.append(-ratio.clamp(max=cap).detach() * adv * lp)
        elif params.algo == "sapo":  # a soft gate, its temperature by the advantage's sign
            tau = torch.where(adv > 0, params.sapo_temperature_pos, params.sapo_temperature_neg).to(lp.dtype)
            policy_terms.append(-adv * torch.sigmoid(tau * (ratio - 1)) * 4 / tau)
        elif params.algo == "sppo":  # one squared error per response: its log-ratio against its target
            policy_terms.append(((lp - old).sum() - adv[0]).pow(2).reshape(1))
        else:
            kept = ratio.clamp(1 - low, 1 + high)
            clipped += int(((-adv * kept) > (-adv * ratio)).sum())
            policy_terms.append(torch.maximum(-adv * ratio, -adv * kept))
        if params.kl_mode == "loss":
            d = torch.tensor(r["ref_logps"], dtype=lp.dtype) - lp  # log(ref/π)
            kl_terms.append({"k1": -d, "k2": d**2 / 2, "k3": torch.exp(d) - 1 - d}[params.kl_estimator])
        if critic is not None:
            v = naive_values(critic, r["prompt_token_ids"], r["response_token_ids"])
            v_old, ret = torch.tensor(r["old_values"], dtype=v.dtype), torch.tensor(r["returns"], dtype=v.dtype)
            v_clip = v_old + (v - v_old).clamp(-params.value_clip, params.value_clip)
            value_terms.append(0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2).mean())

    def aggregate(per_sample):
        if params.loss_aggregation == "token":
            return torch.cat(per_sample).sum() / sum(len(x) for x in per_sample)
        if params.loss_aggregation == "sequence_sum_norm":
            return torch.stack([x.sum() / params.max_tokens for x in per_sample]).mean()
        return torch.stack([x.mean() for x in per_sample]).mean()

    loss = aggregate(policy_terms)
    if kl_terms:
        loss = loss + params.kl_coef * aggregate(kl_terms)
    if value_terms:
        loss = loss + params.vf_coef * torch.stack(value_terms).mean()
    return loss, clipped


@pytest.mark.parametrize("algo, kl_mode, estimator", [("grpo", "loss", "k3"), ("ppo", "loss", "k2"),
                                                      ("rloo", "reward", "k1"), ("dapo", "loss", "k3"),
                                                      ("dr_grpo", "loss", "k3"), ("gspo", "loss", "k1"),
                                                      ("cispo", "loss", "k3"), ("sapo", "loss", "k3"),
                                                      ("sppo", "reward", "k1")])
def test_group_task_loss_and_gradient_equal_a_naive_per_sample_reference(data, tiny_policy, tiny_rm, algo, kl_mode,
                                                                         estimator):
    """Every policy loss of the family, and the rollout correction's weights (zeros and weights above 1, on every
    algorithm that takes them), against the formulas written out per sample; options set away from their defaults
    where a swap would go unseen (CISPO's cap, SAPO's two temperatures)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.logprobs import build_batch

    temperature = 0.8
    policy = AutoModelForCausalLM.from_pretrained(tiny_policy).double().eval()
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_rm).double().eval() if algo == "ppo" else None
    model = rl.policy_and_critic(policy, critic) if critic is not None else policy
    pad = load_tokenizer(tiny_policy).pad_token_id

    # Two groups of 4 (8 samples), with rollout columns chosen so that ratios and values get clipped both ways.
    # The tiny policy nearly always runs to --max-new-tokens, so the responses are cut to uneven lengths: a mean over
    # all tokens of the micro-batch would then differ from the per-sample means the loss is defined with.
    rows = flat_samples(load_from_disk(str(data / "groups"))["train"], range(2))
    for r, n in zip(rows, (16, 5, 11, 2, 16, 8, 1, 13)):
        r["response_token_ids"] = r["response_token_ids"][:n]
    assert len({len(r["response_token_ids"]) for r in rows}) >= 5
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in rows:
            lp = naive_logps(policy, r["prompt_token_ids"], r["response_token_ids"], temperature)
            n = len(lp)
            r["old_logps"] = (lp + 0.3 * torch.randn(n, generator=gen, dtype=lp.dtype)).tolist()
            r["ref_logps"] = (lp + 0.5 * torch.randn(n, generator=gen, dtype=lp.dtype)).tolist()
            r["advantages"] = torch.randn(n, generator=gen, dtype=lp.dtype).tolist()
            if algo == "sppo":  # the target, η(P − 1/2), on every token of a response
                r["advantages"] = [r["advantages"][0]] * n
            else:  # rollout-correction weights: masked tokens (0), capped ones, and the rest
                r["correction"] = torch.rand(n, generator=gen, dtype=lp.dtype).mul(3).floor().mul(0.75).tolist()
            if critic is not None:
                v = naive_values(critic, r["prompt_token_ids"], r["response_token_ids"])
                r["old_values"] = (v + 0.3 * torch.randn(n, generator=gen, dtype=v.dtype)).tolist()
                r["returns"] = torch.randn(n, generator=gen, dtype=v.dtype).tolist()
    # the algorithm's own options (DAPO: clip-higher, token mean; Dr. GRPO: token sums over 16; GSPO: sequence ratios,
    # with a clip wide enough to leave some sequences unclipped)
    own = {"gspo": {"clip": 0.05, "clip_high": 0.08}, "cispo": {"clip_high": 0.1},
           "sapo": {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}}.get(algo, {})
    params = algorithms.group_params(algorithms.get(algo), kl_coef=0.1, kl_mode=kl_mode, kl_estimator=estimator,
                                     vf_coef=0.5, value_clip=0.2, **own)
    if params.loss_aggregation == "sequence_sum_norm":
        params.max_tokens = 16
    parameters = [p for p in model.parameters() if p.requires_grad]

    expected, clipped = _reference_loss(policy, critic, rows, params, temperature)
    assert clipped > 0 or algo in ("sapo", "sppo")  # the test exercises the clipped branch (SAPO, SPPO have none)
    if algo != "sppo":
        weights = [w for r in rows for w in r["correction"]]
        assert 0.0 in weights and 1.5 in weights and 0.75 in weights
    expected_grads = torch.autograd.grad(expected, parameters)

    packed = build_batch([r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows], pad, 2.0)
    assert packed.input_ids.shape[0] < len(rows)  # pack_ratio 2 really puts several samples in a row
    losses = {}
    for pack_ratio in (0.0, 2.0):
        task = rl.GroupTask(params, temperature, pad, pack_ratio)
        loss, metrics, (real, total) = task.loss(model, task.collate(rows))
        assert loss.dtype == torch.float64
        assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
        assert abs(loss.item() - expected.item()) < 1e-10  # float64: far tighter than the 1e-6 asked
        grads = torch.autograd.grad(loss, parameters)
        for p_name, g, e in zip([n for n, p in model.named_parameters() if p.requires_grad], grads, expected_grads):
            torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-7, msg=lambda m: f"{p_name}: {m}")
        assert real == sum(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in rows)
        assert all(v.shape == (len(rows),) for v in metrics.values())
        assert ("kl" in metrics) == (kl_mode == "loss") and ("value_loss" in metrics) == (algo == "ppo")
        with torch.no_grad():  # the logged KL to the reference: k1 summed over each response
            k1 = [(naive_logps(policy, r["prompt_token_ids"], r["response_token_ids"], temperature)
                   - torch.tensor(r["ref_logps"], dtype=torch.float64)).sum().item() for r in rows]
        assert metrics["kl_to_ref"].tolist() == pytest.approx(k1, abs=1e-9)
        lengths = [len(r["response_token_ids"]) for r in rows]
        assert metrics["response_length"].tolist() == lengths
        if critic is not None:  # the critic's values and targets: sums per sample, weighed by its tokens
            with torch.no_grad():
                values = [naive_values(critic, r["prompt_token_ids"], r["response_token_ids"]).sum().item()
                          for r in rows]
            assert metrics["value_mean"].tolist() == pytest.approx(values, abs=1e-9)
            assert metrics["return_mean"].tolist() == pytest.approx([sum(r["returns"]) for r in rows], abs=1e-9)
            assert metrics["value_mean@weight"].tolist() == lengths
        losses[pack_ratio] = loss.item()
    assert losses[0.0] == pytest.approx(losses[2.0], abs=1e-12)  # packing changes nothing


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "gspo", "sppo"])
def test_an_empty_response_is_a_zero_loss_row_however_the_step_is_split(algo, data, tiny_policy):
    """The per-sequence losses average over a micro-batch's rows and the trainer weighs each micro-batch by its rows
    (n / batch): an empty response (a sampler that stopped at once) must then count as a row of loss 0, or the rows
    beside it would weigh more in one split than in another. Splits: 8 × 1, 4 × 2, 2 × 4, the empty row alone."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.chat import load_tokenizer

    policy = AutoModelForCausalLM.from_pretrained(tiny_policy).double().eval()
    pad = load_tokenizer(tiny_policy).pad_token_id
    rows = flat_samples(load_from_disk(str(data / "groups"))["train"], range(2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r, n in zip(rows, (16, 5, 11, 2, 16, 8, 0, 13)):
            r["response_token_ids"] = r["response_token_ids"][:n]
            lp = naive_logps(policy, r["prompt_token_ids"], r["response_token_ids"], 0.8) if n else torch.zeros(0)
            r["old_logps"] = (lp + 0.3 * torch.randn(n, generator=gen, dtype=lp.dtype)).tolist()
            r["ref_logps"] = (lp + 0.5 * torch.randn(n, generator=gen, dtype=lp.dtype)).tolist()
            r["advantages"] = [torch.randn(1, generator=gen).item()] * n
    params = algorithms.group_params(algorithms.get(algo), kl_coef=0.1, kl_mode="loss", kl_estimator="k3")
    if params.loss_aggregation == "sequence_sum_norm":
        params.max_tokens = 16
    task = rl.GroupTask(params, 0.8, pad, 2.0)

    def loss(indices):
        return task.loss(policy, task.collate([rows[i] for i in indices]))[0].item()

    whole = loss(range(8))
    assert whole == pytest.approx(loss([0, 1, 2, 3, 4, 5, 7]) * 7 / 8, abs=1e-12)  # the empty row adds 0, counts 1
    for split in (([0, 1, 2, 3], [4, 5, 6, 7]), ([0, 1], [2, 3], [4, 5], [6, 7]), ([6], [0, 1, 2, 3, 4, 5, 7])):
        assert sum(loss(c) * len(c) / 8 for c in split) == pytest.approx(whole, abs=1e-12), split


# ---------------------------------------------------------------------------------------------------- integration


@pytest.mark.parametrize("algo", GROUP_ALGOS)
def test_each_algo_trains_every_parameter_and_saves_loadable_outputs(algo, data, tiny_policy, tiny_rm, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / algo
    critic = tiny_rm if algo == "ppo" else None
    assert run(*train_args(data, tiny_policy, out, algo, "--batch-size", 8, "--epochs", 2, "--learning-rate", 1e-3,
                           critic=critic, split=split_for(algo))) == 0
    groups = load_from_disk(str(data / split_for(algo)))
    n_train = sum(len(r) for r in groups["train"]["rewards"])
    n_test = sum(len(r) for r in groups["test"]["rewards"])
    steps = 2 * (n_train // 8)  # --epochs 2 are the PPO epochs over the one rollout

    curve = logged(out)
    assert len(curve) == steps and all(math.isfinite(x) for x in curve), curve
    eval_curve = logged(out, "loss/eval")
    assert len(eval_curve) == 2 and all(math.isfinite(x) for x in eval_curve)  # before any update, and at the end
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*records)
    assert {"loss/train", "loss/train_policy_loss", "kl/train_kl_to_ref", "policy/train_entropy", "grad_norm",
            "lr"} <= keys
    if algorithms.get(algo).policy_loss_fn().__name__ in ("clipped_surrogate", "_cispo"):
        assert "ppo/train_clip_frac" in keys
    assert ("loss/train_value_loss" in keys) == (algo == "ppo")

    assert not unchanged_parameters(Path(tiny_policy), out), "policy parameters that did not change"
    AutoModelForCausalLM.from_pretrained(out)
    if algo == "ppo":
        assert not unchanged_parameters(Path(tiny_rm), out / "critic"), "critic parameters that did not change"
        loaded = AutoModelForSequenceClassification.from_pretrained(out / "critic")
        assert loaded.config.num_labels == 1
        assert (out / "critic" / "tokenizer_config.json").exists()
    else:
        assert not (out / "critic").exists()

    manifest = json.loads((out / "manifest.json").read_text())
    training = manifest["training"]
    assert training["algo"] == algo and training["steps"] == steps
    # the KL weight: 0.05 by default, DAPO's, GSPO's, CISPO's and SPPO's own 0 (their defaults fill the options left
    # unset)
    assert training["rl_params"]["algo"] == algo
    assert training["rl_params"]["kl_coef"] == (0.0 if algo in ("dapo", "gspo", "cispo", "sppo") else 0.05)
    assert training["logp_temperature"] == 0.8  # the sampling temperature, read from the lineage
    assert training["ref_model"] == tiny_policy
    assert training["sampler"] == {"model": manifest["sampling"]["model"], "is_trained_policy": True}
    assert training["critic_model"] == critic
    assert training["samples"] == {"train": n_train, "test": n_test}
    flat_rewards = [x for r in groups["train"]["rewards"] for x in r]
    assert training["mean_reward"] == pytest.approx(statistics.fmean(flat_rewards))
    assert math.isfinite(training["loss_first_step"]) and math.isfinite(training["loss_last_step"])

    # OUTPUT/rollout: the rollout inputs a resumed run reuses, checked against plain forwards of the starting models.
    rollout = load_from_disk(str(out / "rollout"))
    assert rollout["train"].num_rows == n_train and rollout["test"].num_rows == n_test
    columns = {"old_logps", "ref_logps", "advantages"} | ({"old_values", "returns"} if algo == "ppo" else set())
    assert columns <= set(rollout["train"].column_names)
    start = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    start_critic = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval() if algo == "ppo" else None
    trained = AutoModelForCausalLM.from_pretrained(out).eval()
    train_rollout = rollout["train"].to_list()
    improvement = []
    with torch.no_grad():
        for i, s in enumerate(train_rollout):
            if i < 3:
                lp = naive_logps(start, s["prompt_token_ids"], s["response_token_ids"], 0.8)
                assert s["old_logps"] == pytest.approx(lp.tolist(), abs=1e-4)
                assert s["ref_logps"] == s["old_logps"]  # no --ref-model: the starting policy is the reference
                if start_critic is not None:
                    v = naive_values(start_critic, s["prompt_token_ids"], s["response_token_ids"])
                    assert s["old_values"] == pytest.approx(v.tolist(), abs=1e-4)
            # the surrogate's first-order gain mean_t A_t·(log π_new − log π_old) should be positive on the whole
            new = naive_logps(trained, s["prompt_token_ids"], s["response_token_ids"], 0.8)
            adv, old = torch.tensor(s["advantages"]), torch.tensor(s["old_logps"])
            improvement.append(float((adv * (new - old)).mean()))
    assert statistics.fmean(improvement) > 0, "training moved the policy against the advantages"
    if algo not in ("ppo", "reinforce_pp"):  # ref == old, so no KL in the rewards: the group score on every token
        by_group: dict[int, list[float]] = {}
        for s in train_rollout:
            by_group.setdefault(s["group"], []).append(s["reward"])
        gdpo = gdpo_scores(train_rollout, manifest["training"]["rl_params"]["reward_weights"]) \
            if algo == "gdpo" else None
        for i, s in enumerate(train_rollout):
            rs = by_group[s["group"]]
            if algo in ("grpo", "dapo", "gspo", "cispo", "sapo"):
                score = (s["reward"] - statistics.fmean(rs)) / (statistics.stdev(rs) + 1e-4)
            elif algo == "dr_grpo":
                score = s["reward"] - statistics.fmean(rs)
            elif algo == "sppo":  # eta (SPPO's default) x (mean Bradley-Terry win probability against the others - 1/2)
                wins = [1 / (1 + math.exp(other - s["reward"])) for other in rs]
                score = manifest["training"]["rl_params"]["eta"] * ((sum(wins) - 0.5) / (len(rs) - 1) - 0.5)
            elif algo == "gdpo":
                score = gdpo[i]
            else:
                score = s["reward"] - (sum(rs) - s["reward"]) / (len(rs) - 1)
            assert s["advantages"] == pytest.approx([score] * len(s["advantages"]), abs=1e-6)


def gdpo_scores(samples: list[dict], weights: list[float]) -> list[float]:
    """GDPO's scores in plain Python: per source, (r - group mean) / (group stdev + 1e-4); the weighted sum; then
    standardised over every sample (stdev + 1e-4)."""
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s["group"], []).append(i)
    summed = [0.0] * len(samples)
    for members in by_group.values():
        for k, w in enumerate(weights):
            values = [samples[i]["source_rewards"][k] for i in members]
            mean, sd = statistics.fmean(values), statistics.stdev(values)
            for i, v in zip(members, values):
                summed[i] += w * (v - mean) / (sd + 1e-4)
    mean, sd = statistics.fmean(summed), statistics.stdev(summed)
    return [(x - mean) / (sd + 1e-4) for x in summed]


def test_ppo_without_a_reward_model_starts_its_critic_from_the_policy(data, tiny_policy, tmp_path):
    """Data scored by a python function: the critic is the policy with a new value head (its backbone the
    policy's), and it trains."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path / "ppo"
    assert run(*train_args(data, tiny_policy, out, "ppo", "--max-steps", 1, "--batch-size", 8,
                           "--critic-learning-rate", 1e-12)) == 0
    assert json.loads((out / "manifest.json").read_text())["training"]["critic_model"] == tiny_policy
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    policy = AutoModelForCausalLM.from_pretrained(tiny_policy)
    shared = {k: v for k, v in critic.model.state_dict().items()}
    diffs = {k: (shared[k] - v).abs().max().item() for k, v in policy.model.state_dict().items()}
    assert shared.keys() == diffs.keys() and max(diffs.values()) < 1e-6, diffs  # the policy's backbone, unmoved
    assert critic.score.weight.shape[0] == 1


def test_groups_need_group_data(data, tiny_policy, tmp_path, capsys):
    capsys.readouterr()
    for algo in ("grpo", "ppo"):
        assert run(*train_args(data, tiny_policy, tmp_path / f"pairs_{algo}", algo, "--max-steps", 1, split="pairs",
                               critic=None)) == 1
        err = capsys.readouterr().err.strip()
        assert "--mode groups" in err and "response_token_ids" in err and "\n" not in err, err


def test_groups_that_cannot_teach_a_group_baseline_are_refused_or_warned_of(data, tiny_policy, tmp_path, capsys,
                                                                            caplog):
    """Groups of one response (generate --n 1) give a group baseline nothing to credit: grpo refuses such data in one
    line naming the fix, before a model loads, rather than train near the policy it started from; PPO (no baseline)
    trains on them. Some groups of one among others, or equal rewards in every group (an iteration whose prompts
    all pass or all fail; or a verifiable reward without its ground truth): a warning, and the run goes on."""
    from datasets import load_from_disk

    groups = load_from_disk(str(data / "groups"))
    per_response = [c for c in ("responses", "rewards", "response_token_ids", "finish_reasons", "response_logprobs")
                    if c in groups["train"].column_names]

    def first(k: int):
        return lambda row, i: {c: row[c][:1] for c in per_response} if i < k else {}

    groups.map(first(10**9), with_indices=True).save_to_disk(str(tmp_path / "single"))
    capsys.readouterr()
    assert run(*train_args(tmp_path, tiny_policy, tmp_path / "grpo_single", "grpo", "--max-steps", 1,
                           split="single")) == 1
    err = capsys.readouterr().err.strip()
    assert f"single:train: every group holds a single response ({groups['train'].num_rows} groups): --algo grpo" in err
    assert "--n 4" in err and "\n" not in err and not (tmp_path / "grpo_single").exists(), err
    # (the copies have no generate manifest upstream: the sampling temperature is given)
    assert run(*train_args(tmp_path, tiny_policy, tmp_path / "ppo_single", "ppo", "--max-steps", 1, "--temperature",
                           0.8, split="single", critic=tiny_policy)) == 0

    groups.map(first(3), with_indices=True).save_to_disk(str(tmp_path / "some"))
    groups.map(lambda row: {"rewards": [0.0] * len(row["rewards"])}).save_to_disk(str(tmp_path / "wrong"))
    for name, warning in [("some", f"3 of {groups['train'].num_rows} groups hold a single response"),
                          ("wrong", "every group's rewards are equal: --algo grpo")]:
        caplog.clear()
        assert run(*train_args(tmp_path, tiny_policy, tmp_path / f"grpo_{name}", "grpo", "--max-steps", 1,
                               "--temperature", 0.8, split=name)) == 0
        assert warning in caplog.text


def test_ppo_takes_its_critic_from_the_reward_model_that_scored_the_data(data, tiny_policy, tiny_rm, tmp_path):
    from transformers import AutoModelForSequenceClassification

    assert run("score", "--input", data / "gen", "--output", tmp_path / "scored", "--reward-model", tiny_rm) == 0
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "groups", "--tokenizer", tiny_policy,
               "--mode", "groups", "--test-size", 8) == 0
    out = tmp_path / "ppo"
    # --critic-learning-rate gives the critic its own rate: at 1e-12 one AdamW step cannot move a float32 weight.
    assert run(*train_args(tmp_path, tiny_policy, out, "ppo", "--max-steps", 1, "--batch-size", 8,
                           "--learning-rate", 1e-3, "--critic-learning-rate", 1e-12)) == 0
    assert json.loads((out / "manifest.json").read_text())["training"]["critic_model"] == tiny_rm
    AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert max_weight_diff(Path(tiny_rm), out / "critic") < 1e-6
    assert max_weight_diff(Path(tiny_policy), out) > 1e-4


def test_a_kl_penalty_in_the_reward_without_a_reference_model_is_warned_of(data, tiny_policy, tmp_path, caplog):
    """Without --ref-model the reference is --model, whose log-probs are also the old ones: a KL penalty in the
    reward is then 0 on every token (the rollout shows it), and a warning says so; --kl-mode loss is not warned of."""
    import logging

    with caplog.at_level(logging.WARNING, logger="rlhf_pipeline.algorithms.groups"):
        assert run(*train_args(data, tiny_policy, tmp_path / "rloo", "rloo", "--max-steps", 1, "--batch-size", 8,
                               "--kl-coef", 0.1)) == 0
    assert "--algo rloo: a KL penalty of 0.1 in the reward is 0 on every token here" in caplog.text
    samples = load_from_disk(str(tmp_path / "rloo" / "rollout"))["test"].to_list()
    assert all(s["old_logps"] == s["ref_logps"] for s in samples)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_pipeline.algorithms.groups"):
        assert run(*train_args(data, tiny_policy, tmp_path / "loss", "rloo", "--max-steps", 1, "--batch-size", 8,
                               "--kl-coef", 0.1, "--kl-mode", "loss")) == 0
    assert "KL penalty" not in caplog.text


def test_a_separate_reference_puts_its_k1_kl_into_reinforce_pp_rewards(data, tiny_policy, tmp_path):
    """With --ref-model the rollout's ref_logps are the reference's, and the advantages are the whitened
    returns-to-go of (reward on the last token − β·(old − ref) on every token), written out here with loops."""
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.tiny import save_tiny_model

    reference = str(save_tiny_model(tmp_path / "ref", kind="policy", seed=3))
    out = tmp_path / "rpp"
    assert run(*train_args(data, tiny_policy, out, "reinforce_pp", "--max-steps", 1, "--batch-size", 8,
                           "--ref-model", reference, "--kl-coef", 0.1)) == 0
    assert json.loads((out / "manifest.json").read_text())["training"]["ref_model"] == reference
    samples = load_from_disk(str(out / "rollout"))["test"].to_list()
    ref_model = AutoModelForCausalLM.from_pretrained(reference).eval()
    with torch.no_grad():
        for s in samples[:3]:
            lp = naive_logps(ref_model, s["prompt_token_ids"], s["response_token_ids"], 0.8)
            assert s["ref_logps"] == pytest.approx(lp.tolist(), abs=1e-4)
    returns = []
    for s in samples:
        token_rewards = [-0.1 * (o - r) for o, r in zip(s["old_logps"], s["ref_logps"])]
        token_rewards[-1] += s["reward"]
        running, rtg = 0.0, []
        for x in reversed(token_rewards):
            running = x + running
            rtg.insert(0, running)
        returns.append(rtg)
    assert any(abs(o - r) > 0.1 for s in samples for o, r in zip(s["old_logps"], s["ref_logps"]))  # a real KL
    w = iter(whiten([x for rtg in returns for x in rtg]))
    for s, rtg in zip(samples, returns):
        assert s["advantages"] == pytest.approx([next(w) for _ in rtg], abs=1e-6)


# ---------------------------------------------------------------------------------------------------- DAPO, Dr. GRPO, GSPO


def assert_same_token_means(a: Path, b: Path, critic: bool = False, ratios: bool = True) -> None:
    """Two runs of the same steps cut into other micro-batches logged the same token means (clip fraction, k3 KL,
    mean ratio, SAPO's gate; the critic's clip fraction, values and returns): each micro-batch's mean weighed by its
    tokens, not by its rows. The response lengths and rewards, per sample, too. ``ratios``: a loss of importance
    ratios (not SPPO's)."""
    keys = [k for k in json.loads((a / "metrics.jsonl").read_text().splitlines()[1])
            if k.split("/")[-1] in {"train_clip_frac", "train_approx_kl", "train_ratio_mean", "train_gate_mean",
                                    "train_value_clip_frac", "train_value_mean", "train_return_mean",
                                    "train_response_length", "train_reward"}]
    assert {"policy/train_response_length", "reward/train_reward"} <= set(keys), keys
    critics = {"critic/train_value_clip_frac", "critic/train_value_mean", "critic/train_return_mean"}
    assert ("kl/train_approx_kl" in keys) == ratios and (critics <= set(keys)) == critic, keys
    for key in keys:
        assert logged(b, key) == pytest.approx(logged(a, key), abs=1e-6), key
    if ratios:  # the policy moved: the means are not all 0
        assert any(v > 1e-6 for v in logged(a, "kl/train_approx_kl"))


@pytest.fixture(scope="module")
def uneven(tmp_path_factory, stop_prone_policy, bundled_prompts) -> Path:
    """Groups of responses of uneven lengths (the stop-prone policy stops anywhere within 16 tokens), where a token
    mean and a per-sequence mean differ, and the overlong penalty reaches some responses and not others."""
    d = tmp_path_factory.mktemp("uneven")
    (d / "reward.py").write_text(LENGTH_REWARD)
    assert run("generate", "--model", stop_prone_policy, "--prompts", bundled_prompts, "--output", d / "gen",
               "--n", 4, "--max-new-tokens", 16, "--limit", 24) == 0
    assert run("score", "--input", d / "gen", "--output", d / "scored", "--reward-fn", f"{d}/reward.py:reward") == 0
    assert run("filter", "--input", d / "scored", "--output", d / "groups", "--tokenizer", stop_prone_policy,
               "--mode", "groups", "--test-size", 4) == 0
    lengths = {len(r) for rs in load_from_disk(str(d / "groups"))["train"]["response_token_ids"] for r in rs}
    assert len(lengths) > 5 and max(lengths) == 16
    return d


def test_dapo_token_mean_is_over_the_whole_step_whatever_the_accumulation(uneven, stop_prone_policy, tmp_path,
                                                                         monkeypatch):
    """DAPO's loss is the mean over every token of the optimizer step: batch 8 x accumulation 1 and batch 2 x
    accumulation 4 give the same losses and weights. A token mean within each micro-batch (the step's token count
    not passed to the task) would not: its micro-batches hold different numbers of tokens."""
    common = ["--max-steps", 3, "--learning-rate", 1e-3]
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "b8", "dapo", *common, "--batch-size", 8)) == 0
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "b2", "dapo", *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 4, "--eval-batch-size", 3)) == 0
    assert logged(tmp_path / "b2") == pytest.approx(logged(tmp_path / "b8"), abs=1e-5)
    assert_same_gradient_norms(tmp_path / "b8", tmp_path / "b2")
    # the held-out loss is the token mean over the whole test split too, whatever the evaluation batches
    assert logged(tmp_path / "b2", "loss/eval") == pytest.approx(logged(tmp_path / "b8", "loss/eval"), abs=1e-6)
    assert max_weight_diff(tmp_path / "b2", tmp_path / "b8") < 1e-4
    training = json.loads((tmp_path / "b8" / "manifest.json").read_text())["training"]["rl_params"]
    assert (training["clip_high"], training["loss_aggregation"]) == (0.28, "token")

    # the check can fail: with each micro-batch normalised by its own tokens the two runs part
    monkeypatch.setattr(rl.GroupTask, "begin_step", lambda self, *a: setattr(self, "totals", None))
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "b2_local", "dapo", *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 4)) == 0
    local, whole = logged(tmp_path / "b2_local"), logged(tmp_path / "b8")
    assert max(abs(a - b) for a, b in zip(local, whole)) > 1e-3


@pytest.mark.parametrize("algo", ["dapo", "ppo"])
def test_a_token_budget_trains_as_batching_by_count(algo, uneven, stop_prone_policy, tiny_rm, tmp_path, monkeypatch):
    """--max-tokens-per-micro-batch cuts each global batch of 8 samples into micro-batches of several sizes instead
    of 4 of 2: the same losses and weights. DAPO's token mean over the step holds through micro-batches of different
    rows (GroupTask.token_scale); PPO's critic and value loss go through the same weighting."""
    critic = tiny_rm if algo == "ppo" else None
    common = ["--max-steps", 3, "--learning-rate", 1e-3, "--batch-size", 2, "--gradient-accumulation-steps", 4]
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "count", algo, *common, critic=critic)) == 0
    plans = spy_token_budget_plans(monkeypatch)
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "tokens", algo, *common,
                           "--max-tokens-per-micro-batch", 100, critic=critic)) == 0
    assert len(plans) == 3 and len(micro_batch_sizes(plans)) >= 2 and micro_batch_sizes(plans) != {2}, plans
    for key in ("loss/train", "loss/train_policy_loss", "loss/eval") + (("loss/train_value_loss",) if critic else ()):
        assert logged(tmp_path / "tokens", key) == pytest.approx(logged(tmp_path / "count", key), abs=1e-5), key
    assert_same_token_means(tmp_path / "count", tmp_path / "tokens", critic=critic is not None)
    assert_same_gradient_norms(tmp_path / "count", tmp_path / "tokens")
    assert max_weight_diff(tmp_path / "tokens", tmp_path / "count") < 1e-4
    if critic:
        assert max_weight_diff(tmp_path / "tokens" / "critic", tmp_path / "count" / "critic") < 1e-4


def test_a_logging_window_weighs_token_means_by_tokens_across_steps_and_a_resume(uneven, stop_prone_policy, tmp_path,
                                                                                monkeypatch):
    """--logging-steps 3 over 4 steps of DAPO (8 samples a step): the line at step 3 holds the token means of steps
    1-3 weighed by each step's tokens (8 x its mean response length), and the per-sample means their plain mean;
    the same when the run is cut after its step-2 checkpoint and resumed (the window's weighted sums travel in the
    checkpoint)."""
    common = ["--max-steps", 4, "--learning-rate", 1e-3, "--batch-size", 8]
    every, cut = tmp_path / "every", tmp_path / "cut"
    assert run(*train_args(uneven, stop_prone_policy, every, "dapo", *common)) == 0
    windowed = [*common, "--logging-steps", 3, "--save-every", 2]
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(uneven, stop_prone_policy, cut, "dapo", *windowed)) == 130
    assert run(*train_args(uneven, stop_prone_policy, cut, "dapo", *windowed, "--resume")) == 0

    lengths, kl = logged(every, "policy/train_response_length"), logged(every, "kl/train_approx_kl")
    tokens = [8 * n for n in lengths]
    weighted = sum(k * t for k, t in zip(kl[:3], tokens[:3])) / sum(tokens[:3])
    assert logged(cut, "kl/train_approx_kl") == pytest.approx([weighted, kl[3]], rel=1e-6)
    assert logged(cut, "policy/train_response_length") == pytest.approx([sum(lengths[:3]) / 3, lengths[3]], rel=1e-9)
    assert abs(weighted - sum(kl[:3]) / 3) > 1e-3 * abs(weighted)  # the steps' tokens differ: weighing matters here


@pytest.mark.parametrize("algo", ["dr_grpo", "gspo"])
def test_batch_times_accumulation_is_invariant_for_the_sequence_level_options(algo, uneven, stop_prone_policy,
                                                                            tmp_path):
    """Dr. GRPO's token sums over a fixed length and GSPO's per-sequence ratios are per-sample quantities: batch 8 x
    accumulation 1 and batch 2 x accumulation 4 give the same run."""
    common = ["--max-steps", 3, "--learning-rate", 1e-3]
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "b8", algo, *common, "--batch-size", 8)) == 0
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "b2", algo, *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 4)) == 0
    assert logged(tmp_path / "b2") == pytest.approx(logged(tmp_path / "b8"), abs=1e-5)
    assert_same_gradient_norms(tmp_path / "b8", tmp_path / "b2")
    assert max_weight_diff(tmp_path / "b2", tmp_path / "b8") < 1e-4


@pytest.mark.parametrize("algo, extra", [("cispo", []), ("sapo", ["--entropy-coef", 0.01]),
                                         ("sppo", ["--eta", 1]),  # losses of order 1, for the absolute tolerances
                                         ("gdpo", [])])
def test_the_2026_entries_are_invariant_to_batch_times_accumulation_and_resume(algo, extra, data, uneven,
                                                                               stop_prone_policy, tiny_policy,
                                                                               tmp_path, monkeypatch):
    """CISPO (a token mean over the step), SAPO with an entropy bonus, SPPO (one squared error per response) and
    GDPO (several rewards): batch 8 x accumulation 1 and batch 2 x accumulation 4 give the same run, and a run cut
    after its step-2 checkpoint and resumed equals the uninterrupted one."""
    if algo == "gdpo":
        source, policy, split = data, tiny_policy, "groups_two_sources"
    else:
        source, policy, split = uneven, stop_prone_policy, "groups"
    common = ["--max-steps", 4, "--learning-rate", 1e-3, *extra]
    assert run(*train_args(source, policy, tmp_path / "b8", algo, *common, "--batch-size", 8, split=split)) == 0
    assert run(*train_args(source, policy, tmp_path / "b2", algo, *common, "--batch-size", 2,
                           "--gradient-accumulation-steps", 4, split=split)) == 0
    assert logged(tmp_path / "b2") == pytest.approx(logged(tmp_path / "b8"), abs=1e-5)
    assert_same_gradient_norms(tmp_path / "b8", tmp_path / "b2")
    assert max_weight_diff(tmp_path / "b2", tmp_path / "b8") < 1e-4
    assert len(logged(tmp_path / "b8", "policy/train_entropy")) == 4
    assert_same_token_means(tmp_path / "b8", tmp_path / "b2", ratios=algo != "sppo")

    cut = [*common, "--batch-size", 8, "--save-every", 2]
    crash_after_checkpoint(monkeypatch, 2)
    assert run(*train_args(source, policy, tmp_path / "cut", algo, *cut, split=split)) == 130
    assert run(*train_args(source, policy, tmp_path / "cut", algo, *cut, "--resume", split=split)) == 0
    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "b8"), abs=1e-6)
    assert max_weight_diff(tmp_path / "cut", tmp_path / "b8") < 1e-5


def test_the_entropy_bonus_changes_the_update_and_is_refused_outside_the_ppo_family(uneven, stop_prone_policy,
                                                                                    tiny_policy, tmp_path, capsys):
    common = ["--max-steps", 2, "--learning-rate", 1e-3, "--batch-size", 8]
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "plain", "grpo", *common)) == 0
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "bonus", "grpo", *common,
                           "--entropy-coef", 0.5)) == 0
    plain, bonus = logged(tmp_path / "plain"), logged(tmp_path / "bonus")
    entropy = logged(tmp_path / "bonus", "policy/train_entropy")
    # the logged loss includes the bonus: at step 1 (same weights) the difference is -0.5 x the step's entropy
    assert bonus[0] == pytest.approx(plain[0] - 0.5 * entropy[0], abs=1e-5)
    assert max_weight_diff(tmp_path / "plain", tmp_path / "bonus") > 1e-6
    capsys.readouterr()
    assert run("train", "--algo", "dpo", "--model", tiny_policy, "--data", uneven / "groups", "--output",
               tmp_path / "dpo", "--entropy-coef", 0.1) == 1
    assert "--entropy-coef is not read by --algo dpo" in capsys.readouterr().err


def test_filter_drops_groups_of_equal_rewards_and_shapes_overlong_rewards(uneven, stop_prone_policy, tmp_path,
                                                                         capsys):
    """A reward fn that gives every response of half the prompts the same reward: --drop-uniform-groups drops exactly
    those prompts and counts them; --overlong-buffer 4 lowers the reward of responses longer than 16 - 4 tokens by
    (12 - |y|) / 4, recorded in the manifest."""
    (tmp_path / "flat.py").write_text(
        "def reward(prompts, responses, prompt_id, **columns):\n"
        "    return [0.5 if sum(map(ord, p)) % 2 else float(len(r)) for p, r in zip(prompt_id, responses)]\n")
    assert run("score", "--input", uneven / "gen", "--output", tmp_path / "scored", "--reward-fn",
               f"{tmp_path}/flat.py:reward") == 0
    scored = load_from_disk(str(tmp_path / "scored"))
    uniform = sum(len(set(r)) == 1 for r in scored["rewards"])
    assert 0 < uniform < scored.num_rows
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "groups", "--tokenizer", stop_prone_policy,
               "--mode", "groups", "--test-size", 0, "--drop-uniform-groups", "--overlong-buffer", 4) == 0
    manifest = json.loads((tmp_path / "groups" / "manifest.json").read_text())
    kept = load_from_disk(str(tmp_path / "groups"))["train"]
    penalty = manifest["reward_shaping"]["overlong_penalty"]
    assert (penalty["max_tokens"], penalty["buffer"], penalty["factor"]) == (16, 4, 1.0)
    by_id = {row["prompt_id"]: row for row in scored}
    shaped_count = 0
    for row in kept:
        raw = by_id[row["prompt_id"]]["rewards"]
        lengths = [len(ids) for ids in row["response_token_ids"]]
        expected = [r + min(0.0, (12 - n) / 4) for r, n in zip(raw, lengths)]
        assert row["rewards"] == pytest.approx(expected)
        assert len(set(row["rewards"])) > 1
        shaped_count += sum(n > 12 for n in lengths)
    assert penalty["penalised_responses"] >= shaped_count > 0
    # a uniform group whose lengths differ is no longer uniform once shaped: only the rest are dropped
    still_uniform = sum(len({r + min(0.0, (12 - len(ids)) / 4) for r, ids in zip(s["rewards"], s["response_token_ids"])})
                        == 1 for s in scored)
    assert manifest["dropped"].get("uniform_rewards", 0) == still_uniform
    assert kept.num_rows == scored.num_rows - still_uniform
    # without the shaping every uniform group goes, and the console says so, not the manifest alone
    capsys.readouterr()
    assert run("filter", "--input", tmp_path / "scored", "--output", tmp_path / "unshaped", "--tokenizer",
               stop_prone_policy, "--mode", "groups", "--test-size", 0, "--drop-uniform-groups") == 0
    assert f"[filter] dropped {uniform} of {scored.num_rows} prompts: uniform_rewards {uniform}\n" in (
        capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------------- resume


def test_interrupted_ppo_run_resumed_equals_uninterrupted_and_reuses_the_rollout(data, tiny_policy, tiny_rm, tmp_path,
                                                                                 monkeypatch):
    common = ["--max-steps", 6, "--batch-size", 8, "--save-every", 2, "--learning-rate", 1e-3]
    calls = []
    real_rollout_pass = rl.rollout_pass

    def counting_rollout_pass(*args, **kwargs):
        calls.append(len(args[2]["prompt_token_ids"]))
        return real_rollout_pass(*args, **kwargs)

    monkeypatch.setattr(rl, "rollout_pass", counting_rollout_pass)
    assert run(*train_args(data, tiny_policy, tmp_path / "full", "ppo", *common, critic=tiny_rm)) == 0
    assert len(calls) == 2  # train and test, once each (no --ref-model: the reference log-probs are the old ones)

    real_save = trainer.save_checkpoint

    def save_then_crash(accelerator, model, tokenizer, output, state, **kwargs):
        path = real_save(accelerator, model, tokenizer, output, state, **kwargs)
        if state["step"] == 4:
            raise KeyboardInterrupt  # as if Ctrl-C came right after the step-4 checkpoint
        return path

    calls.clear()
    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    assert run(*train_args(data, tiny_policy, tmp_path / "cut", "ppo", *common, critic=tiny_rm)) == 130
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    assert len(calls) == 2 and (tmp_path / "cut" / "rollout" / "dataset_dict.json").exists()
    assert not (tmp_path / "cut" / "manifest.json").exists()

    calls.clear()
    assert run(*train_args(data, tiny_policy, tmp_path / "cut", "ppo", *common, "--resume", critic=tiny_rm)) == 0
    assert calls == [], "the resumed run recomputed the rollout instead of reusing OUTPUT/rollout"

    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert len(logged(tmp_path / "cut")) == 6
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") < 1e-5
    assert max_weight_diff(tmp_path / "cut" / "critic", tmp_path / "full" / "critic") < 1e-5


@pytest.mark.parametrize("algo", ["dapo", "dr_grpo", "gspo"])
def test_the_new_group_options_resume_to_the_uninterrupted_run(algo, uneven, stop_prone_policy, tmp_path,
                                                                monkeypatch):
    """DAPO's step token count, Dr. GRPO's fixed length and GSPO's sequence ratios hold no state across steps that a
    checkpoint could miss: a run cut after its step-4 checkpoint and resumed equals the uninterrupted one."""
    common = ["--max-steps", 6, "--batch-size", 4, "--save-every", 2, "--learning-rate", 1e-3]
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "full", algo, *common)) == 0
    real_save = trainer.save_checkpoint

    def save_then_crash(accelerator, model, tokenizer, output, state, **kwargs):
        path = real_save(accelerator, model, tokenizer, output, state, **kwargs)
        if state["step"] == 4:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "cut", algo, *common)) == 130
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    assert run(*train_args(uneven, stop_prone_policy, tmp_path / "cut", algo, *common, "--resume")) == 0
    assert logged(tmp_path / "cut") == pytest.approx(logged(tmp_path / "full"), abs=1e-6)
    assert len(logged(tmp_path / "cut")) == 6
    assert max_weight_diff(tmp_path / "cut", tmp_path / "full") < 1e-5


def test_push_to_hub_leaves_the_rollout_cache_out(data, tiny_policy, tmp_path, monkeypatch):
    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            pass

        def list_repo_files(self, repo_id, **kw):
            return []  # a new repo

        def upload_folder(self, **kw):
            uploads.append(kw["ignore_patterns"])

        def upload_file(self, **kw):
            pass

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    out = tmp_path / "grpo"
    assert run(*train_args(data, tiny_policy, out, "grpo", "--max-steps", 1, "--batch-size", 8,
                           "--push-to-hub", "org/tiny-grpo")) == 0
    assert (out / "rollout").exists()
    (patterns,) = uploads
    assert "rollout/*" in patterns


def test_simpo_margin_keeps_its_default():
    from rlhf_pipeline.stages.train import TrainConfig

    simpo = TrainConfig(algo="simpo", model="m", data="d", output="o")
    assert simpo.loss_params()[1].gamma == 0.5


# ---------------------------------------------------------------------------------------------------- ZeRO-3


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo", "gspo", "cispo", "sppo"])
def test_two_process_zero3_equals_one_process(algo, data, tiny_policy, tiny_rm, tmp_path, request):
    """2 processes x batch 4 under DeepSpeed ZeRO-3 (CPU, gloo) against 1 process x batch 4 x accumulation 2; for
    PPO the critic is partitioned too (policy and critic are one module, one engine). DAPO runs on responses of
    uneven lengths, so that its token mean over the whole step is tested across processes."""
    if algo in ("dapo", "gspo", "cispo"):
        data, tiny_policy = request.getfixturevalue("uneven"), request.getfixturevalue("stop_prone_policy")
    critic = tiny_rm if algo == "ppo" else None
    common = ["--max-steps", 3, "--learning-rate", 1e-3, "--batch-size", 4]
    assert run(*train_args(data, tiny_policy, tmp_path / "single", algo, *common, "--gradient-accumulation-steps", 2,
                           critic=critic)) == 0
    launch_cpu_zero3(train_args(data, tiny_policy, tmp_path / "zero3", algo, *common, critic=critic))
    for key in ("loss/train", "loss/eval", "loss/train_policy_loss"):
        assert len(logged(tmp_path / "zero3", key)) == len(logged(tmp_path / "single", key)) > 0
        # float32 sums in another order: 1e-5 absolute, or relative for SPPO's losses (eta 100: of order 40)
        assert logged(tmp_path / "zero3", key) == pytest.approx(logged(tmp_path / "single", key), abs=1e-5,
                                                                rel=1e-6), key
    assert max_weight_diff(tmp_path / "zero3", tmp_path / "single") < 1e-4
    if algo == "ppo":
        assert logged(tmp_path / "zero3", "loss/train_value_loss") == pytest.approx(
            logged(tmp_path / "single", "loss/train_value_loss"), abs=1e-5)
        assert max_weight_diff(tmp_path / "zero3" / "critic", tmp_path / "single" / "critic") < 1e-4
        assert not unchanged_parameters(Path(tiny_rm), tmp_path / "zero3" / "critic")
    # the rollout the 2 processes shared out and gathered is the 1-process rollout
    zr, sr = load_from_disk(str(tmp_path / "zero3" / "rollout")), load_from_disk(str(tmp_path / "single" / "rollout"))
    for column in ("old_logps", "advantages") + (("old_values", "returns") if algo == "ppo" else ()):
        for a, b in zip(zr["train"][column], sr["train"][column]):
            assert a == pytest.approx(b, abs=1e-5)


def test_ppo_with_compile_learns_as_the_eager_ppo(data, tiny_policy, tiny_rm, tmp_path):
    """--compile on PPO, whose one prepared model holds the policy and the critic: both sets of decoder layers are
    compiled, and the losses (policy and value) are the eager run's to float rounding."""
    import torch._dynamo

    args = ["--batch-size", 8, "--max-steps", 2, "--learning-rate", 1e-3]
    assert run(*train_args(data, tiny_policy, tmp_path / "eager", "ppo", *args, critic=tiny_rm)) == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert run(*train_args(data, tiny_policy, tmp_path / "compiled", "ppo", *args, "--compile", critic=tiny_rm)) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for key in ("loss/train", "loss/train_value_loss"):
        assert len(logged(tmp_path / "eager", key)) == 2
        assert logged(tmp_path / "compiled", key) == pytest.approx(logged(tmp_path / "eager", key), abs=1e-4)
