"""The shared loop's batching and schedule: pure functions, checked on small cases."""

import math

import pytest

from rlhf_pipeline.distributed import sharded_batches
from rlhf_pipeline.training.loop import global_batches, micro_batches, warmup_cosine


def test_global_batches_are_a_seeded_partition():
    batches = global_batches(10, 4, seed=0, epoch=0)
    assert len(batches) == 2 and all(len(b) == 4 for b in batches)  # the partial batch of 2 is dropped
    assert len(set(batches[0]) | set(batches[1])) == 8
    assert global_batches(10, 4, seed=0, epoch=0) == batches
    assert global_batches(10, 4, seed=0, epoch=1) != batches
    assert global_batches(10, 4, seed=1, epoch=0) != batches


def test_micro_batches_split_one_global_batch_the_same_way_for_any_layout():
    lengths = [5, 9, 1, 7, 3, 8, 2, 6]
    batch = list(range(8))
    # Sorted longest first: 1(9) 5(8) 3(7) 7(6) 0(5) 4(3) 6(2) 2(1).
    one_proc = micro_batches(batch, lengths, batch_size=2, world=1, accumulation=4, rank=0)
    assert one_proc == [[1, 5], [3, 7], [0, 4], [6, 2]]
    two_procs = [micro_batches(batch, lengths, 2, world=2, accumulation=2, rank=r) for r in (0, 1)]
    assert two_procs == [[[1, 5], [0, 4]], [[3, 7], [6, 2]]]
    big = micro_batches(batch, lengths, batch_size=8, world=1, accumulation=1, rank=0)
    assert sorted(big[0]) == batch


def test_sharded_batches_give_every_process_the_same_number_of_rounds():
    lengths = [3, 1, 4, 1, 5, 9, 2]
    rank0 = sharded_batches(lengths, 2, world=3, rank=0)
    rank2 = sharded_batches(lengths, 2, world=3, rank=2)
    assert len(rank0) == len(rank2) == 2
    assert rank2[-1] is None  # 4 batches over 3 processes: the third has one round with nothing to do
    covered = [i for r in range(3) for b in sharded_batches(lengths, 2, 3, r) if b for i in b]
    assert sorted(covered) == list(range(7))


def test_warmup_then_cosine():
    assert warmup_cosine(0, warmup=4, total=20) == pytest.approx(1 / 5)
    assert warmup_cosine(3, warmup=4, total=20) == pytest.approx(4 / 5)
    assert warmup_cosine(4, warmup=4, total=20) == pytest.approx(1.0)
    assert warmup_cosine(12, warmup=4, total=20) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(20, warmup=4, total=20) == pytest.approx(0.0)
    assert warmup_cosine(0, warmup=0, total=10) == pytest.approx(1.0)


def test_logged_learning_rate_is_the_one_each_step_used(tmp_path, fresh_accelerate_state):
    """The ``lr`` logged for step k is the rate of step k's update (warmup_cosine(k - 1)), not step k + 1's: the
    scheduler is stepped after the update, so its last rate must be read before that."""
    import json

    import torch
    from accelerate import Accelerator
    from datasets import Dataset

    from rlhf_pipeline.layout import METRICS
    from rlhf_pipeline.training.loop import TrainOptions, prepare, train

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def save_pretrained(self, path, **kwargs):  # the loop saves the final model; nothing to check here
            pass

    class Task:
        def lengths(self, rows):
            return [1] * len(rows)

        def collate(self, rows):
            return torch.tensor([r["x"] for r in rows])

        def loss(self, model, batch):
            return model.linear(batch).pow(2).mean(), {}, (len(batch), len(batch))

    class Tokenizer:
        def save_pretrained(self, path):
            pass

    total, peak = 6, 1e-2
    config = TrainOptions(model="unused", data="unused", output=str(tmp_path), max_steps=total, batch_size=1,
                          learning_rate=peak, warmup_ratio=0.5, report_to="none")
    accelerator = Accelerator()
    train_ds = Dataset.from_dict({"x": [[float(i), 1.0] for i in range(8)]})
    setup = prepare(config, accelerator, Model(), train_ds.num_rows)
    train(config, accelerator, setup, Tokenizer(), Task(), train_ds, None)

    logged = [json.loads(l)["lr"] for l in (tmp_path / METRICS).read_text().splitlines()]
    warmup = int(config.warmup_ratio * total)
    assert logged == pytest.approx([peak * warmup_cosine(s, warmup, total) for s in range(total)])
    assert logged[0] == pytest.approx(peak / (warmup + 1))  # the first step's warmup rate, not the second's


def test_rebel_backpropagates_repos_form_and_reports_the_papers(tiny_policy):
    """PairTask's REBEL loss has the paper's value, (Δ/η − Δr)², and REBEL's code's gradient, η² times larger."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.losses import PairLossParams, rebel_loss
    from rlhf_pipeline.algorithms.pairs import PairTask, pair_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    rows = [{"prompt_token_ids": [1, 10, 11], "chosen_token_ids": [20, 21, 2], "rejected_token_ids": [30, 2],
             "chosen_ref_logp": -9.0, "rejected_ref_logp": -4.5, "chosen_reward": 1.0, "rejected_reward": 0.2},
            {"prompt_token_ids": [1, 12], "chosen_token_ids": [40, 2], "rejected_token_ids": [41, 42, 43, 2],
             "chosen_ref_logp": -5.0, "rejected_ref_logp": -12.0, "chosen_reward": 0.4, "rejected_reward": -0.3}]
    eta = 10.0
    task = PairTask("rebel", PairLossParams(eta=eta, beta=0.1, label_smoothing=0.0, gamma=0.5), 1.0, 0)
    loss, _, _ = task.loss(model, rows)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    chosen, rejected, _ = pair_logps(model, rows, 0, 1.0)
    t = lambda k: torch.tensor([r[k] for r in rows])  # noqa: E731
    paper = rebel_loss(chosen, rejected, t("chosen_ref_logp"), t("rejected_ref_logp"), t("chosen_reward"),
                       t("rejected_reward"), eta=eta).mean()
    assert float(loss.detach()) == pytest.approx(float(paper.detach()), rel=1e-6)
    paper.backward()
    scale = max(float(g.abs().max()) for g in ours.values())
    for name, p in model.named_parameters():  # float32 sums in another order: tolerance relative to the largest
        torch.testing.assert_close(ours[name], eta**2 * p.grad, rtol=1e-3, atol=1e-5 * scale)
