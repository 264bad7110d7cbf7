"""`python -m runner`: compose the config with Hydra, validate it, train, return the metrics."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner.config import register_configs
from runner.errors import ConfigError, describe_compose_error
from runner.train import train
from runner.validate import validate

log = logging.getLogger("runner")

# The repository's conf/ (runner is installed editable, next to it).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> dict[str, float]:
    """One job: its output dir is Hydra's; the returned metrics go to Hydra's sweepers."""
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
        metrics = train(cfg, output_dir)
    except (ConfigError, InstantiationException) as err:
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else err
        log.error("Configuration error: %s", cause)
        sys.exit(2)
    log.info("final metrics (output dir %s):\n%s", output_dir, _table(metrics))
    return metrics


def run() -> None:
    """Console entry point: composition errors become one paragraph on stderr and exit code 2."""
    register_configs()
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra raise instead of printing its own report
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        print(f"Configuration error: {describe_compose_error(err)}", file=sys.stderr)
        sys.exit(2)


def _table(metrics: dict[str, float]) -> str:
    width = max(map(len, metrics), default=0)
    return "\n".join(f"  {name:<{width}}  {value:.6g}" for name, value in metrics.items())
