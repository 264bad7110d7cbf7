"""The resume policy: which checkpoint a run continues from (`trainer.resume`: null, auto, a directory),
whether it fits this run (format, ranks, data layout, optimizer), what a resumed run keeps from its
config (the learning rate), what a diverged run is told to resume from (`last_finite`), and what a run
finds in the dir of a finished one (`check_finished_run`, against the record `runner.run_dir` keeps):
nothing to train when its settings are the same, a refusal when they differ; its results are never
replaced unasked.

Checked once before any rank starts (`check_resume`, from the launching process) and again by every
rank's `Checkpointer.load`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from runner.checkpoint.files import (
    DAMAGED,
    damage,
    latest_checkpoint,
    mark_latest,
    numbered_checkpoints,
    read_meta,
)
from runner.checkpoint.formats import model_shapes
from runner.errors import ConfigError
from runner.run_dir import (
    CHECKPOINTS,
    FINISHED_RECORD,
    JOB_CONFIG_DIR,
    LAST_FINITE,
    RESOLVED,
    RESULTS,
    FinishedRun,
    finished_run,
    flat_settings,
    last_written,
    move_aside,
    settings_digest,
)

log = logging.getLogger(__name__)

LAST = "last"  # trainer.resume=last: the latest run of the same experiment, in its own dir


@dataclass(frozen=True)
class LatestRun:
    """`trainer.resume=last`'s choice: the run dir, when it last wrote (seconds since the epoch) and what
    (its log or its newest checkpoint), and the next newest run of the experiment (None: it was the only
    one)."""

    run_dir: Path
    written: float
    what: str
    runner_up: Path | None = None


def latest_run(runs_dir: Path, experiment: str | None) -> LatestRun | None:
    """The run dir in `runs_dir` whose command chose the same `experiment=` (None: none) and that wrote last
    (`last_written`: by time, not by the dir's name, which may be any), or None. A ConfigError when two
    such runs wrote last at the same moment (a copied dir): which one is meant cannot be told."""
    written: list[tuple[float, str, Path]] = []
    for run in (d for d in runs_dir.glob("*") if d.is_dir()):
        overrides = run / JOB_CONFIG_DIR / "overrides.yaml"
        if not overrides.is_file():
            continue
        chosen = [
            o.split("=", 1)[1]
            for o in yaml.safe_load(overrides.read_text()) or []
            if o.startswith("experiment=")
        ]
        if (chosen[-1] if chosen else None) == experiment and (when := last_written(run)) is not None:
            written.append((*when, run))
    if not written:
        return None
    written.sort(key=lambda entry: entry[0], reverse=True)
    (newest, what, run), *older = written
    if older and older[0][0] == newest:
        raise ConfigError(
            f"trainer.resume=last: {run} and {older[0][2]} were last written at the same moment "
            f"({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(newest))}), so which run is the latest cannot be "
            "told. Resume one of them by its dir: trainer.resume=auto hydra.run.dir=<the run's dir>."
        )
    return LatestRun(run, newest, what, older[0][2] if older else None)


def damaged_error(checkpoint: Path, problems: list[str], key: str = "trainer.resume") -> ConfigError:
    return ConfigError(
        f"{key}: {checkpoint} is damaged: {'; '.join(problems)}. It cannot be resumed. Resume from another "
        f"checkpoint of the run (trainer.resume=<dir>), or start fresh with trainer.resume=null."
    )


def resume_checkpoint(resume: str | None, output_dir: Path, verify: bool = False) -> Path | None:
    """The checkpoint `trainer.resume` asks for: None (start fresh), "auto" (the output dir's latest, if
    any: a re-run or requeued job continues), or a checkpoint directory, which must exist.

    With `verify` (the launching process, before any rank starts), its files are checked against its
    metadata: an explicit checkpoint that is damaged is refused; for "auto", a damaged latest is moved
    aside (`checkpoint_<n>.damaged`, nothing is deleted) with a warning, and the newest whole checkpoint
    becomes the latest."""
    if resume is None:
        return None
    if resume != "auto":
        checkpoint = Path(resume)
        meta = read_meta(checkpoint)
        if verify and (problems := damage(checkpoint, meta)):
            raise damaged_error(checkpoint, problems)
        return checkpoint
    checkpoints_dir = output_dir / CHECKPOINTS
    latest = latest_checkpoint(checkpoints_dir)
    if not verify or latest is None:
        return latest
    older = [path for path in reversed(numbered_checkpoints(checkpoints_dir)) if path != latest]
    for candidate in [latest, *older]:
        try:
            problems = damage(candidate, read_meta(candidate))
        except ConfigError as err:
            problems = [str(err).split(": ", 1)[-1]]
        if not problems:
            if candidate != latest:
                mark_latest(candidate)
            return candidate
        aside = candidate.with_name(candidate.name + DAMAGED)
        if candidate.is_dir():
            candidate.rename(aside)
        log.warning(
            "trainer.resume=auto: %s cannot be resumed (%s); moved it to %s and trying the checkpoint before it.",
            candidate,
            "; ".join(problems),
            aside,
        )
    raise ConfigError(
        f"trainer.resume=auto: no checkpoint in {checkpoints_dir} is whole (the damaged ones were moved aside "
        f"as checkpoint_<n>{DAMAGED}). Start fresh with trainer.resume=null, or resume from a copy you trust "
        "(trainer.resume=<dir>)."
    )


def check_checkpoint_fits(
    checkpoint: Path,
    world_size: int,
    checkpoint_format: str,
    key: str = "trainer.resume",
    reshards: bool = False,
    readers: int | None = None,
    split_batches: bool = False,
) -> dict[str, Any]:
    """The checkpoint's metadata, or a ConfigError naming `key` when this hardware cannot read its model
    state (another `Strategy.checkpoint_format`), or cannot on this many ranks (a format that does not
    `reshards` onto another layout), or when its data positions mean something else here: `readers`
    (this run's data-parallel ranks; None: no data position to restore) differ from the writer's, and
    the batch size is not the global one in both runs (`split_batches`). Checked before any rank starts
    and again by `Accelerator.load_state`."""
    meta = read_meta(checkpoint, key=key)
    check_format(checkpoint, meta, checkpoint_format)
    written_by = meta["num_processes"]
    if written_by != world_size and not reshards:
        raise ConfigError(
            f"{key}: {checkpoint} was written by {written_by} process(es) and this run has {world_size}; "
            f"its {checkpoint_format!r} model state does not reshard onto another number of ranks (the sharded "
            f"checkpoints of hardware=fsdp and tensor_parallel do). Resume with {written_by} process(es) "
            f"(hardware.num_processes={written_by} from the command line), or start fresh (trainer.resume=null)."
        )
    written_readers = meta.get("data_parallel_size", written_by)
    if (
        readers is not None
        and written_readers != readers
        and not (split_batches and meta.get("split_batches"))
    ):
        raise ConfigError(
            f"{key}: {checkpoint} was written by {written_readers} data-parallel rank(s) and this run has "
            f"{readers}: with a batch size per rank, the global batch and so each rank's data position would "
            "change. Resharding a run onto another layout needs trainer.split_batches=true (data.batch_size is "
            f"the global batch) in the run that wrote it and in this one; else resume with {written_readers} "
            "data-parallel rank(s)."
        )
    return meta


def check_model_fits(checkpoint: Path, checkpoint_format: str, model: torch.nn.Module) -> None:
    """ConfigError when the model state in `checkpoint` is another model's than `model` (the run's, on
    meta): a tensor of another shape under one of its names, or none of its names. Read from the files'
    headers, before any rank starts; the ranks' load would fail on it."""
    stored = model_shapes(checkpoint, checkpoint_format)
    if not stored:
        return
    own = {name: tuple(tensor.shape) for name, tensor in model.state_dict(keep_vars=True).items()}
    wrong = [
        f"{name} {stored[name]} there, {shape} here"
        for name, shape in own.items()
        if stored.get(name, shape) != shape
    ]
    if not wrong and own.keys() & stored.keys():
        return
    found = (
        f"another shape: {'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"
        if wrong
        else f"none of its tensor names is the model's (it has {', '.join(sorted(stored)[:3])}, ...)"
    )
    raise ConfigError(
        f"trainer.resume: {checkpoint} holds the state of another model than this run's {type(model).__name__} "
        f"({found}). Resume with the model settings it was written with, or start fresh (trainer.resume=null)."
    )


def check_optimizer_classes(checkpoint: Path, meta: dict[str, Any], classes: list[str]) -> None:
    """Refuse a checkpoint whose optimizer state another kind of optimizer wrote (`classes`: this run's,
    as "module.QualName"); checkpoints of earlier versions do not record theirs."""
    written_with = meta.get("optimizer_classes")
    if written_with is not None and written_with != classes:
        raise ConfigError(
            f"{checkpoint} holds the state of optimizer(s) {', '.join(written_with)} and this run has "
            f"{', '.join(classes)}: an optimizer's state does not carry over to another kind. Resume with the optimizer "
            "it was written with, or start fresh (trainer.resume=null)."
        )


def check_format(checkpoint: Path, meta: dict[str, Any], checkpoint_format: str) -> None:
    """Refuse a checkpoint whose models and optimizers were written in another format than this
    hardware's (whole-model safetensors, sharded DCP, DeepSpeed partitions)."""
    written_as = meta.get("checkpoint_format", "full")
    if written_as != checkpoint_format:
        raise ConfigError(
            f"{checkpoint} holds {written_as!r} model state and this run's hardware reads "
            f"{checkpoint_format!r} checkpoints. Resume it with the hardware group that wrote it (see its run's "
            "resolved_config.yaml), or start fresh with trainer.resume=null."
        )


def qualified_name(obj: Any) -> str:
    """ "module.QualName" of `obj`'s class (of `obj` itself when it is a class): how a checkpoint records
    its optimizers."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_resume(
    resume: str | None,
    output_dir: Path,
    *,
    world_size: int,
    checkpoint_format: str,
    reshards: bool,
    readers: int,
    split_batches: bool,
    optimizer_class: type | None,
    verify: bool,
    settings: dict[str, Any] | None = None,
    max_steps: int | None = None,
    model: torch.nn.Module | None = None,
    data_identity: str | None = None,
) -> Path | None:
    """Before any rank starts: the checkpoint `trainer.resume` names (see `resume_checkpoint`; `verify`
    reads its files), refused with a ConfigError when it does not fit this run (`check_checkpoint_fits`),
    holds another optimizer's state (`optimizer_class`: the run's; None for inference), was written
    by a run with other data (`settings`: this run's resolved config, `data_identity` what its data source
    read; see `check_same_data`), holds
    another model's state than `model` (the run's on meta; `check_model_fits`), or is past `max_steps`
    (`check_not_past`; a length in epochs is checked once the ranks know the data)."""
    checkpoint = resume_checkpoint(resume, output_dir, verify=verify)
    if checkpoint is not None and settings is not None:
        check_same_data(checkpoint, settings, data_identity)
    if checkpoint is not None:
        meta = check_checkpoint_fits(
            checkpoint,
            world_size,
            checkpoint_format,
            reshards=reshards,
            readers=readers,
            split_batches=split_batches,
        )
        if model is not None:
            check_model_fits(checkpoint, checkpoint_format, model)
        if optimizer_class is not None:
            check_optimizer_classes(checkpoint, meta, [qualified_name(optimizer_class)])
        if max_steps is not None and "micro_step" in meta:  # earlier versions recorded micro-batches only
            check_not_past(checkpoint, meta["step"], max_steps)
    return checkpoint


def check_not_past(checkpoint: Path | str, step: int, total_steps: int) -> None:
    """ConfigError when `checkpoint`, written at `step`, is past this run's `total_steps`: the run would
    train nothing and report that step's results as its own."""
    if step > total_steps:
        raise ConfigError(
            f"trainer.max_steps={total_steps}: {checkpoint} was written at step {step}, past it, so this run "
            f"would train nothing and report that step's results as its own. Set trainer.max_steps>={step} to "
            "continue it, or start a new run (another hydra.run.dir, or trainer.resume=null)."
        )


