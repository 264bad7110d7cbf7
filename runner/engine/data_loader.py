"""The dataloader that `Accelerator.prepare` returns, and how one DataLoader is split across processes."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, get_worker_info

from runner.data.base import Stream
from runner.errors import ConfigError
from runner.ops import on_device
from runner.state import GradientState

_END = object()


class BatchSamplerShard(Sampler[list[int]]):
    """The batches of `batch_sampler` that belong to process `process_index` of `num_processes`.

    Without `split_batches` batch i goes to process i % num_processes; with it, every batch is cut into
    `num_processes` equal slices. With `even_batches` the last round is completed with samples from the
    start of the epoch, so that every process gets as many batches, of the same size, as the others
    (`Accelerator.gather_for_metrics` drops those duplicates again).
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        batch_size = getattr(batch_sampler, "batch_size", None)
        if split_batches and batch_size is None:
            raise ValueError("split_batches=True needs a batch sampler with a `batch_size` to split.")
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.source_batch_size = batch_size
        self.batch_size = batch_size and per_process_batch_size(batch_size, num_processes, split_batches)
        # Indices that one round of batches (a batch for each process) holds.
        self.round_size = (self.batch_size or 0) * num_processes

    def __len__(self) -> int:
        batches = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.split_batches:
            return batches
        if self.even_batches:
            return math.ceil(batches / self.num_processes)
        return batches // self.num_processes + int(self.process_index < batches % self.num_processes)

    def __iter__(self) -> Iterator[list[int]]:
        per_round = 1 if self.split_batches else self.num_processes
        first: list[list[int]] = []  # the epoch's first batches: padding for the last round
        current: list[list[int]] = []
        for batch in self.batch_sampler:
            if len(first) < self.num_processes:
                first.append(list(batch))
            current.append(list(batch))
            full = self.source_batch_size is None or len(batch) == self.source_batch_size
            if len(current) == per_round and full:
                yield current[self.process_index] if self.batch_size is None else self._slice(current)
                current = []
        if current:
            yield from self._last_round(current, first)

    def _slice(self, batches: list[list[int]]) -> list[int]:
        """This process's equal share of the round's indices."""
        indices = [i for b in batches for i in b]
        size = len(indices) // self.num_processes
        return indices[self.process_index * size : (self.process_index + 1) * size]

    def _last_round(self, batches: list[list[int]], first: list[list[int]]) -> Iterator[list[int]]:
        if self.batch_size is None:  # whole batches only: repeat the first ones for the missing processes
            padded = batches + list(
                itertools.islice(itertools.cycle(first), self.num_processes - len(batches))
            )
            if self.even_batches or self.process_index < len(batches):
                yield padded[self.process_index]
            return
        indices = [i for b in batches for i in b]
        if self.even_batches:
            head = itertools.cycle([i for b in first for i in b])
            yield self._slice([indices, list(itertools.islice(head, self.round_size - len(indices)))])
        elif self.split_batches:
            size = math.ceil(len(indices) / self.num_processes)
            if own := indices[self.process_index * size : (self.process_index + 1) * size]:
                yield own
        elif self.process_index < len(batches):
            yield batches[self.process_index]

    def set_epoch(self, epoch: int) -> None:
        _set_epoch([self.batch_sampler, getattr(self.batch_sampler, "sampler", None)], epoch)


class IterableDatasetShard(IterableDataset):
    """The samples of an IterableDataset that belong to one process: of each round of `batch_size` x
    `num_processes` samples (`batch_size` with `split_batches`), one contiguous slice per process. With
    `even_batches` an incomplete last round is completed with the epoch's first samples; with `drop_last`
    it is dropped."""

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.drop_last = drop_last
        self.batch_size = per_process_batch_size(batch_size, num_processes, split_batches)
        self.round_size = self.batch_size * num_processes

    def __len__(self) -> int:
        rounds, rest = divmod(len(self.dataset), self.round_size)  # type: ignore[arg-type]
        if rest and not self.drop_last:
            own_rest = min(self.batch_size, max(0, rest - self.process_index * self.batch_size))
            return rounds * self.batch_size + (self.batch_size if self.even_batches else own_rest)
        return rounds * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        start, stop = self.process_index * self.batch_size, (self.process_index + 1) * self.batch_size
        head: list[Any] = []
        current: list[Any] = []
        for sample in self.dataset:
            current.append(sample)
            if len(head) < self.round_size:
                head.append(sample)
            if len(current) == self.round_size:
                yield from current[start:stop]
                current = []
        if current and not self.drop_last:
            if self.even_batches:
                current += list(itertools.islice(itertools.cycle(head), self.round_size - len(current)))
            yield from current[start:stop]

    def set_epoch(self, epoch: int) -> None:
        _set_epoch([self.dataset], epoch)


