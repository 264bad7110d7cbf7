"""The Accelerator against plain PyTorch, in this process (single process, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner import Accelerator, set_seed
from runner.engine.prepared import AcceleratedOptimizer, AcceleratedScheduler
from runner.models import MLP


def make_setup(num_samples: int = 100, batch_size: int = 8):
    set_seed(0)
    model = MLP(in_features=8, out_features=2, hidden_size=32, num_layers=2)
    data = TensorDataset(torch.randn(num_samples, 8), torch.randn(num_samples, 2))
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))
    return model, loader


def make_optimizer(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
    return optimizer, scheduler


def plain_loop(model, loader, accumulation: int, epochs: int = 2):
    optimizer, scheduler = make_optimizer(model)
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / accumulation if accumulation > 1 else loss).backward()
            if (i + 1) % accumulation == 0 or i + 1 == len(loader):
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return model


def accelerated_loop(model, loader, accumulation: int, epochs: int = 2):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    optimizer, scheduler = make_optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return accelerator.unwrap_model(model)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_parameters_bitwise_equal_to_plain_pytorch(accumulation):
    # 100 samples / batch 8 = 13 batches: with accumulation 4 the epoch ends on a partial window,
    # which must still step (end of dataloader) and restart the count for the next epoch.
    model, loader = make_setup()
    reference = plain_loop(copy.deepcopy(model), loader, accumulation)
    _, loader = make_setup()  # same data and shuffling seed, fresh generator
    trained = accelerated_loop(copy.deepcopy(model), loader, accumulation)
    changed = False
    for (name, p), q in zip(reference.named_parameters(), trained.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs from plain PyTorch"
        changed |= not torch.equal(p, dict(model.named_parameters())[name])
    assert changed, "training did not change the parameters: the comparison proves nothing"


def test_accumulation_steps_only_on_sync():
    model, loader = make_setup(num_samples=64, batch_size=8)  # 8 batches, accumulation 4: 2 steps
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    optimizer, scheduler = make_optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    syncs, lrs = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    assert syncs == [False, False, False, True] * 2
    assert len(set(lrs)) == 3  # the initial lr, then two scheduler steps
    assert optimizer.state[next(model.parameters())]["step"] == 2


def test_fp16_inf_gradient_skips_step_halves_scale_and_holds_scheduler():
    model, loader = make_setup()
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    optimizer, scheduler = make_optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    x, y = next(iter(loader))

    def step(inject_inf: bool) -> None:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        if inject_inf:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    step(inject_inf=False)
    assert not accelerator.optimizer_step_was_skipped
    scale = accelerator.precision.scaler.get_scale()
    params = [p.detach().clone() for p in model.parameters()]
    lr, scheduler_steps = scheduler.get_last_lr(), scheduler.last_epoch

    step(inject_inf=True)
    assert accelerator.optimizer_step_was_skipped
    assert accelerator.precision.scaler.get_scale() == scale / 2
    assert all(torch.equal(p, q) for p, q in zip(params, model.parameters(), strict=True))
    assert scheduler.get_last_lr() == lr and scheduler.last_epoch == scheduler_steps

    step(inject_inf=False)
    assert not accelerator.optimizer_step_was_skipped
    assert scheduler.last_epoch == scheduler_steps + 1
    assert not all(torch.equal(p, q) for p, q in zip(params, model.parameters(), strict=True))


@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
def test_backward_passes_its_keyword_arguments_to_the_tensors_backward(mixed_precision):
    model, loader = make_setup()
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model, loader = accelerator.prepare(model, loader)
    x, y = next(iter(loader))
    first, *others = model.parameters()
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss, retain_graph=True, inputs=[first])
    assert first.grad is not None and all(p.grad is None for p in others)  # only `inputs` got gradients
    once = first.grad.clone()
    accelerator.backward(loss)  # the graph was kept: a second backward through it accumulates
    assert torch.allclose(first.grad, 2 * once) and all(p.grad is not None for p in others)


def test_bf16_autocasts_the_forward_returns_fp32_and_loss_falls():
    model, loader = make_setup(num_samples=256, batch_size=32)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    optimizer, _ = make_optimizer(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    inner_dtypes = set()
    model.net[0].register_forward_hook(lambda mod, inp, out: inner_dtypes.add(out.dtype))
    losses = []
    for _ in range(15):
        for x, y in loader:
            out = model(x)
            assert out.dtype == torch.float32
            loss = torch.nn.functional.mse_loss(out, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert inner_dtypes == {torch.bfloat16}
    assert sum(losses[-8:]) / 8 < 0.8 * sum(losses[:8]) / 8
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    inner_dtypes.clear()
    plain(x)
    assert inner_dtypes == {torch.float32}


def test_clip_grad_norm_unscales_fp16_gradients_first():
    model, loader = make_setup()
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    optimizer, _ = make_optimizer(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = next(iter(loader))
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e-3)

    with torch.autocast("cpu", dtype=torch.float16):
        out = reference(x)
    torch.nn.functional.mse_loss(out.float(), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e-3)
    assert torch.allclose(norm, expected, rtol=1e-2)
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped <= 1e-3 * 1.01


def test_clip_grad_value():
    model, loader = make_setup()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    x, y = next(iter(loader))
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y) * 1e3)
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 0.01


def test_prepare_keeps_order_and_wraps_each_kind():
    model, loader = make_setup()
    optimizer, scheduler = make_optimizer(model)
    accelerator = Accelerator(cpu=True)
    marker = object()
    out = accelerator.prepare(scheduler, loader, marker, optimizer, model)
    assert isinstance(out[0], AcceleratedScheduler) and out[0].optimizers == [out[3]]
    assert len(out[1]) == len(loader) and out[2] is marker
    assert isinstance(out[3], AcceleratedOptimizer) and out[4] is model
    assert accelerator.device == torch.device("cpu") and accelerator.num_processes == 1
    assert accelerator.is_main_process and accelerator.process_index == accelerator.local_process_index == 0


def test_dataloader_end_of_epoch_ignores_a_nested_eval_loop():
    model, loader = make_setup(num_samples=32, batch_size=8)  # 4 batches
    eval_loader = DataLoader(TensorDataset(torch.randn(10, 8), torch.randn(10, 2)), batch_size=4)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model, loader, eval_loader = accelerator.prepare(model, loader, eval_loader)
    syncs = []
    for i, _batch in enumerate(loader):
        if i == 1:  # a full eval pass mid-epoch ends *its* loader, not the training one
            assert sum(len(x) for x, _ in eval_loader) == 10
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, True, True]  # the 4th syncs because the training epoch ends


def test_gather_for_metrics_and_reduce_single_process():
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    seen = [accelerator.gather_for_metrics(x) for (x,) in loader]
    assert torch.equal(torch.cat(seen), torch.arange(10.0))
    assert accelerator.reduce(torch.tensor(3.0), "mean") == 3.0
    assert accelerator.reduce({"a": torch.tensor(2.0)}, "sum", scale=0.5)["a"] == 1.0


def test_execution_helpers_and_free_memory(capsys):
    accelerator = Accelerator(cpu=True)
    with accelerator.main_process_first():
        accelerator.print("first")
    assert accelerator.on_main_process(lambda: 7)() == 7
    assert accelerator.on_process(process_index=1)(lambda: 7)() is None
    accelerator.wait_for_everyone()
    assert capsys.readouterr().out == "first\n"
    model, _ = make_setup()
    model = accelerator.prepare(model)
    assert accelerator.free_memory(model) == [None] and accelerator.checkpointer.of_kind("model") == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mixed_precision"):
        Accelerator(mixed_precision="fp4")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=0)
