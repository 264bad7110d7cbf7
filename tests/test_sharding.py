"""How one DataLoader is split across processes, checked for every rank in one process."""

from __future__ import annotations

import pytest
import torch
from rank_checks import Stream
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from runner.engine.data_loader import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SkipBatchSampler,
    last_batch_remainder,
    order_generators,
    shard_dataloader,
    skip_first_batches,
)
from runner.state import GradientState


def shards(num_samples: int, batch_size: int, num_processes: int, **kwargs) -> list[list[list[int]]]:
    sampler = BatchSampler(
        SequentialSampler(range(num_samples)), batch_size, drop_last=kwargs.pop("drop_last", False)
    )
    return [list(BatchSamplerShard(sampler, num_processes, rank, **kwargs)) for rank in range(num_processes)]


def gathered(per_rank: list[list[list[int]]]) -> list[int]:
    """What gather would concatenate, step by step: rank 0's batch, then rank 1's, ..."""
    return [i for step in zip(*per_rank, strict=True) for batch in step for i in batch]


@pytest.mark.parametrize("num_samples", [1, 7, 16, 101, 128])
@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("split_batches", [False, True])
def test_even_batches_cover_every_sample_and_pad_only_at_the_end(num_samples, num_processes, split_batches):
    batch_size = 6 if split_batches else 8
    per_rank = shards(num_samples, batch_size, num_processes, split_batches=split_batches)
    lengths = {len(batches) for batches in per_rank}
    assert len(lengths) == 1  # every rank takes the same number of steps
    sizes = {len(b) for batches in per_rank for b in batches}
    assert sizes == {batch_size // num_processes if split_batches else batch_size}
    order = gathered(per_rank)
    # The first samples of the gathered stream are exactly the dataset, in order; the rest are duplicates.
    assert order[:num_samples] == list(range(num_samples))
    remainder = num_samples % (batch_size if split_batches else batch_size * num_processes)
    padding = len(order) - num_samples
    assert padding == (
        0 if remainder == 0 else (batch_size if split_batches else batch_size * num_processes) - remainder
    )
    loader = DataLoader(range(num_samples), batch_size=batch_size)
    assert last_batch_remainder(loader, num_processes, split_batches) == remainder
    sampler = BatchSampler(SequentialSampler(range(num_samples)), batch_size, drop_last=False)
    assert len(BatchSamplerShard(sampler, num_processes, 0, split_batches)) == len(per_rank[0])


def test_uneven_batches_are_disjoint_and_complete():
    per_rank = shards(101, 8, 2, even_batches=False)
    flat = [sorted(i for b in batches for i in b) for batches in per_rank]
    assert set(flat[0]).isdisjoint(flat[1])
    assert sorted(flat[0] + flat[1]) == list(range(101))
    assert [len(b) for b in per_rank] == [7, 6]
    sampler = BatchSampler(SequentialSampler(range(101)), 8, drop_last=False)
    assert [len(BatchSamplerShard(sampler, 2, r, even_batches=False)) for r in (0, 1)] == [7, 6]


def test_drop_last_and_split_batches_needs_divisible_batch_size():
    per_rank = shards(90, 8, 2, drop_last=True)
    assert all(len(b) == 8 for batches in per_rank for b in batches)
    assert gathered(per_rank)[:88] == list(range(88))
    assert last_batch_remainder(DataLoader(range(90), batch_size=8, drop_last=True), 2, False) == 8
    with pytest.raises(ValueError, match="divisible"):
        shards(16, 5, 2, split_batches=True)


@pytest.mark.parametrize("even_batches", [True, False])
def test_iterable_dataset_shards(even_batches):
    per_rank = [
        list(IterableDatasetShard(Stream(37), 4, 2, rank, even_batches=even_batches)) for rank in (0, 1)
    ]
    if even_batches:
        assert len(per_rank[0]) == len(per_rank[1]) == 20
        steps = [per_rank[r][k : k + 4] for k in range(0, 20, 4) for r in (0, 1)]
        assert [i for s in steps for i in s][:37] == list(range(37))
    else:
        assert sorted(per_rank[0] + per_rank[1]) == list(range(37))
    assert [len(IterableDatasetShard(Stream(37), 4, 2, r, even_batches=even_batches)) for r in (0, 1)] == [
        len(p) for p in per_rank
    ]


def test_shard_dataloader_keeps_settings():
    loader = DataLoader(
        list(range(20)), batch_size=4, shuffle=True, collate_fn=lambda b: torch.tensor(b) * 10
    )
    shard = shard_dataloader(loader, 2, 1)
    batches = list(shard)
    assert len(shard) == len(batches) == 3 and all(int(b.sum()) % 10 == 0 for b in batches)
    assert shard_dataloader(loader, 1, 0) is loader


def test_a_shuffling_sampler_gets_a_generator_only_where_processes_must_agree_on_it():
    """As Accelerate: one process leaves a shuffling loader drawing from torch's global RNG; several give
    its sampler a generator (seeded from the global RNG) that then decides the order alone."""
    loader = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    assert order_generators(loader, seeded_sampler=False) == ([], True) and loader.sampler.generator is None
    torch.manual_seed(3)
    first = [b.tolist() for b in loader]
    torch.manual_seed(3)
    assert [b.tolist() for b in loader] == first

    (generator,), global_rng = order_generators(loader, seeded_sampler=True)
    assert loader.sampler.generator is generator and global_rng  # the base seed still comes from it
    state = generator.get_state()
    first = [b.tolist() for b in loader]
    generator.set_state(state)
    torch.manual_seed(4)  # the global RNG no longer decides the order
    assert [b.tolist() for b in loader] == first
    own = torch.Generator()
    assert order_generators(DataLoader(list(range(4)), generator=own), seeded_sampler=True) == ([own], False)


def test_skip_batch_sampler():
    sampler = BatchSampler(SequentialSampler(range(10)), 3, drop_last=False)
    skipped = SkipBatchSampler(sampler, 2)
    assert list(skipped) == [[6, 7, 8], [9]] and len(skipped) == 2


def test_skip_first_batches_of_an_iterable_dataset_reads_past_them():
    """An IterableDataset has no sampler to skip in: its first batches are read and dropped, from a plain
    loader and from a prepared one."""
    plain = DataLoader(Stream(10), batch_size=3)
    assert [b.tolist() for b in skip_first_batches(plain, 2)] == [[6, 7, 8], [9]]
    prepared = DataLoaderShard(plain, GradientState())
    skipped = prepared.skip_first_batches(2)
    assert [b.tolist() for b in skipped] == [[6, 7, 8], [9]]