# Data settings that change neither the samples nor their order: a resumed run may change them.
NOT_ORDER = ("data.num_workers", "data.eval_batch_size")


def check_same_data(checkpoint: Path, settings: dict[str, Any], identity: str | None = None) -> None:
    """ConfigError when the run that wrote `checkpoint` (its run dir's resolved config) read other data
    than `settings` say: another file or batch size would give the saved loader position other samples,
    and the run would go on silently on a different stream. Checkpoints outside a run dir pass. Or when
    the data's contents (`identity`, `DataSource.identity`) are not those the checkpoint records."""
    recorded = read_meta(checkpoint).get("facts", {}).get("data")
    if identity is not None and recorded is not None and recorded != identity:
        raise ConfigError(
            f"trainer.resume: {checkpoint} was written by a run that read other data: the token shards at data.path "
            "are not those it trained on (another corpus, or prepared again since; their checksums differ), so its "
            "position in the data would pick other samples here. Resume with the shards it was written with, or start "
            "a new run (another hydra.run.dir, or trainer.resume=null)."
        )
    written = checkpoint.parent.parent / RESOLVED
    if not written.is_file():
        return
    before = yaml.safe_load(written.read_text()) or {}
    changes = [
        change
        for change in _differences(
            flat_settings(before.get("data") or {}, "data"), flat_settings(settings.get("data") or {}, "data")
        )
        if change.split("=", 1)[0] not in NOT_ORDER
    ]
    if changes:
        raise ConfigError(
            f"trainer.resume: {checkpoint} was written by a run that read other data ({'; '.join(changes[:5])}): "
            "its position in the data would pick other samples here. Resume with its data settings, or start a new "
            "run (another hydra.run.dir, or trainer.resume=null); continue from its weights with "
            "checkpoint=<a model dir> if that is what you want."
        )


