"""The group-RL options that DAPO, Dr. GRPO and GSPO are made of, against numbers worked by hand and against TRL's
loss written out (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``; TRL is not installed here):
asymmetric clipping, sequence-level ratios, the loss aggregations, the group baseline without the std, the
overlong penalty and the removal of groups with equal rewards; and how options and registry defaults combine."""

import math

import pytest
import torch

from rlhf_pipeline import algorithms
from rlhf_pipeline.algorithms.groups import RLParams, compute_advantages
from rlhf_pipeline.losses import ppo_policy_loss
from rlhf_pipeline.selection import UNIFORM_REWARDS, LengthLimits, OverlongPenalty, decide_group
from rlhf_pipeline.stages.train import TrainConfig


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


# ---------------------------------------------------------------------------------------------------- the surrogate


def test_clip_higher_lets_a_positive_advantage_ratio_grow_further():
    """One token per case. ε_low 0.2, ε_high 0.28.
    A = +1, ρ = 1.25: unclipped −1.25; clipped −clamp(1.25, 0.8, 1.28) = −1.25 → −1.25 (symmetric 0.2: −1.2).
    A = −1, ρ = 0.75: unclipped 0.75; clipped 0.8 → 0.8 (the low side still binds).
    A = +1, ρ = 1.30: clipped at 1.28 → −1.28, no gradient."""
    logp = t([[math.log(1.25)], [math.log(0.75)], [math.log(1.30)]]).requires_grad_()
    old, mask, adv = torch.zeros(3, 1, dtype=torch.float64), torch.ones(3, 1, dtype=torch.bool), t([1.0, -1.0, 1.0])
    loss, m = ppo_policy_loss(logp, old, adv, mask, clip=0.2, clip_high=0.28, reduction="sequence")
    assert loss.item() == pytest.approx((-1.25 + 0.8 - 1.28) / 3, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of −A·ρ is −A·ρ: −1.25/3 for the first token; 0 where the clip binds
    assert grad.flatten().tolist() == pytest.approx([-1.25 / 3, 0.0, 0.0], abs=1e-12)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    symmetric, _ = ppo_policy_loss(logp, old, adv, mask, clip=0.2, reduction="sequence")
    assert symmetric.item() == pytest.approx((-1.2 + 0.8 - 1.2) / 3, abs=1e-12)


def test_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio():
    """GSPO. Sequence 0: log-ratios [0.1, 0.3] → s = e^0.2 = 1.2214 < 1 + 0.28, so unclipped: loss −1.2214, and
    each token gets d/dlogp_t = −A·s/|y| = −0.6107 (then / 2 sequences).
    Sequence 1: log-ratios [−0.5] (one real token, one padded) → s = e^−0.5 = 0.6065; A = −2 → the low clip binds:
    max(2·0.6065, 2·0.8) = 1.6, no gradient. Loss (−1.2214 + 1.6) / 2 over the sequences."""
    logp = t([[0.1, 0.3], [-0.5, 99.0]]).requires_grad_()
    old = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    adv = t([1.0, -2.0])
    loss, m = ppo_policy_loss(logp, old, adv, mask, clip=0.2, clip_high=0.28, importance="sequence",
                              reduction="sequence")
    s0 = math.exp(0.2)
    assert loss.item() == pytest.approx((-s0 + 1.6) / 2, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.flatten().tolist() == pytest.approx([-s0 / 2 / 2, -s0 / 2 / 2, 0.0, 0.0], abs=1e-12)
    assert m["ratio_mean"].item() == pytest.approx((2 * s0 + math.exp(-0.5)) / 3)  # per token, padding left out
    # the token-level approx KL still reads each token's own ratio: k3 = ρ − 1 − log ρ
    k3 = [math.exp(x) - 1 - x for x in (0.1, 0.3, -0.5)]
    assert m["approx_kl"].item() == pytest.approx(sum(k3) / 3)


def test_aggregations_by_hand():
    """Per-token losses on-policy (ρ = 1) are −A: rows [−1, −1, −1] (3 tokens, A = 1) and [2, pad, pad] (A = −2).
    sequence: (−1 + 2) / 2 = 0.5; token: (−3 + 2) / 4 = −0.25; sum: −1; sequence_sum_norm with 6:
    (−3/6 + 2/6) / 2 = −1/12."""
    logp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = t([1.0, -2.0])
    expected = {"sequence": 0.5, "token": -0.25, "sum": -1.0, "sequence_sum_norm": -1 / 12}
    for reduction, value in expected.items():
        loss, _ = ppo_policy_loss(logp, logp, adv, mask, clip=0.2, reduction=reduction, max_tokens=6)
        assert loss.item() == pytest.approx(value, abs=1e-12), reduction
    with pytest.raises(ValueError, match="max_tokens"):
        ppo_policy_loss(logp, logp, adv, mask, clip=0.2, reduction="sequence_sum_norm")
    with pytest.raises(ValueError, match="importance"):
        ppo_policy_loss(logp, logp, adv, mask, clip=0.2, importance="segment")


def trl_grpo_loss(per_token_logps, old_per_token_logps, advantages, completion_mask, *, epsilon_low, epsilon_high,
                  importance_sampling_level, loss_type, max_completion_length=None, num_items_in_batch=None):
    """TRL's GRPO loss, written out from ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``, TRL 0.2x),
    without the KL, entropy masking and vLLM importance-sampling correction, one process."""
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if loss_type == "grpo":
        return ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        return (per_token_loss * completion_mask).sum() / num_items_in_batch
    raise ValueError(loss_type)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type, reduction", [("grpo", "sequence"), ("bnpo", "token"),
                                                  ("dr_grpo", "sequence_sum_norm"), ("dapo", "sum")])
