"""The shared loop's batching and schedule: pure functions, checked on small cases."""

import math

import pytest

from rlhf_pipeline.trainer import global_batches, micro_batches, sharded_batches, warmup_cosine


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