def check_finished_run(
    output_dir: Path,
    settings: dict[str, Any],
    resume: str | None,
    overwrite: bool,
    dry_run: bool = False,
) -> FinishedRun | None:
    """What a training run with `settings` (the resolved config) may do in the dir of a finished one,
    whose results (`metrics.json`, `model/`, its checkpoints) it would replace. The same settings and
    `resume` null or auto: the FinishedRun (nothing to train; none of its checkpoints, which may be older
    than its end, resumes). Other settings, or a checkpoint named in `resume`: a ConfigError naming them
    and the ways out. With `overwrite`: its files are moved into `replaced-<time>/` (not with `dry_run`:
    plan=true) and None is returned, as in a dir without a finished run."""
    finished = finished_run(output_dir)
    if finished is None:
        return None
    changes = _changes_since(finished, settings)
    shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    named = resume not in (None, "auto")
    longer = resume == "auto" and changes and _only_longer(changes, finished, settings)
    if longer and _continues(finished, settings, shown, overwrite, dry_run):
        return None
    if not overwrite:
        _refuse_replacing(finished, changes, shown, resume if named else None)
        return finished
    if named and Path(resume).resolve().is_relative_to(output_dir.resolve()):  # type: ignore[arg-type]
        raise ConfigError(
            f"trainer.resume={resume} lies in the dir of the finished run that trainer.overwrite=true moves into "
            f"{output_dir}/replaced-<time>/. Continue from it in a new dir instead (hydra.run.dir=<new dir>), "
            "without trainer.overwrite."
        )
    if dry_run:
        return None
    aside = move_aside(output_dir)
    log.warning(
        "trainer.overwrite=true: the finished run in %s%s moved to %s",
        output_dir,
        f" ({shown})" if shown else "",
        aside,
    )
    return None


