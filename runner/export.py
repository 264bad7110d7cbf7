"""A run's model as a transformers model dir (`runner export RUN_DIR --to hf OUT`): the weights of its final
`model/` or of one of its checkpoints (any format: full, DCP-sharded, DeepSpeed's partitions), in the
transformers class that computes exactly what runner's model does, with the data's tokenizer; checked by
loading the written dir back with transformers and comparing its logits with runner's model's."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_method, get_object, instantiate
from omegaconf import OmegaConf

from runner.checkpoint.files import atomic_directory, damage, latest_checkpoint, read_meta
from runner.checkpoint.formats import model_weights
from runner.checkpoint.weights import place_weights, read_weights, tensor_aliases, weight_files
from runner.errors import ConfigError, install_command
from runner.hardware.big_modeling import init_empty_weights
from runner.run_dir import CHECKPOINTS, MODEL
from runner.run_dir.state import is_run_dir, run_config

log = logging.getLogger(__name__)

# runner's own model classes -> what makes the transformers model that computes the same (by name:
# transformers, the `hf` extra, is imported by an export only)
LAYOUTS = {"runner.models.gpt.GPT": "runner.models.gpt2_layout.as_gpt2"}
# The model sizes a run may take from its data (`build.model_dims`), found again in the weights' shapes.
DATA_DIMS = ("vocab_size", "num_labels")
PROBES = (7919, 7927)  # primes no model size is: the axes a probe lands on are the data's sizes
BYTE_TOKENS = ("bytes", "chars", "ids")  # data.tokenizer values that name no tokenizer dir (data=tokens)
CHECK_TOKENS = 16
TOLERANCE = {torch.float32: 1e-4}  # of the logits' largest difference; 16-bit weights: 1e-2


@dataclass
class Exported:
    """What `export_hf` wrote and how it checked it."""

    source: Path
    step: int | None
    checkpoint_format: str
    architecture: str
    parameters: int
    dtype: torch.dtype
    tokenizer: str  # the tokenizer dir copied, or why there is none
    max_difference: float  # between transformers' logits and runner's, on CHECK_TOKENS tokens

    def describe(self, out: Path) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        return (
            f"wrote {out}: {self.architecture}, {self.parameters:,} parameters in "
            f"{str(self.dtype).removeprefix('torch.')}, from {self.source} ({self.checkpoint_format}{step})\n"
            f"  tokenizer: {self.tokenizer}\n"
            f"  checked: loaded by transformers, its logits on 1 x {CHECK_TOKENS} tokens are runner's model's "
            f"(largest difference {self.max_difference:.1e})"
        )


def export_hf(
    run_dir: Path, out: Path, checkpoint: Path | None = None, tokenizer: Path | None = None
) -> Exported:
    """Write the model of `run_dir` (its `checkpoint`; None: its final `model/`, else its latest checkpoint)
    into `out` as a transformers model dir, with `tokenizer` (None: the run's `data.tokenizer`). Every
    problem with the input is a ConfigError before anything is written; `out` appears whole or not at all."""
    try:
        import transformers
        from transformers import AutoTokenizer, PreTrainedModel
    except ImportError as err:
        raise ConfigError(
            f"runner export --to hf needs transformers, which is not installed ({err}): {install_command('hf')}"
        ) from err
    settings = _run_settings(run_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"runner export: {out} exists. Give a new directory (nothing is overwritten).")
    model_settings = OmegaConf.create(settings["model"])
    _check_no_adapter(run_dir, model_settings)
    if isinstance(built := get_object(model_settings._target_), type):  # a class: known before building
        _check_exportable(built, model_settings._target_, PreTrainedModel)
    probed = dict(zip(_data_dims(model_settings), PROBES, strict=False))
    probe = _build(model_settings, probed)
    _check_exportable(type(probe), model_settings._target_, PreTrainedModel)
    source, checkpoint_format, step = _weights_source(run_dir, checkpoint)
    tokenizer_dir, tokenizer_note = _tokenizer_of(settings.get("data") or {}, tokenizer)
    weights = _read(source, checkpoint_format)
    model = _build(model_settings, _dims_in(probe, probed, weights))
    tied = {alias for names in tensor_aliases(model).values() for alias in names[1:]}
    try:
        place_weights(model, {name: t for name, t in weights.items() if name not in tied}, source)
    except ValueError as err:  # names or shapes of another model: a checkpoint of another run
        raise ConfigError(f"runner export: {err} Export a checkpoint of this run ({run_dir}).") from err
    model.eval()
    exported = (
        model if isinstance(model, PreTrainedModel) else get_method(LAYOUTS[_class_name(type(model))])(model)
    )
    transformers.utils.logging.disable_progress_bar()
    with atomic_directory(out) as staging:
        exported.save_pretrained(staging)
        if tokenizer_dir is not None:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(staging)
        difference = _largest_difference(model, type(exported).from_pretrained(staging))
        if difference > TOLERANCE.get(next(exported.parameters()).dtype, 1e-2):
            raise RuntimeError(  # a bug of the layout, not of the input: nothing is written
                f"runner export: the {type(exported).__name__} written, loaded by transformers, computes other "
                f"logits than runner's model (largest difference {difference:.3g}); nothing was written to {out}."
            )
    return Exported(
        source=source,
        step=step,
        checkpoint_format=checkpoint_format,
        architecture=type(exported).__name__,
        parameters=sum(p.numel() for p in exported.parameters()),
        dtype=next(exported.parameters()).dtype,
        tokenizer=tokenizer_note,
        max_difference=difference,
    )


def _run_settings(run_dir: Path) -> dict[str, Any]:
    if not is_run_dir(run_dir):
        raise ConfigError(
            f"runner export {run_dir}: not a run's dir (no runner.log in it). Give a run dir, as `runner runs` "
            "lists them."
        )
    settings = run_config(run_dir)
    if not isinstance(settings.get("model"), dict) or "_target_" not in settings["model"]:
        raise ConfigError(f"runner export {run_dir}: its resolved config names no model (model._target_).")
    return settings


def _weights_source(run_dir: Path, checkpoint: Path | None) -> tuple[Path, str, int | None]:
    """Where the weights are, in which format, and the step they are of (None: a final model/)."""
    if checkpoint is None:
        if (run_dir / MODEL).is_dir() and _has_weights(run_dir / MODEL):
            return run_dir / MODEL, "final model", None
        checkpoint = latest_checkpoint(run_dir / CHECKPOINTS)
        if checkpoint is None:
            raise ConfigError(
                f"runner export {run_dir}: the run has no {MODEL}/ and no checkpoint yet. Export it once it has "
                "saved one (trainer.checkpoint_every, trainer.save_model)."
            )
    meta = read_meta(checkpoint, "runner export --checkpoint")
    if problems := damage(checkpoint, meta):
        raise ConfigError(
            f"runner export --checkpoint {checkpoint}: it is damaged: {'; '.join(problems)}. Export another "
            f"checkpoint of the run (--checkpoint {checkpoint.parent}/<name>) or its final {MODEL}/."
        )
    return checkpoint, meta["checkpoint_format"], meta.get("step")


def _has_weights(directory: Path) -> bool:
    try:
        return bool(weight_files(directory))
    except FileNotFoundError:
        return False


def _read(source: Path, checkpoint_format: str) -> dict[str, torch.Tensor]:
    if checkpoint_format == "final model":
        return read_weights(source)
    with warnings.catch_warnings():  # DCP's note that it reads in one process: what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return {name: t.detach() for name, t in model_weights(source, checkpoint_format).items()}


def _data_dims(model_settings: Any) -> list[str]:
    """The sizes the run took from its data: those of DATA_DIMS its model takes and its settings left null;
    a pretrained transformers model's vocabulary is its own (`model.pretrained`: the data had to match it)."""
    parameters = inspect.signature(get_object(model_settings._target_)).parameters
    own = {"vocab_size"} if model_settings.get("pretrained") else set()
    return [name for name in DATA_DIMS if name in parameters and model_settings.get(name) is None and name not in own]


def _build(model_settings: Any, dims: Mapping[str, int]) -> torch.nn.Module:
    """The run's model with `dims`, its weights on the meta device (filled by `place_weights`; a
    transformers model's pretrained weights are not read: the checkpoint's replace them)."""
    parameters = inspect.signature(get_object(model_settings._target_)).parameters
    skip = {"load_weights": False} if "load_weights" in parameters else {}
    with init_empty_weights():
        return instantiate(model_settings, **dims, **skip)


def _check_no_adapter(run_dir: Path, model_settings: Any) -> None:
    if model_settings.get("peft"):
        raise ConfigError(
            f"runner export: {run_dir} trained a PEFT adapter (model.peft), and its {MODEL}/ is that adapter in "
            f"PEFT's layout: PeftModel.from_pretrained(<its base model>, '{run_dir / MODEL}') loads it. For a "
            "transformers model dir with the adapter merged into the weights, train with model.peft.merge=true "
            f"(its {MODEL}/ is then one)."
        )


def _check_exportable(model_class: type, target: str, transformers_class: type) -> None:
    if not issubclass(model_class, transformers_class) and _class_name(model_class) not in LAYOUTS:
        raise ConfigError(
            f"runner export --to hf: the run's model ({target}, {model_class.__name__}) has no transformers "
            "architecture. runner exports transformers models (model=hf_causal_lm, ...) and its GPT (model=gpt, "
            f"as GPT2LMHeadModel); this run's weights are in its {MODEL}/ and checkpoints, for runner's own "
            "loading (checkpoint=<dir>)."
        )


def _class_name(model_class: type) -> str:
    return f"{model_class.__module__}.{model_class.__qualname__}"


def _dims_in(
    probe: torch.nn.Module, probed: Mapping[str, int], weights: Mapping[str, torch.Tensor]
) -> dict[str, int]:
    """The sizes `probed` (name -> the probe value the model was built with), read from the weights'
    shapes on the axes where the probe model's shapes hold the probe value."""
    by_value = {value: name for name, value in probed.items()}
    dims: dict[str, int] = {}
    for tensor, probe_tensor in probe.state_dict().items():
        if tensor in weights:
            for axis, size in enumerate(probe_tensor.shape[: weights[tensor].dim()]):
                if size in by_value:
                    dims.setdefault(by_value[size], weights[tensor].shape[axis])
    if missing := [name for name in probed if name not in dims]:
        raise ConfigError(
            f"runner export: the run took model.{missing[0]} from its data and no weight of the checkpoint "
            f"shows it. Export a run whose model.{missing[0]} is set in its config."
        )
    return dims


def _tokenizer_of(data: Mapping[str, Any], given: Path | None) -> tuple[Path | None, str]:
    """The tokenizer dir to write beside the model (`given`, else the run's `data.tokenizer`), and what
    the export says of it."""
    if given is not None:
        named, key = str(given), "--tokenizer"
    elif isinstance(data.get("tokenizer"), str) and data["tokenizer"] not in BYTE_TOKENS:
        named, key = data["tokenizer"], "the run's data.tokenizer"
    elif data.get("tokenizer") == "ids":
        return None, "none (data.tokenizer=ids: the run's sources were token ids already)"
    elif data.get("tokenizer") == "chars":
        return None, "none (data.tokenizer=chars: a token id indexes the characters in the shards' manifest.json)"
    else:
        return None, "none (the run's data is byte-level: a token id is a byte's value)"
    directory = Path(named).expanduser()
    if not (directory / "tokenizer_config.json").is_file():
        raise ConfigError(
            f"runner export: {key} {named} is not a tokenizer dir here (no tokenizer_config.json in "
            f"{directory.resolve()}). Run the export from the dir the run was launched in, or give the "
            "tokenizer's dir with --tokenizer DIR."
        )
    return directory, str(directory)


def _largest_difference(model: torch.nn.Module, exported: Any) -> float:
    """The largest difference between runner's model's logits and the loaded export's on a fixed sequence."""
    vocab = exported.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        theirs = exported.eval()(ids).logits
    ours = getattr(ours, "logits", ours)
    return (ours.float() - theirs.float()).abs().max().item()