class Positioned(NamedTuple):
    """A batch of a `Stream`, with the role of the stream that read it and that stream's state after it."""

    batch: Any
    role: int
    state: dict[str, Any]


class PositionedCollate:
    """A `Stream` loader's `collate_fn`: the batch, with where the stream that read it is now (read in the
    loader worker that made the batch, or in this process without workers)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], stream: Stream) -> None:
        self.collate_fn = collate_fn
        self.stream = stream

    def __call__(self, samples: list[Any]) -> Positioned:
        worker = get_worker_info()
        stream = worker.dataset if worker is not None else self.stream
        role, state = stream.position
        return Positioned(self.collate_fn(samples), role, state)

    def __getstate__(self) -> dict[str, Any]:
        return {"collate_fn": self.collate_fn, "stream": None}  # a worker reads its own copy's position


class StreamReading:
    """Where a `Stream` loader's reading streams are: each role's state after the last batch handed out from
    it, and the role whose batch is due next (the loader's workers take turns). What its checkpoint holds."""

    def __init__(self, workers: int, shards: int) -> None:
        self.workers, self.shards = workers, shards
        self.starts: dict[int, dict[str, Any]] = {}
        self.next_role = 0
        self._read: deque[tuple[int, dict[str, Any]]] = deque()  # read ahead, not handed out yet

    def begin(self, stream: Stream) -> None:
        """Before a pass: the stream resumes where the batches handed out left it."""
        self._read.clear()
        stream.start_from(self.starts, self.next_role)

    def batches(self, iterator: Iterator[Positioned], skip: int = 0) -> Iterator[Any]:
        """The batches of `iterator`, their positions kept until they are handed out; the first `skip`
        are read and count as handed out."""
        for item in iterator:
            self._read.append((item.role, item.state))
            if skip:
                skip -= 1
                self.handed_out()
                continue
            yield item.batch

    def handed_out(self) -> None:
        """The oldest batch read is handed out: its stream is past it."""
        role, state = self._read.popleft()
        self.starts[role] = state
        self.next_role = (role + 1) % self.workers

    def state_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "shards": self.shards,
            "starts": dict(self.starts),
            "next": self.next_role,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["workers"], state["shards"]) != (self.workers, self.shards):
            raise ConfigError(
                f"the checkpoint's streamed data was read by {state['shards']} process(es) with {state['workers']} "
                f"loader worker(s) each, this run has {self.shards} with {self.workers}: each reads a stream of its "
                "own, whose position means nothing to another layout. Resume with the same number of processes "
                "and data.num_workers."
            )
        self.starts, self.next_role = dict(state["starts"]), state["next"]
        self._read.clear()


def per_process_batch_size(batch_size: int, num_processes: int, split_batches: bool) -> int:
    """The batch size each process sees: `batch_size`, or its share of it with `split_batches`."""
    if not split_batches:
        return batch_size
    if batch_size % num_processes:
        raise ValueError(
            f"split_batches=True needs a batch size divisible by the {num_processes} processes, "
            f"got batch_size={batch_size}."
        )
    return batch_size // num_processes


