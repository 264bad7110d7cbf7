"""`runner prepare-data <overrides>`: compose the config as `python -m runner <overrides>` would and write
its data's token shards (`data=tokens`: `TokenShards.prepare`), so that the run's own overrides prepare
its data."""

from __future__ import annotations

import sys

from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from hydra.utils import instantiate

from runner.compose import CONFIG_NAME, check_config_dirs, command_hydra, user_config_dirs
from runner.errors import ConfigError, DataNotPrepared, write_failure
from runner.validate import missing_values


def main(arguments: list[str]) -> None:
    """Prepare the data the config `arguments` compose; print what was written."""
    args = get_args_parser().parse_args(arguments)
    check_config_dirs(user_config_dirs(args))
    hydra = command_hydra(args.config_dir)
    try:
        cfg = hydra.compose_config(args.config_name or CONFIG_NAME, args.overrides, run_mode=RunMode.RUN)
    finally:
        GlobalHydra.instance().clear()
    missing = missing_values(cfg.data)
    if missing:
        raise ConfigError(" ".join(missing))
    data = instantiate(cfg.data)
    if not hasattr(data, "prepare"):
        raise ConfigError(
            f"data={cfg.hydra.runtime.choices.get('data')} ({cfg.data._target_}) reads its files as they are; "
            "there is nothing to prepare. `runner prepare-data` writes the token shards of data=tokens."
        )
    try:
        manifest = data.prepare(progress=sys.stderr.isatty())
    except OSError as err:
        if (reason := write_failure(err)) is None:
            raise
        raise DataNotPrepared(
            f"runner prepare-data could not write to {cfg.data.path}: {reason}. Free space or fix the permissions "
            "there, or give another data.path; the shards it finished are whole and kept, and the same command "
            "goes on from them."
        ) from None
    print(
        f"{cfg.data.path}: {manifest.tokens:,} tokens in {manifest.documents:,} documents, "
        f"{len(manifest.shards)} shard(s) of {manifest.dtype}, vocabulary {manifest.vocab_size} "
        f"(tokenizer {manifest.tokenizer})."
    )
