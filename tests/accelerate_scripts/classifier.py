"""A training script written for Hugging Face Accelerate, in the style of its examples: a tiny text
classifier with gradient accumulation, clipping and a scheduler; evaluation with multi-process metrics;
tracking; checkpoint and resume; early stopping; automatic batch-size finding; cross-validation folds
split between processes; the profiler; a DDP communication hook; local SGD.

`tests/test_accelerate_compat.py` runs it as written (with `accelerate`) and ported (the module name
`accelerate` replaced by `runner` on its import lines, nothing else), alone and under torchrun, and
compares what each rank writes to `<out>/results_<rank>.json`.

Usage: python classifier.py <out dir>
"""

import json
import logging
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.local_sgd import LocalSGD
from accelerate.logging import get_logger
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    broadcast,
    find_executable_batch_size,
    gather_object,
    pad_across_processes,
    reduce,
    set_seed,
    synchronize_rng_states,
)
from torch.utils.data import DataLoader, TensorDataset

VOCAB, CLASSES, LENGTH = 40, 3, 6
logger = get_logger(__name__)


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, LENGTH), generator=generator)
    return TensorDataset(tokens, tokens[:, 0] % CLASSES)  # the first token decides the class


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(VOCAB, 16)
        self.head = torch.nn.Linear(16, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def train_epoch(accelerator, model, optimizer, scheduler, loader) -> list[float]:
    losses = []
    model.train()
    for tokens, labels in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def main(out: Path) -> None:
    logging.basicConfig(level=logging.INFO)
    accelerator = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        project_config=ProjectConfiguration(project_dir=str(out / "project")),
        log_with=LoggerType.TENSORBOARD,
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=120)),
            DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16),
        ],
    )
    results = {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
    }
    logger.info("training on %d process(es)", accelerator.num_processes, main_process_only=True)

    set_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.8)
    train_loader = DataLoader(dataset(64, seed=1), batch_size=4)
    eval_loader = DataLoader(dataset(13, seed=2), batch_size=4)
    model, optimizer, scheduler, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )
    accelerator.init_trackers("compat", config={"lr": 0.5, "accumulation": 2})
    unwrapped = model.module if hasattr(model, "module") else model
    results["comm_hook"] = model._get_ddp_logging_data().get("comm_hook") if unwrapped is not model else None

    # Training, with a checkpoint after the first epoch; then resuming from it replays the second.
    results["losses"] = train_epoch(accelerator, model, optimizer, scheduler, train_loader)
    checkpoint = accelerator.save_state(str(out / "project" / "epoch_1"))
    second = train_epoch(accelerator, model, optimizer, scheduler, train_loader)
    results["losses"] += second
    for step, loss in enumerate(results["losses"]):
        accelerator.log({"train_loss": loss}, step=step)
    accelerator.load_state(checkpoint)
    results["resumed_losses"] = train_epoch(accelerator, model, optimizer, scheduler, train_loader)
    results["second_epoch_losses"] = second

    # Evaluation: every sample counted once, however the batches were shared out.
    model.eval()
    correct = []
    for tokens, labels in eval_loader:
        with torch.no_grad():
            predictions = model(tokens).argmax(-1)
        correct += accelerator.gather_for_metrics(predictions == labels).tolist()
    results["eval_samples"] = len(correct)
    results["accuracy"] = sum(correct) / len(correct)
    accelerator.log({"accuracy": results["accuracy"]}, step=len(results["losses"]))

    # Early stopping: the last process decides at step 3, every process stops there.
    stopped_at = None
    for step in range(10):
        if step == 3 and accelerator.is_last_process:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break
    results["stopped_at"] = stopped_at

    # Automatic batch size: out of memory above 16 samples.
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def evaluate_with(batch_size):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    results["batch_size"] = evaluate_with()
    results["batch_sizes_tried"] = tried

    # Cross-validation: the folds are split between the processes, the scores gathered.
    state = PartialState()
    with state.split_between_processes(list(range(5))) as folds:
        results["my_folds"] = folds
        scores = [fold * 10 for fold in folds]
    results["all_scores"] = gather_object(scores)
    results["sum_of_ranks"] = reduce(torch.tensor(float(state.process_index + 1)), reduction="sum").item()

    # The profiler, writing a Chrome trace per process.
    with accelerator.profile(ProfileKwargs(output_trace_dir=str(out / "traces"))) as profiler:
        model(torch.zeros(2, LENGTH, dtype=torch.long, device=accelerator.device))
    results["profiled_ops"] = len(profiler.key_averages()) > 0

    # Local SGD: replicas train apart on their own batches, then average every 2 steps and at the end.
    set_seed(1)
    local = Classifier()
    local_optimizer = torch.optim.SGD(local.parameters(), lr=0.5)
    local, local_optimizer = accelerator.prepare(local, local_optimizer)
    shard = dataset(8, seed=3 + accelerator.process_index)  # different data on every process

    def replicas_agree() -> bool:
        weight = accelerator.unwrap_model(local).embed.weight.detach().flatten()
        gathered = accelerator.gather(weight[None])
        return all(torch.equal(gathered[0], other) for other in gathered[1:])

    with LocalSGD(accelerator, local, local_sgd_steps=2) as local_sgd:
        for step in range(3):
            tokens, labels = (t.to(accelerator.device) for t in shard[step * 2 : step * 2 + 2])
            accelerator.backward(torch.nn.functional.cross_entropy(local(tokens), labels))
            local_optimizer.step()
            local_optimizer.zero_grad()
            local_sgd.step()
            results[f"local_replicas_agree_after_step_{step}"] = replicas_agree()
    results["local_replicas_agree_at_exit"] = replicas_agree()

    # Uneven inputs: 5 batches over the processes, the ones done early shadow the others' all-reduces.
    uneven = accelerator.prepare(DataLoader(dataset(10, seed=4), batch_size=2))
    seen = 0
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for tokens, labels in uneven:
            accelerator.backward(torch.nn.functional.cross_entropy(model(tokens), labels))
            optimizer.zero_grad()
            seen += 1
    results["uneven_batches_seen"] = seen

    # Forwards under no_sync; the backward of the second is made to synchronise the gradients.
    tokens, labels = (t.to(accelerator.device) for t in dataset(4, seed=5 + accelerator.process_index)[:])
    with accelerator.no_sync(model):
        loss_a = torch.nn.functional.cross_entropy(model(tokens[:2]), labels[:2])
        loss_b = torch.nn.functional.cross_entropy(model(tokens[2:]), labels[2:])
    accelerator.backward(loss_a)  # local gradients only
    with accelerator.trigger_sync_in_backward(model):
        accelerator.backward(loss_b)  # all-reduces the accumulated gradients
    grads = accelerator.gather(accelerator.unwrap_model(model).head.weight.grad[None])
    results["grads_agree_after_trigger"] = all(torch.allclose(grads[0], g) for g in grads[1:])
    optimizer.zero_grad()

    # The other collectives as functions.
    results["padded_length"] = len(pad_across_processes(torch.arange(state.process_index + 1)))
    results["broadcast"] = broadcast(torch.tensor(float(state.process_index))).item()
    torch.manual_seed(100 + state.process_index)
    synchronize_rng_states(["torch"])
    draws = gather_object([torch.rand(1).item()])
    results["rng_synchronized"] = len(set(draws)) == 1

    accelerator.end_training()
    (out / f"results_{state.process_index}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