class SkipBatchSampler(Sampler[list[int]]):
    """`batch_sampler` without its first `skip` batches (the loader never loads them)."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip
        self.batch_size = getattr(batch_sampler, "batch_size", None)

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        _set_epoch([self.batch_sampler], epoch)


def shard_dataloader(
    dataloader: DataLoader,
    num_processes: int,
    process_index: int,
    split_batches: bool = False,
    even_batches: bool = True,
) -> DataLoader:
    """A DataLoader over this process's share of `dataloader` (the same loader for one process).

    A map-style dataset is sharded through its batch sampler, an IterableDataset sample by sample, and a
    `Stream` splits itself (its batches then carry their position: `Positioned`).
    """
    if isinstance(dataloader.dataset, Stream):
        stream = dataloader.dataset.shard(num_processes, process_index)
        return loader_like(
            dataloader,
            dataset=stream,
            batch_size=per_process_batch_size(dataloader.batch_size or 1, num_processes, split_batches),
            collate_fn=PositionedCollate(dataloader.collate_fn, stream),
        )
    if num_processes == 1:
        return dataloader
    if isinstance(dataloader.dataset, IterableDataset):
        shard = IterableDatasetShard(
            dataloader.dataset,
            dataloader.batch_size or 1,
            num_processes,
            process_index,
            split_batches,
            even_batches,
            dataloader.drop_last,
        )
        return loader_like(
            dataloader, dataset=shard, batch_size=shard.batch_size, drop_last=dataloader.drop_last
        )
    if dataloader.batch_sampler is None:
        raise ValueError(
            "prepare() shards a DataLoader through its batches: give it a batch_size or a batch_sampler "
            "(a DataLoader with batch_size=None cannot be split across processes)."
        )
    shard = BatchSamplerShard(
        dataloader.batch_sampler, num_processes, process_index, split_batches, even_batches
    )
    return loader_like(dataloader, batch_sampler=shard)


def order_generators(dataloader: DataLoader, seeded_sampler: bool) -> tuple[list[torch.Generator], bool]:
    """The RNGs that decide `dataloader`'s order, left as Accelerate (and PyTorch) leave them, so that a
    script draws the same numbers under either: a shuffling RandomSampler without a generator draws its
    seed from torch's global RNG at the start of every pass, unless `seeded_sampler` (several processes
    read the data, or a data seed is set): then it gets a generator, seeded once from the global RNG,
    that the processes synchronise. The loader draws its base seed (its workers') from its own generator,
    else from the global RNG, at the start of every pass.

    Returns the generators of its own (the sampler's, the loader's) and whether a pass also draws from
    torch's global RNG (a resumed pass then replays those draws: `DataLoaderShard`)."""
    sampler = dataloader.sampler
    shuffles_globally = isinstance(sampler, RandomSampler) and sampler.generator is None
    if shuffles_globally and seeded_sampler:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator().manual_seed(seed)
        shuffles_globally = False
    found = [getattr(sampler, "generator", None), dataloader.generator]
    own = list({id(g): g for g in found if g is not None}.values())
    return own, shuffles_globally or dataloader.generator is None


def loader_like(dataloader: DataLoader, **changes: Any) -> DataLoader:
    """A new DataLoader with `dataloader`'s settings (workers, collate_fn, pinning, ...) and `changes`."""
    settings: dict[str, Any] = {
        "dataset": dataloader.dataset,
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    settings |= changes
    if settings["num_workers"] > 0:
        settings.setdefault("prefetch_factor", dataloader.prefetch_factor)
    else:  # loading in this process: no worker settings
        settings["persistent_workers"] = False
    return DataLoader(**settings)


class DataLoaderShard:
    """Iterates this process's DataLoader, puts each batch on the device, knows when it yields the last.

    It reads one batch ahead, so `end_of_dataloader` is already True while the last batch is being used
    (gradient accumulation then syncs on it). Before each pass it calls `synchronize_rng` (the
    Accelerator's: every process then shuffles alike). `len()` is this process's number of batches.
    Attributes it does not define (`dataset`, `batch_size`, `sampler`, ...) are the wrapped loader's.

    Args:
        dataloader: this process's loader (what `shard_dataloader` made).
        gradient_state: the Accelerator's, told which loader is being iterated.
        device: where batches go; None leaves them where the loader puts them.
        remainder: real samples in the last global batch (-1: unknown); what `gather_for_metrics` keeps
            of it while batches are even.
        synchronize_rng: called before each pass over the data.
        skip_batches: batches skipped at the start of every pass (`Accelerator.skip_first_batches`).
        generators: the RNGs of its own that decide the order (`order_generators`).
        global_rng: whether a pass also draws from torch's global RNG (its shuffle's or base seed).
        place: how batches go to `device` (`Strategy.device_batches`); None: `on_device`.
        stateful: resume by itself (`DataLoaderConfiguration(use_stateful_dataloader=True)`, torchdata's
            StatefulDataLoader under Accelerate): after `load_state_dict` the next pass starts after the
            batches the loaded position had handed out (otherwise the caller skips them,
            `skip_first_batches`); its first pass's base seed is drawn when it is made, as there.

    `limit_batches` (None: all) ends every pass after that many batches, the skipped ones counted: its
    last batch is then the pass's last (`end_of_dataloader`, an accumulation syncs on it).

    A loader of a `Stream` resumes by itself too: its position is where each of its streams is, which
    differs between processes (`per_process`).
    """

    def __init__(
        self,
        dataloader: DataLoader,
        gradient_state: GradientState,
        device: torch.device | None = None,
        remainder: int = -1,
        synchronize_rng: Callable[[], None] | None = None,
        skip_batches: int = 0,
        generators: list[torch.Generator] | None = None,
        place: Callable[[Iterator[Any], torch.device], Iterator[Any]] | None = None,
        position: DataLoaderShard | None = None,
        global_rng: bool = False,
        stateful: bool = False,
    ) -> None:
        self.base_dataloader = dataloader
        # Whose position this loader's passes advance: its own, or (`skip_first_batches`) that of the loader
        # it skips in, the one registered for checkpoints.
        self._position = position if position is not None else self
        self.gradient_state = gradient_state
        self.device = device
        self.place = place
        self._remainder = remainder
        self.synchronize_rng = synchronize_rng
        self.skip_batches = skip_batches
        self.generators = generators or []
        self.global_rng = global_rng
        self.stateful = stateful
        dataset = dataloader.dataset
        self.stream = (
            StreamReading(max(1, dataloader.num_workers), dataset.num_shards)
            if isinstance(dataset, Stream)
            else None
        )
        self.limit_batches: int | None = None
        self.end_of_dataloader = False
        self.iteration = 0
        self.batches_yielded = 0  # in the current pass
        self.pass_finished = False  # its last batch handed out (and no pass begun since)
        self._pass_start: list[torch.Tensor] | None = None  # the generators' states when it began
        self._pass_start_global: torch.Tensor | None = None  # and the global RNG's, where it draws from it
        self._replay_global: torch.Tensor | None = None  # a loaded pass's global RNG state at its start
        self.resume_batches = 0  # batches the loaded position had handed out (`load_state_dict`)
        # Where the next pass's iterator draws its base seed from, when not where the pass starts: under
        # Accelerate a stateful loader (torchdata's) makes its first pass's iterator when prepared (Accelerate
        # reads its state_dict()), so that base seed is drawn now; a loaded Accelerate position that had
        # finished its pass draws one more (`resume_at`).
        self._first_iterator: torch.Tensor | None = None
        self._pass_first_iterator: torch.Tensor | None = None  # the current pass's, for its checkpoint
        self._extra_base_seed = False
        if stateful:
            self._first_iterator = _rng_state(dataloader.generator)
            _draw_base_seed(dataloader.generator)

    def __iter__(self) -> Iterator[Any]:
        if self.synchronize_rng is not None:
            self.synchronize_rng()
        position = self._position
        replay, position._replay_global = position._replay_global, None
        resumed, position.resume_batches = (position.resume_batches if self.stateful else 0), 0
        first, self._first_iterator = self._first_iterator, None
        if self._extra_base_seed:  # as torchdata, loading a finished pass: an iterator made and dropped
            self._extra_base_seed = False
            _draw_base_seed(self.base_dataloader.generator)
        position._pass_start = [g.get_state() for g in self.generators]
        position._pass_start_global = replay if replay is not None else self._global_state()
        position._pass_first_iterator = first
        position.batches_yielded = self.skip_batches + resumed
        position.pass_finished = self.end_of_dataloader = False
        self.gradient_state.active_dataloaders.append(self)
        try:
            with _rng_at(None, replay):  # a resumed pass draws what the saved pass drew at its start
                if self.stream is not None:
                    self.stream.begin(self.base_dataloader.dataset)
                with _rng_at(self.base_dataloader.generator, first):
                    iterator = iter(self.base_dataloader)
                sampled = isinstance(self.base_dataloader.batch_sampler, SkipBatchSampler)
                skip = (0 if sampled else self.skip_batches) + resumed
                if self.stream is not None:  # its batches skipped are read, and its position moves on
                    iterator, skip = self.stream.batches(iterator, skip), 0
                if skip:
                    iterator = itertools.islice(iterator, skip, None)
                if self.limit_batches is not None:
                    iterator = itertools.islice(
                        iterator, max(0, self.limit_batches - position.batches_yielded)
                    )
                if self.device is not None:
                    iterator = (self.place or on_device)(iterator, self.device)
                batch = next(iterator, _END)
            stream = self.stream  # read once: this class's `__getattr__` makes every read of self slower
            while batch is not _END:
                upcoming = next(iterator, _END)
                position.pass_finished = self.end_of_dataloader = upcoming is _END
                position.batches_yielded += 1
                if stream is not None:
                    stream.handed_out()
                yield batch
                batch = upcoming
            position.iteration += 1
        finally:
            self.gradient_state.active_dataloaders.remove(self)
            position._pass_start = position._pass_start_global = position._pass_first_iterator = None
            position.batches_yielded = 0

    def _global_state(self) -> torch.Tensor | None:
        """torch's global RNG state, where this loader's passes draw from it (else None)."""
        return torch.get_rng_state() if self.global_rng else None

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: passes done, batches handed out in the current pass, and the generator
        states that pass started from (the current ones between passes); in a pass that drew from torch's
        global RNG, that RNG's state at its start too (between passes the next pass draws from the global
        RNG as the checkpoint restores it)."""
        in_pass = self._pass_start is not None
        states = self._pass_start if in_pass else [g.get_state() for g in self.generators]
        state = {
            "iteration": self.iteration,
            "batches_yielded": self.batches_yielded,
            "generator_states": states,
            "global_rng_state": self._pass_start_global if in_pass else None,
            "first_iterator_rng_state": self._pass_first_iterator if in_pass else self._first_iterator,
        }
        return state if self.stream is None else state | {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position: the next pass draws the order the saved pass drew (from torch's global RNG
        too, as it was at that pass's start, and back to the restored state after). A `stateful` loader
        then skips the batches it had handed out itself; otherwise that is the caller's, with
        `skip_first_batches(loader, state["batches_yielded"])`."""
        if len(state["generator_states"]) != len(self.generators):
            raise ValueError(
                f"the saved dataloader had {len(state['generator_states'])} RNG(s) deciding its order, this one "
                f"has {len(self.generators)}: it is not the same kind of loader."
            )
        self.iteration = state["iteration"]
        self.resume_batches = state["batches_yielded"]
        for generator, saved in zip(self.generators, state["generator_states"], strict=True):
            generator.set_state(saved)
        self._replay_global = state.get("global_rng_state")
        self._first_iterator = state.get("first_iterator_rng_state")
        self._extra_base_seed = False
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])

    @property
    def resumes_itself(self) -> bool:
        """Whether a loaded position's next pass starts after what it had handed out (no caller skips)."""
        return self.stateful or self.stream is not None

    @property
    def per_process(self) -> bool:
        """Whether its position differs between processes (a checkpoint keeps each one's)."""
        return self.stream is not None

    def resume_at(self, batches: int, finished: bool = False) -> None:
        """Continue the current pass after its first `batches` batches, its order drawn afresh: a position
        that records no RNG states (Accelerate's: its resumed pass draws a new shuffle too, with a new
        iterator, and one more before it where the loaded pass had `finished`)."""
        self.resume_batches = batches
        self._replay_global = self._first_iterator = None
        self._extra_base_seed = finished

    def __len__(self) -> int:
        batches = self._whole_pass()
        if self.limit_batches is not None:
            batches = min(batches, self.limit_batches)
        return max(0, batches - self.skip_batches)

    def _whole_pass(self) -> int:
        """Batches in a pass, those skipped included and no limit."""
        batches = len(self.base_dataloader)
        if isinstance(self.base_dataloader.batch_sampler, SkipBatchSampler):
            batches += self.skip_batches  # which its sampler leaves out
        return batches

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (-1: unknown); 0 (all real) where `limit_batches` ends
        the pass before its last batch."""
        cut = self.limit_batches is not None and self.limit_batches < self._whole_pass()
        return 0 if cut and self._remainder != -1 else self._remainder

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler (and a dataset that wants it) which epoch starts, so shuffles differ per epoch."""
        self.iteration = epoch
        loader = self.base_dataloader
        _set_epoch([loader.sampler, loader.batch_sampler, loader.dataset], epoch)

    def _shard(self) -> BatchSamplerShard | IterableDatasetShard | None:
        """What splits the data between processes (None: one process reads it all)."""
        sampler = self.base_dataloader.batch_sampler
        while isinstance(sampler, SkipBatchSampler):
            sampler = sampler.batch_sampler
        for candidate in (sampler, self.base_dataloader.dataset):
            if isinstance(candidate, (BatchSamplerShard, IterableDatasetShard)):
                return candidate
        return None

    @property
    def even_batches(self) -> bool:
        """Whether every process gets as many batches (the last round completed from the start)."""
        shard = self._shard()
        return shard.even_batches if shard is not None else True

    @contextmanager
    def even_batches_set_to(self, even_batches: bool) -> Iterator[None]:
        """Inside: this loader's processes get even batches or not (`Accelerator.join_uneven_inputs`)."""
        shard = self._shard()
        if shard is None:
            yield
            return
        before, shard.even_batches = shard.even_batches, even_batches
        try:
            yield
        finally:
            shard.even_batches = before

    def skip_first_batches(self, num_batches: int) -> DataLoaderShard:
        """This loader, minus the first `num_batches` batches of each pass (a map-style loader never
        loads them). Its passes advance this loader's position: a checkpoint saved while it runs records
        where the pass is (the batches skipped included), so a run resumed twice resumes right."""
        loader = self.base_dataloader
        if _samples_by_index(loader):
            loader = loader_like(loader, batch_sampler=SkipBatchSampler(loader.batch_sampler, num_batches))
        skipping = DataLoaderShard(
            loader,
            self.gradient_state,
            self.device,
            self._remainder,
            self.synchronize_rng,
            num_batches,
            self.generators,
            self.place,
            position=self._position,
            global_rng=self.global_rng,
            stateful=self.stateful,
        )
        skipping.stream = self.stream  # a stream's batches skipped are read, and its position moves on
        skipping.limit_batches = self.limit_batches
        return skipping

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader":  # not yet set (unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)


