"""The inference path: a model built empty, loaded from `checkpoint=` where the hardware places it, run by
an inference task."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.big_modeling import init_empty_weights
from runner.hardware.big_model import BigModel
from runner.task import InferenceTask
from runner.train import model_dims

log = logging.getLogger(__name__)


def infer(cfg: DictConfig, output_dir: Path) -> dict[str, float]:
    """Build the model on the meta device, load `cfg.checkpoint` into the hardware's device map, run the
    task; return its metrics."""
    (output_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    hardware: BigModel = instantiate(cfg.hardware)
    hardware.setup_environment()
    data = instantiate(cfg.data)
    data.setup()  # the model's dimensions (vocabulary) come from the data
    with init_empty_weights():
        model = instantiate(cfg.model, **model_dims(cfg.model, data.dims))
    model = hardware.dispatch(model, cfg.checkpoint, output_dir)
    placement = ", ".join(f"{name or '(all)'}: {device}" for name, device in model.hf_device_map.items())
    log.info("loaded %s from %s; placement %s", type(model).__name__, cfg.checkpoint, placement)
    task: InferenceTask = instantiate(cfg.task)
    return task.run(model)
