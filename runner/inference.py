"""The inference path: a model built empty, loaded from `checkpoint=` where the hardware places it, run by
an inference task."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.build import Blueprint, build_data, build_model
from runner.hardware.big_model import BigModel
from runner.hardware.big_modeling import init_empty_weights
from runner.run_dir import RESOLVED
from runner.task import InferenceTask

log = logging.getLogger(__name__)


def infer(
    cfg: DictConfig, output_dir: Path, strategy: BigModel | None = None, blueprint: Blueprint | None = None
) -> dict[str, float]:
    """Build the model on the meta device, load `cfg.checkpoint` into the hardware's device map (`strategy`
    and `blueprint`'s data, when this process built them already), run the task; return its metrics."""
    (output_dir / RESOLVED).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    hardware: BigModel = strategy or instantiate(cfg.hardware)
    hardware.setup_environment()
    data = blueprint.data if blueprint else build_data(cfg)  # the model's dimensions (vocabulary) come from it
    with init_empty_weights():
        model = build_model(cfg, data)
    model = hardware.dispatch(model, cfg.checkpoint, output_dir)
    placement = ", ".join(f"{name or '(all)'}: {device}" for name, device in model.hf_device_map.items())
    log.info("loaded %s from %s; placement %s", type(model).__name__, cfg.checkpoint, placement)
    task: InferenceTask = instantiate(cfg.task)
    return task.run(model)