def test_surrogate_equals_trls(level, loss_type, reduction):
    gen = torch.Generator().manual_seed(7)
    B, T = 6, 9
    lengths = [9, 3, 7, 1, 5, 8]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    shift = torch.tensor([0.3, -0.3, 0.1, -0.1, 0.25, 0.0], dtype=torch.float64)[:, None]  # whole sequences move too
    new = (old + shift + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    tokens = int(mask.sum())
    theirs = trl_grpo_loss(new, old, adv, mask.to(new.dtype), epsilon_low=0.2, epsilon_high=0.28,
                           importance_sampling_level=level, loss_type=loss_type, max_completion_length=T,
                           num_items_in_batch=tokens)
    ours, metrics = ppo_policy_loss(new, old, adv, mask, clip=0.2, clip_high=0.28, importance=level,
                                    reduction=reduction, max_tokens=T)
    if reduction == "sum":
        ours = ours / tokens
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    for a, b in zip(torch.autograd.grad(ours, new), torch.autograd.grad(theirs, new)):
        torch.testing.assert_close(torch.where(mask, a, 0), torch.where(mask, b, 0), atol=1e-12, rtol=0)
    assert 0 < metrics["clip_frac"].item() < 1  # both branches exercised


# ---------------------------------------------------------------------------------------------------- the baseline


def test_dr_grpo_centres_each_group_without_the_std():
    """Groups [1, 2, 6] (mean 3) and [0, 4] (mean 2): scores r − mean = [−2, −1, 3] and [−2, 2]; GRPO divides by the
    sample std (sqrt(7) and sqrt(8)) + 1e-4."""
    samples = {"group": [0, 0, 0, 1, 1], "reward": [1.0, 2.0, 6.0, 0.0, 4.0],
               "old_logps": [[-1.0], [-1.0], [-1.0], [-1.0], [-1.0]]}
    samples["ref_logps"] = samples["old_logps"]
    dr = compute_advantages(samples, algorithms.group_params(algorithms.get("dr_grpo"), kl_coef=0.0))
    assert dr["score"] == pytest.approx([-2.0, -1.0, 3.0, -2.0, 2.0], abs=1e-12)
    grpo = compute_advantages(samples, algorithms.group_params(algorithms.get("grpo"), kl_coef=0.0))
    s0, s1 = math.sqrt(7) + 1e-4, math.sqrt(8) + 1e-4
    assert grpo["score"] == pytest.approx([-2 / s0, -1 / s0, 3 / s0, -2 / s1, 2 / s1], abs=1e-12)
    assert dr["advantages"] == [[x] for x in dr["score"]]


# ---------------------------------------------------------------------------------------------------- the filter


def test_overlong_penalty_by_hand():
    """L_max 20, L_cache 5, factor 1: 0 up to 15 tokens, then (15 − |y|)/5: 16 → −0.2, 20 → −1; beyond → −1."""
    p = OverlongPenalty(max_tokens=20, buffer=5)
    assert [p(n) for n in (1, 15, 16, 18, 20, 21)] == pytest.approx([0, 0, -0.2, -0.6, -1.0, -1.0])
    assert OverlongPenalty(20, 5, factor=0.5)(18) == pytest.approx(-0.3)
    assert OverlongPenalty(20, 20)(10) == pytest.approx(-0.5)
    for bad in (0, 21):
        with pytest.raises(ValueError, match="overlong buffer"):
            OverlongPenalty(20, bad)


def verl_overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    """verl's DAPO reward manager (``verl/workers/reward_manager/dapo.py``, ``DAPORewardManager.__call__``), written
    out: ``exceed_len = valid_response_length - (max_resp_len - overlong_buffer_len)``, then
    ``min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)``."""
    exceed_len = valid_response_length - (max_resp_len - overlong_buffer_len)
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


def test_overlong_penalty_equals_verls_up_to_the_limit():
    for factor in (1.0, 0.5):
        p = OverlongPenalty(max_tokens=48, buffer=12, factor=factor)
        assert [p(n) for n in range(1, 49)] == pytest.approx([verl_overlong_reward(n, 48, 12, factor)
                                                              for n in range(1, 49)], abs=1e-12)


def test_groups_whose_rewards_are_all_equal_are_dropped_only_when_asked():
    limits = LengthLimits(100, 100)
    ids = [[1, 2], [3]]
    assert decide_group(3, ids, None, limits, [1.0, 1.0]) is None
    assert decide_group(3, ids, None, limits, [1.0, 1.0], uniform_dropped=True) == UNIFORM_REWARDS
    assert decide_group(3, ids, None, limits, [1.0, 0.5], uniform_dropped=True) is None


# ---------------------------------------------------------------------------------------------------- options


def config(algo, **options):
    return TrainConfig(model="m", data="d", output="o", algo=algo, **options)


def test_registry_defaults_fill_the_options_left_unset():
    dapo = config("dapo").rl_params()
    assert (dapo.clip, dapo.clip_high, dapo.loss_aggregation, dapo.importance) == (0.2, 0.28, "token", "token")
    gspo = config("gspo").rl_params()
    # GSPO's clip is a hundred times the paper's 3e-4 / 4e-4 (docs/algorithms.md: many updates per rollout)
    assert (gspo.clip, gspo.clip_high, gspo.importance, gspo.loss_aggregation) == (0.03, 0.04, "sequence", "sequence")
    assert (dapo.kl_coef, gspo.kl_coef) == (0.0, 0.0)  # DAPO §2.3 drops the KL term; GSPO's runs use none
    grpo = config("grpo").rl_params()
    assert (grpo.clip, grpo.clip_high, grpo.group_std, grpo.loss_aggregation) == (0.2, 0.2, True, "sequence")
    assert grpo.kl_coef == 0.05
    dr = config("dr_grpo").rl_params({"max_new_tokens": 64})
    assert (dr.group_std, dr.loss_aggregation, dr.max_tokens) == (False, "sequence_sum_norm", 64)
    assert config("dr_grpo").rl_params(None, lambda: 17).max_tokens == 17  # no lineage: the longest response


def test_every_registry_default_reaches_its_params_and_each_flags_default_is_the_params_own():
    """An algorithm's registry defaults are what its loss gets when no flag is given. A flag with a default of its
    own (not None) is always passed on, so a registry default for it would be silently lost, and its default must be
    the params' (``RLParams``, ``losses.PairLossParams``) or the two drift apart."""
    import dataclasses

    from rlhf_pipeline.algorithms import GROUPS, PAIRS, names
    from rlhf_pipeline.algorithms.groups import GroupOptions
    from rlhf_pipeline.algorithms.pairs import PairOptions
    from rlhf_pipeline.losses import PairLossParams

    for name in names(GROUPS):
        params = config(name).rl_params({"max_new_tokens": 8})
        assert {k: getattr(params, k) for k in params_defaults(name)} == params_defaults(name), name
    for name in names(PAIRS):
        params = config(name).loss_params()[1]
        assert {k: getattr(params, k) for k in params_defaults(name)} == params_defaults(name), name
    renamed = {"discount": "gamma", "importance_level": "importance"}  # GroupOptions' flag -> RLParams' field
    for options, params_type in ((GroupOptions, RLParams), (PairOptions, PairLossParams)):
        own = {f.name: f.default for f in dataclasses.fields(params_type)}
        for f in dataclasses.fields(options):
            key = renamed.get(f.name, f.name) if options is GroupOptions else f.name
            if f.default is not None and key in own:
                assert f.default == own[key], (options.__name__, f.name, f.default, own[key])


def params_defaults(name):
    return algorithms.get(name).defaults


def test_given_options_win_and_clip_sets_both_sides():
    p = config("dapo", clip=0.1).rl_params()
    assert (p.clip, p.clip_high) == (0.1, 0.1)  # an explicit --clip is symmetric, over DAPO's 0.28
    p = config("dapo", clip=0.1, clip_high=0.3).rl_params()
    assert (p.clip, p.clip_high) == (0.1, 0.3)
    p = config("grpo", clip_low=0.1, loss_aggregation="token", scale_rewards="none",
               importance_level="sequence").rl_params()
    # --clip-low moves the lower side only: the upper stays at GRPO's 0.2
    assert (p.clip, p.clip_high, p.loss_aggregation, p.group_std, p.importance) == (0.1, 0.2, "token", False,
                                                                                    "sequence")
    p = config("gspo", clip_high=0.01).rl_params()
    assert (p.clip, p.clip_high) == (0.03, 0.01)  # GSPO's own lower side stays
    assert config("dapo", kl_coef=0.1).rl_params().kl_coef == 0.1
    assert RLParams(algo="x").clip == 0.2


@pytest.mark.parametrize("algo, options, message", [
    ("dapo", {"clip": 0.0}, "--clip must be > 0"),
    ("dapo", {"clip_high": -0.1}, "--clip-high must be > 0"),
    ("dapo", {"clip_low": 1.0}, "--clip-low must be below 1"),
    ("dpo", {"loss_aggregation": "token", "clip_high": 0.3}, "--clip-high is not read by --algo dpo"),
    ("kto", {"importance_level": "sequence"}, "--importance-level is not read by --algo kto"),
    # options of the clipped surrogate that CISPO (its cap is --clip-high alone), SAPO (a gate) and SPPO (a
    # regression) would take and silently ignore, or, for CISPO's --clip, turn into a cap of 1.2 instead of 5
    ("cispo", {"clip": 0.2}, "--clip is not read by --algo cispo"),
    ("cispo", {"importance_level": "sequence"}, "--importance-level is not read by --algo cispo"),
    ("sapo", {"clip_low": 0.1}, "--clip-low is not read by --algo sapo"),
    ("sapo", {"importance_level": "sequence"}, "--importance-level is not read by --algo sapo"),
    ("sppo", {"clip_high": 0.3}, "--clip-high is not read by --algo sppo"),
    ("sppo", {"loss_aggregation": "token"}, "--loss-aggregation is not read by --algo sppo"),
    ("gdpo", {"normalize_rewards": True}, "--normalize-rewards is not read by --algo gdpo"),
    ("rloo", {"scale_rewards": "none"}, r"--scale-rewards is not read by --algo rloo \(it is read by grpo, dapo"),
    ("ppo", {"scale_rewards": "group"}, "--scale-rewards is not read by --algo ppo"),
])
def test_options_an_algorithm_does_not_use_are_refused(algo, options, message):
    with pytest.raises(ValueError, match=message):
        config(algo, **options)


def test_sppo_has_its_own_eta_and_rebel_keeps_one():
    """--eta is shared by REBEL and SPPO and unset by default: each takes its registry entry's default (SPPO's 100,
    docs/algorithms.md#sppos-η; REBEL's 1), and an --eta given wins for either."""
    assert config("sppo").rl_params().eta == 100.0
    assert config("sppo", eta=2.0).rl_params().eta == 2.0
    assert config("rebel").loss_params()[1].eta == 1.0
    assert config("rebel", eta=3.0).loss_params()[1].eta == 3.0
    with pytest.raises(ValueError, match="--eta must be > 0"):
        config("sppo", eta=0.0)


def test_each_default_a_flags_help_names_is_one_an_algorithm_reading_it_gets():
    """A flag left unset (None) takes each algorithm's own default (the registry's, else the params'). The help
    writes those defaults out as text, so that ``--help`` does not import torch to derive them: each number it gives
    as a default ("default 0.1", "(default 0.1; 2.0 for SimPO)") must be what some algorithm that reads the flag
    gets, and the values the algorithms get must all be named, so that a default changed in one place shows here."""
    import dataclasses
    import re

    from rlhf_pipeline.algorithms import ALGORITHMS, GROUPS, PAIRS, UNPAIRED
    from rlhf_pipeline.algorithms.groups import GroupOptions
    from rlhf_pipeline.algorithms.pairs import PairOptions
    from rlhf_pipeline.algorithms.unpaired import UnpairedOptions, unpaired_loss_params

    def params(algorithm):
        if algorithm.data == PAIRS:
            return config(algorithm.name).loss_params()[1]
        if algorithm.data == GROUPS:
            return config(algorithm.name).rl_params({"max_new_tokens": 8})
        return unpaired_loss_params(algorithm)

    checked = 0
    for options in (PairOptions, GroupOptions, UnpairedOptions):
        for f in dataclasses.fields(options):
            text, reads = f.metadata.get("help", ""), f.metadata.get("reads")
            # "default 0.1", and an algorithm's own after it: "(default 0.1; 2.0 for SimPO)"
            found = re.findall(r"default (\d[\d.e+-]*)|; (\d[\d.e+-]*) for ", text if isinstance(text, str) else "")
            named = {float(a or b) for a, b in found}
            if f.default is not None or reads is None or not named:
                continue
            got = {float(getattr(params(a), f.name)) for a in ALGORITHMS.values()
                   if a.data in (PAIRS, GROUPS, UNPAIRED) and reads(a)}
            assert named == got, (f.name, sorted(named), sorted(got), text)
            checked += 1
    assert checked >= 6  # eta, beta, label_smoothing, sft_coef, KTO's two weights, SAPO's two temperatures