def _continues(
    finished: FinishedRun, settings: dict[str, Any], shown: str, overwrite: bool, dry_run: bool
) -> bool:
    """A run that trains a finished one longer (`trainer.resume=auto`): whether it continues from the
    finished run's checkpoint of its last step, which must be the latest (its results moved aside, unless
    `dry_run`); otherwise a ConfigError, or False with `overwrite` (it starts over)."""
    output_dir = finished.output_dir
    latest = latest_checkpoint(output_dir / CHECKPOINTS)
    if finished.final_checkpoint is not None and finished.final_checkpoint == latest:
        # trainer.resume=auto takes its checkpoint of that step; its results are kept, not replaced
        kept = "" if dry_run else f": its results ({', '.join(RESULTS)}) moved to {move_aside(output_dir, RESULTS)}"
        length = settings.get("trainer", {})  # type: ignore[union-attr]
        steps = length.get("max_steps") or f"{length.get('max_epochs')} epochs'"
        log.warning(
            "continuing the run that finished at step %s (%s)%s; the learning-rate schedule is recomputed for "
            "%s steps, so from its checkpoint on the rates follow the longer schedule, not the finished one's.",
            finished.step,
            shown,
            kept,
            steps,
        )
        return True
    if overwrite:
        return False
    older = f"its latest checkpoint, {latest}, is older than its end" if latest else "it has no checkpoint"
    raise ConfigError(
        f"{finished.describe()}; this run trains longer ({shown}), but {older}: it would train again from "
        "there and replace the finished results, so nothing was run. Continue from that checkpoint in a new "
        "dir (trainer.resume=<its checkpoint> hydra.run.dir=<new dir>), or set trainer.overwrite=true to move "
        "its files into replaced-<time>/ and start over here. A run that writes a checkpoint at its last step "
        "(trainer.checkpoint_every dividing trainer.max_steps) can be continued in its dir."
    )


