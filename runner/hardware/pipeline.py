"""Pipeline parallel on `torch.distributed.pipelining`: the model's blocks split into stages over the "pp"
dimension of the mesh (`check_pipeline`, `split_stages`), and `PipelinedModel`, which runs a schedule
(GPipe, 1F1B, interleaved 1F1B) of forward and backward over microbatches where the loss is asked for.

A model takes part by declaring `pipeline_stage(blocks, first, last) -> nn.Module`: the module one stage
runs (the embeddings on the first, the blocks numbered `blocks`, the head on the last), holding the model's
own submodules under their names in the model (runner.models.GPT has it).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runner.errors import ConfigError
from runner.hardware.parallelize import blocks_of, sharding_units
from runner.models.decoder_stages import DecoderStage, is_decoder_lm
from runner.ops import apply_to_tensors, find_batch_size
from runner.task import model_inputs

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def check_pipeline(model: nn.Module, pp: int, schedule: str, microbatches: int, virtual_stages: int) -> None:
    """ConfigError for a pipeline that cannot run: a model without stages, more stages than blocks, a
    schedule that does not fit its stages and microbatches."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"hardware.pp_schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}.")
    if microbatches < 1 or virtual_stages < 1:
        raise ConfigError(
            f"hardware.microbatches={microbatches}, hardware.virtual_stages={virtual_stages}: both must be >= 1."
        )
    interleaved = schedule == "interleaved_1f1b"
    if interleaved != (virtual_stages > 1):
        raise ConfigError(
            f"hardware.pp_schedule={schedule} with hardware.virtual_stages={virtual_stages}: "
            + (
                "the interleaved schedule runs several stages per rank; set hardware.virtual_stages >= 2."
                if interleaved
                else "only interleaved_1f1b runs several stages per rank; set hardware.virtual_stages=1 or "
                "hardware.pp_schedule=interleaved_1f1b."
            )
        )
    if stage_builder(model) is None:
        raise ConfigError(
            f"hardware.pp_size={pp}: {type(model).__name__} declares no pipeline stages (a "
            "`pipeline_stage(blocks, first, last)` method returning the module one stage runs, as "
            "runner.models.GPT has; transformers decoder LMs laid out as Llama's are split without one). Add "
            "one, or use hardware.pp_size=1."
        )
    stages, blocks = pp * virtual_stages, len(model_blocks(model))
    if stages > blocks:
        raise ConfigError(
            f"hardware.pp_size={pp} x hardware.virtual_stages={virtual_stages} = {stages} pipeline stages, but "
            f"{type(model).__name__} has {blocks} block(s): each stage needs at least one. Lower them, or use a "
            "deeper model."
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(
            f"hardware.pp_schedule=1f1b with hardware.microbatches={microbatches}: 1F1B needs at least as many "
            f"microbatches as stages ({pp}). Raise hardware.microbatches."
        )
    rounds = max(1, microbatches // pp)
    if interleaved and microbatches % rounds:
        raise ConfigError(
            f"hardware.pp_schedule=interleaved_1f1b with hardware.microbatches={microbatches} over {pp} stages: "
            f"the microbatches must be a multiple of {rounds} (their rounds of {pp}). Use e.g. {rounds * pp}."
        )


def check_microbatches(batch_size: int, microbatches: int) -> None:
    """ConfigError when a batch of `batch_size` rows does not split into `microbatches` equal ones."""
    if batch_size % microbatches:
        raise ConfigError(
            f"hardware.microbatches={microbatches}: a batch of {batch_size} rows per data-parallel rank does "
            "not split into equal microbatches. Use a batch size that is a multiple of it (and "
            "data.drop_last=true if the last batch of an epoch is smaller), or other microbatches."
        )


def stage_builder(model: nn.Module) -> Callable[..., nn.Module] | None:
    """How one stage of `model` is built, `(blocks, first, last) -> module`: the model's own
    `pipeline_stage`, or `DecoderStage` for a transformers decoder LM; None when it has neither."""
    if callable(getattr(model, "pipeline_stage", None)):
        return model.pipeline_stage
    if is_decoder_lm(model):
        return functools.partial(DecoderStage, model)
    return None


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in order (its `_no_split_modules`), which stages split."""
    return blocks_of(model, sharding_units(model, None))


def stage_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Consecutive blocks per stage, as even as can be; the first stages take one more."""
    size, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + size + (stage < extra))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def local_stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages rank `pp_rank` of the pipeline runs: one per round of `pp` (the looped order that the
    interleaved schedule expects)."""
    return [pp_rank + round * pp for round in range(virtual_stages)]


def split_stages(model: nn.Module, pp_rank: int, pp: int, virtual_stages: int) -> dict[int, nn.Module]:
    """This rank's stages of `model`: stage index -> the module it runs (`model.pipeline_stage`)."""
    num_stages = pp * virtual_stages
    ranges, build = stage_blocks(len(model_blocks(model)), num_stages), stage_builder(model)
    assert build is not None, "check_pipeline() first"
    return {
        index: build(ranges[index], first=index == 0, last=index == num_stages - 1)
        for index in local_stage_indices(pp_rank, pp, virtual_stages)
    }


@dataclass(frozen=True)
class Tied:
    """A weight the model ties under several names (`aliases`: an embedding shared with the head), as one
    rank sees it: the `name` its stages hold it under (or the first, when they hold none), its shape, and
    whether that name is the first (`canonical`: the copy whose gradient norm counts)."""

    name: str
    shape: torch.Size
    canonical: bool
    aliases: tuple[str, ...]


def tied_across_stages(model: nn.Module, stages: dict[int, nn.Module]) -> list[Tied]:
    """The model's tied weights, as this rank's `stages` hold them. Called before the split, on every rank
    alike (each all-reduces their gradients over the pipeline)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    shapes = {id(p): p.shape for p in model.parameters()}
    held = {name for stage in stages.values() for name, _ in stage.named_parameters(remove_duplicate=False)}
    tied = []
    for key, aliases in names.items():
        if len(aliases) > 1:
            mine = [name for name in aliases if name in held] or aliases[:1]
            tied.append(Tied(mine[0], shapes[key], mine[0] == aliases[0], tuple(aliases)))
    return tied


def describe_stages(model: nn.Module, pp: int, virtual_stages: int, schedule: str, microbatches: int) -> str:
    """Each stage's rank and modules, and the microbatches whose activations a first-stage rank keeps at
    once (`in_flight`)."""
    num_stages, build = pp * virtual_stages, stage_builder(model)
    assert build is not None, "check_pipeline() first"
    parts = []
    for index, blocks in enumerate(stage_blocks(len(model_blocks(model)), num_stages)):
        stage = build(blocks, first=index == 0, last=index == num_stages - 1)
        others = _outside_blocks(stage, {id(block) for block in model_blocks(model)})
        extra = f" + {', '.join(others)}" if others else ""
        parts.append(f"{index} (pp rank {index % pp}): blocks {blocks.start}-{blocks.stop - 1}{extra}")
    return (
        f"{'; '.join(parts)}. Up to {in_flight(schedule, microbatches, num_stages)} of {microbatches} microbatches' "
        f"activations in flight on the first stage ({schedule})"
    )


def _outside_blocks(module: nn.Module, blocks: set[int], prefix: str = "") -> list[str]:
    """The names of `module`'s top-most submodules that neither are nor hold one of `blocks` (ids)."""
    names = []
    for name, child in module.named_children():
        if id(child) in blocks:
            continue
        if any(id(part) in blocks for part in child.modules()):
            names += _outside_blocks(child, blocks, f"{prefix}{name}.")
        else:
            names.append(f"{prefix}{name}")
    return names


def in_flight(schedule: str, microbatches: int, num_stages: int) -> int:
    """The microbatches whose activations the first stage keeps at once: GPipe all of them, 1F1B one per
    stage (interleaved: per stage of the whole loop)."""
    return microbatches if schedule == "gpipe" else min(microbatches, num_stages)


class PipelinedModel(nn.Module):
    """This rank's stages of a model split for pipeline parallel, under the model's own parameter names (its
    state dict is the model's, restricted to these stages: checkpoints are the model's), and the schedule
    that trains them.

    `training_loss` runs the schedule: forward and backward over `microbatches` slices of the batch, the
    loss computed on the last stage by `loss_fn(outputs, rows of the batch)`; it returns their mean on every
    rank of the pipeline. A call (evaluation, without gradients) runs the stages one after the other on the
    whole batch and gives every rank the outputs. `order`: the model's own submodules' names, in order.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        num_stages: int,
        group: dist.ProcessGroup,
        device: torch.device,
        schedule: str,
        microbatches: int,
        tied: list[Tied],
        tied_shard: Callable[[torch.Size], torch.Size],
        order: list[str],
    ) -> None:
        super().__init__()
        for stage in stages.values():
            _merge_children(self, stage)
        # A tied weight held here also goes under its other names (the head's weight is also the
        # embedding's): the state dicts then key it as the whole model does, first by its first name.
        held = dict(self.named_parameters(remove_duplicate=False))
        for weight in tied:
            if weight.name in held:
                for alias in weight.aliases:
                    if alias not in held:
                        _register_alias(self, alias, held[weight.name])
        self._modules = dict(sorted(self._modules.items(), key=lambda item: order.index(item[0])))
        self._stages = dict(stages)  # a plain dict: their modules are registered once, above
        self.num_stages, self.group, self.device = num_stages, group, device
        self.pp, self.pp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.schedule, self.microbatches = schedule, microbatches
        self._tied = tied
        self._tied_shard = tied_shard
        self._schedules: dict[Any, Any] = {}
        self._step: tuple[Any, Callable[..., torch.Tensor], float, list[torch.Tensor]] | None = None

    @property
    def stage_modules(self) -> dict[int, nn.Module]:
        return self._stages

    def train(self, mode: bool = True) -> PipelinedModel:
        for stage in self._stages.values():
            stage.train(mode)
        return super().train(mode)

    def training_loss(
        self, batch: Any, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], scale: float = 1.0
    ) -> torch.Tensor:
        """Run the schedule on `batch` (forward and backward, gradients times `scale` accumulated into the
        parameters) and return the mean microbatch loss, detached, on every rank of the pipeline."""
        batch_size = find_batch_size(batch)
        assert batch_size is not None, "a batch with no tensors"
        check_microbatches(batch_size, self.microbatches)
        args, kwargs = model_inputs(batch)
        losses: list[torch.Tensor] = []
        self._step = (batch, loss_fn, scale, losses)
        rows = torch.arange(batch_size, device=self.device)
        try:
            schedule = self._schedule_for(args, kwargs)
            if self.pp_rank == 0:
                schedule.step(*args, target=rows, **kwargs)
            else:
                schedule.step(target=rows)
        finally:
            self._step = None
        # The last `microbatches` ones: on its first step the schedule also calls the loss to size buffers.
        mean = (
            torch.stack(losses[-self.microbatches :]).mean()
            if losses
            else torch.zeros((), device=self.device)
        )
        dist.broadcast(mean, group=self.group, group_src=(self.num_stages - 1) % self.pp)
        return mean

    def _microbatch_loss(self, outputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the task's loss on these rows of the batch, divided so that the
        gradients add up to those of the mean over the batch."""
        assert self._step is not None
        batch, loss_fn, scale, losses = self._step
        start, stop = int(rows[0]), int(rows[-1]) + 1
        part = apply_to_tensors(lambda t: t[start:stop] if t.ndim else t, batch)
        loss = loss_fn(outputs, part)
        losses.append(loss.detach().float())
        return loss * (scale / self.microbatches)

    def _schedule_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The schedule for inputs of these shapes (its stages size their buffers on the first step)."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        # Every rank of the pipeline reads the same batches, so all of them know the shapes.
        key = tuple(tuple(t.shape) for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))
        if key not in self._schedules:
            stages = [
                PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                for index, module in self._stages.items()
            ]
            options = {
                "n_microbatches": self.microbatches,
                "loss_fn": self._microbatch_loss,
                "scale_grads": False,
            }
            if self.schedule == "interleaved_1f1b":
                self._schedules[key] = ScheduleInterleaved1F1B(stages, **options)
            else:
                single = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
                self._schedules[key] = single(stages[0], **options)
        return self._schedules[key]

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of weights tied across stages (embedding and head) over the pipeline, so that
        every copy takes the same step. Once per optimizer step."""
        params = dict(self.named_parameters(remove_duplicate=False))
        for tied in self._tied:
            param = params.get(tied.name)
            grad = None if param is None else param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            buffer = (
                local if local is not None else torch.zeros(self._tied_shard(tied.shape), device=self.device)
            )
            dist.all_reduce(buffer, group=self.group)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The outputs of the whole model for these inputs on every rank of the pipeline, the stages run one
        after the other (evaluation: no gradients)."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "Under pipeline parallel (hardware.pp_size > 1) the model trains through its schedule: call "
                "accelerator.training_loss(model, batch, loss_fn) instead of model(...) and a loss; a call to "
                "the model computes outputs for evaluation only, under torch.no_grad()."
            )
        x: torch.Tensor | None = None
        for index in range(self.num_stages):
            owner = index % self.pp
            if index and owner != (index - 1) % self.pp:
                if self.pp_rank == owner:
                    x = self._recv((index - 1) % self.pp)
                elif self.pp_rank == (index - 1) % self.pp:
                    assert x is not None
                    self._send(x, owner)
            if self.pp_rank == owner:
                x = self._stages[index](*args, **kwargs) if index == 0 else self._stages[index](x)
        return self._broadcast(x, (self.num_stages - 1) % self.pp)

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        header = torch.tensor([tensor.ndim, *tensor.shape, _DTYPES.index(tensor.dtype)], device=self.device)
        dist.send(torch.nn.functional.pad(header, (0, 10 - len(header))), group=self.group, group_dst=to)
        dist.send(tensor.contiguous(), group=self.group, group_dst=to)

    def _recv(self, source: int) -> torch.Tensor:
        header = torch.zeros(10, dtype=torch.long, device=self.device)
        dist.recv(header, group=self.group, group_src=source)
        tensor = _empty_from(header, self.device)
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor

    def _broadcast(self, tensor: torch.Tensor | None, source: int) -> torch.Tensor:
        header = torch.zeros(10, dtype=torch.long, device=self.device)
        if self.pp_rank == source:
            assert tensor is not None
            header[: tensor.ndim + 2] = torch.tensor(
                [tensor.ndim, *tensor.shape, _DTYPES.index(tensor.dtype)]
            )
        dist.broadcast(header, group=self.group, group_src=source)
        out = tensor.contiguous() if self.pp_rank == source else _empty_from(header, self.device)
        dist.broadcast(out, group=self.group, group_src=source)
        return out


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim = int(header[0])
    shape = [int(size) for size in header[1 : ndim + 1]]
    return torch.empty(shape, dtype=_DTYPES[int(header[ndim + 1])], device=device)


def _register_alias(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """`param` under `name` in `root`, through bare modules where the path has none."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    module.register_parameter(leaf, param)


def _merge_children(into: nn.Module, stage: nn.Module) -> None:
    """Register `stage`'s submodules in `into` under the same names; containers present in both (the
    blocks) are merged."""
    for name, child in stage.named_children():
        present = into._modules.get(name)
        if present is None:
            into.add_module(name, type(child)() if isinstance(child, nn.ModuleDict) else child)
            present = into._modules[name]
        if isinstance(child, nn.ModuleDict):
            assert isinstance(present, nn.ModuleDict)
            present.update(child)
        else:
            assert present is child, f"two stages hold different modules named {name}"