def _rng_state(generator: torch.Generator | None) -> torch.Tensor:
    """The state of `generator` (None: torch's global RNG)."""
    return generator.get_state() if generator is not None else torch.get_rng_state()


def _draw_base_seed(generator: torch.Generator | None) -> None:
    """The draw a DataLoader iterator makes when it is made: its workers' base seed, from the loader's
    generator (None: torch's global RNG)."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)


@contextmanager
def _rng_at(generator: torch.Generator | None, state: torch.Tensor | None) -> Iterator[None]:
    """Inside: `generator` (None: torch's global RNG) at `state` (None: as it is); after: as it was."""
    if state is None:
        yield
        return
    before = _rng_state(generator)
    (generator.set_state if generator is not None else torch.set_rng_state)(state)
    try:
        yield
    finally:
        (generator.set_state if generator is not None else torch.set_rng_state)(before)


def skip_first_batches(dataloader: DataLoader | DataLoaderShard, num_batches: int = 0) -> Any:
    """`dataloader` without its first `num_batches` batches (a map-style loader never loads them):
    Accelerate's function, for prepared loaders and plain ones alike."""
    if isinstance(dataloader, DataLoaderShard):
        return dataloader.skip_first_batches(num_batches)
    if not _samples_by_index(dataloader):
        return itertools.islice(dataloader, num_batches, None)
    return loader_like(dataloader, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches))


def _samples_by_index(dataloader: DataLoader) -> bool:
    """Whether `dataloader`'s batches are drawn by a batch sampler (map-style, batched): skipping batches
    there skips their indices; an IterableDataset's are read and dropped."""
    return dataloader.batch_sampler is not None and not isinstance(dataloader.dataset, IterableDataset)


def last_batch_remainder(dataloader: DataLoader, num_processes: int, split_batches: bool) -> int:
    """Real samples in the last global batch of `dataloader` once sharded (0: it is full; -1: unknown)."""
    batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
    try:
        samples = len(dataloader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return -1
    if batch_size is None:
        return -1
    global_batch = batch_size if split_batches else batch_size * num_processes
    if dataloader.drop_last:
        dropped_to = global_batch if isinstance(dataloader.dataset, IterableDataset) else batch_size
        samples = samples // dropped_to * dropped_to
    return samples % global_batch


def _set_epoch(objects: list[Any], epoch: int) -> None:
    for obj in objects:
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