def _refuse_replacing(finished: FinishedRun, changes: list[str], shown: str, named: str | None) -> None:
    """Without trainer.overwrite: a ConfigError for a run with other settings (`changes`) or from a named
    checkpoint (`named`) in the dir of a finished one, whose results it would replace."""
    ways_out = (
        "Start the new run in another dir (leave hydra.run.dir out, or give another one); continue the finished "
        "one from a checkpoint in a new dir (trainer.resume=<its checkpoints/checkpoint_n> hydra.run.dir=<new "
        "dir>); or set trainer.overwrite=true to move its files into replaced-<time>/ and run here."
    )
    if changes:
        raise ConfigError(
            f"{finished.describe()} with other settings ({shown}); this run would replace its results, so "
            f"nothing was run. {ways_out}"
        )
    if named:
        raise ConfigError(
            f"trainer.resume={named}: {finished.describe()}; training again from that checkpoint would replace "
            f"its results, so nothing was run. {ways_out}"
        )


LENGTH = ("trainer.max_steps", "trainer.max_epochs")  # a finished run given more of these trains on


def _only_longer(changes: list[str], finished: FinishedRun, settings: dict[str, Any]) -> bool:
    """Whether the only `changes` since the finished run are a larger trainer.max_steps or max_epochs."""
    written = finished.output_dir / RESOLVED
    before = flat_settings((yaml.safe_load(written.read_text()) or {}) if written.is_file() else {})
    now = flat_settings(settings)
    changed = {change.split("=", 1)[0] for change in changes}
    return changed <= set(LENGTH) and all(
        isinstance(now.get(key), int) and isinstance(before.get(key), int) and now[key] > before[key]
        for key in changed
    )


def _changes_since(finished: FinishedRun, settings: dict[str, Any]) -> list[str]:
    """The result-making settings that differ between the finished run (its resolved config) and
    `settings`: empty when its recorded digest is theirs."""
    record = finished.output_dir / FINISHED_RECORD
    if record.is_file() and json.loads(record.read_text())["settings_digest"] == settings_digest(settings):
        return []
    written = finished.output_dir / RESOLVED
    before = (yaml.safe_load(written.read_text()) or {}) if written.is_file() else {}
    changes = _differences(flat_settings(before), flat_settings(settings))
    if not changes and record.is_file():  # the digest differs and the resolved config does not: it was edited
        changes = [
            f"the settings digest in {FINISHED_RECORD} differs from this run's ({RESOLVED} was changed since)"
        ]
    return changes


def _differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each key whose value differs, as the user is likeliest to have changed it: a group's other option
    (its `_target_`) first, then the values both configs have, then the keys only one has (the settings
    another option brings)."""
    changed = [k for k in before.keys() | now.keys() if before.get(k, "<unset>") != now.get(k, "<unset>")]
    changed.sort(key=lambda k: ((k in before) != (k in now), not k.endswith("._target_"), k))
    return [f"{k}={before.get(k, '<unset>')!s} there, {now.get(k, '<unset>')!s} here" for k in changed]


def keep_configured_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, configured: list[float]) -> None:
    """A resumed run takes its learning rate from its config, not from the checkpoint (a lower one after a
    divergence): the schedule's base rates become the configured ones and the current rates are scaled
    alike. With the config unchanged this does nothing (bitwise resume)."""
    saved = list(scheduler.base_lrs)
    if saved == configured:
        return
    for group, before, after in zip(scheduler.optimizer.param_groups, saved, configured, strict=True):
        group["lr"] = group["lr"] * after / before if before else after
        group["initial_lr"] = after
    scheduler.base_lrs = list(configured)
    # What get_last_lr() says (and the log reports) until the next step.
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    log.info("learning rate from the config: %s (the checkpoint had %s)", configured, saved)


def resume_hint(checkpoints_dir: Path, keeps_last_finite: bool) -> str:
    """What a run that diverged is told to resume from: `last_finite` (the state of its last logging step
    whose loss was finite), else its latest checkpoint, else nothing."""
    latest = latest_checkpoint(checkpoints_dir)
    last_finite = checkpoints_dir / LAST_FINITE
    if last_finite.is_dir():
        hint = (
            f"The state of its last logging step whose loss was finite is in {last_finite}: resume from it with "
            f"trainer.resume={last_finite} and the changes above (a resumed run takes optimizer.lr from its config)."
        )
    elif latest is not None:
        hint = (
            f"Its last checkpoint, {latest}, was written before; resume from an earlier one with "
            "trainer.resume=<dir> if that one is already bad."
        )
    else:
        hint = "It wrote no checkpoint."
    if not keeps_last_finite:
        hint += " trainer.checkpoint_last_finite=true keeps the state of the last logging step whose loss was finite."
    return hint
