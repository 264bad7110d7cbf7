"""`runner --help`: every key of the composed config with its value, type and description; runner's internal
groups hidden (in-process, but for one command in a user's project)."""

from __future__ import annotations

import subprocess
import sys
from itertools import zip_longest

import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.errors import HydraException

from runner.cli.help import docstring_args, first_job, help_text, sections, type_text, yaml_comments
from runner.cli.init import init_project
from runner.compose import command_hydra
from runner.group_schemas import register_configs
from tests.conftest import cli_env

GROUPS = (
    "model",
    "data",
    "task",
    "optimizer",
    "scheduler",
    "trainer",
    "hardware",
    "precision",
    "launcher",
    "tracker",
)


@pytest.fixture
def hydra():
    register_configs()
    yield command_hydra(None)
    GlobalHydra.instance().clear()


def _compositions(hydra) -> list[list[str]]:
    """Overrides that, together, choose every shipped option once: round i takes each group's i-th option;
    each experiment on its own (it overrides groups)."""
    options = {g: hydra.config_loader.get_group_options(g, ObjectType.CONFIG) for g in GROUPS}
    rounds = [
        [f"{g}={o}" for g, o in zip(GROUPS, chosen, strict=True) if o is not None]
        for chosen in zip_longest(*options.values())
    ]
    experiments = hydra.config_loader.get_group_options("experiment", ObjectType.CONFIG)
    return rounds + [[f"experiment={e}"] for e in experiments]


def test_every_setting_of_every_shipped_option_is_described(hydra):
    from hydra.types import RunMode

    from runner.cli.help import _comments

    undescribed: dict[str, list[str]] = {}
    for overrides in _compositions(hydra):
        cfg = hydra.compose_config("config", overrides, run_mode=RunMode.RUN)
        for section in sections(cfg, dict(cfg.hydra.runtime.choices), _comments(hydra, overrides)):
            for setting in section.settings:
                if not setting.description:
                    undescribed.setdefault(setting.key, overrides)
    assert not undescribed, (
        f"keys --help shows without a description (YAML comment or docstring): {undescribed}"
    )


def test_help_shows_values_types_and_descriptions_and_hides_internal_groups():
    register_configs()
    text = help_text(["hardware=fsdp", "trainer.max_steps=7", "--help"])
    assert "schema/" not in text and "hydra/" not in text
    assert "  hardware    big_model ddp deepspeed *fsdp single_device tensor_parallel xla" in text
    lines = text.splitlines()
    at = lines.index("  trainer.max_steps=7  (int >= 1 | null)")  # the override's value, the dataclass's type
    assert lines[at + 1].strip() == "optimizer steps to train; null: max_epochs epochs"  # the YAML comment
    assert "hardware (hardware=fsdp): runner.hardware.fsdp.FSDP" in lines
    at = lines.index("  hardware.dp_shard=-1  (int >= -1)")  # the strategy's annotation (ShardDegree)
    assert "sharded over" in lines[at + 1]
    at = lines.index("  trainer.compile.scope=none  (none | model | regional)")  # an Enum
    # a key no YAML comments: the comment beside the dataclass's field
    at = lines.index("  trainer.compile.loss=true  (bool)")
    assert "also compile the task's loss" in lines[at + 1]
    at = lines.index("  optimizer.weight_decay=0.01  (float)")  # torch's own docstring (Args:)
    assert "weight decay coefficient" in lines[at + 1]
    assert "  trainer.compile.mode=null  (str | null)" in lines


def test_a_bad_override_with_help_is_the_composition_error():
    register_configs()
    with pytest.raises(HydraException, match="hidden_sise"):
        help_text(["model.hidden_sise=3", "--help"])


def test_help_in_a_users_project_reads_its_yaml_and_its_classes(tmp_path):
    init_project(tmp_path / "proj")
    project = tmp_path / "proj"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "--config-dir",
            "conf",
            "experiment=example",
            "model.hidden_size=7",
            "-h",
        ],
        cwd=project,
        env={**cli_env(), "COLUMNS": "200"},  # no line wrapped
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "  model       gpt hf_causal_lm hf_sequence_classification mlp *small_net" in lines
    assert "  experiment  *example gpt_generate gpt_sonnets mlp_digits" in lines
    assert "model (model=small_net): proj.model.SmallNet" in lines
    at = lines.index("  model.hidden_size=7  (int)")  # the override; the class's annotation
    assert lines[at + 1].strip() == "width of the hidden layer."  # the class's docstring (Args:)
    at = lines.index("  data.path=data/points.csv  (str)")  # the user's experiment YAML
    # the comment in data/table.yaml, then the experiment's
    assert (
        lines[at + 1].strip()
        == "a .csv or .jsonl file; experiment/example: relative to the directory you run in"
    )
    assert not (project / "outputs").exists()  # help starts no run


def test_help_composes_with_the_search_path_of_the_run(tmp_path, forked_cli):
    """`--help` (and `runner prepare-data`) compose with the search path `@hydra.main` gives the run, which
    Hydra's `--info searchpath` prints: `--config-dir` after runner's own groups, before the schemas."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    run = forked_cli("--config-dir", str(tmp_path / "conf"), "--info", "searchpath")
    assert run.returncode == 0, run.stderr
    printed = [
        tuple(cell.strip() for cell in line.strip("|").split("|"))
        for line in run.stdout.splitlines()
        if line.startswith("| ") and "Provider" not in line
    ]
    register_configs()
    try:
        path = command_hydra(str(tmp_path / "conf")).config_loader.get_search_path().get_path()
    finally:
        GlobalHydra.instance().clear()
    assert [(entry.provider, entry.path) for entry in path] == printed
    assert [provider for provider, _ in printed] == ["hydra", "main", "command-line", "schema"]


def test_yaml_comments_by_dotted_key():
    text = """\
# @package _global_
# What this file is.
defaults:
  - override /model: mlp  # not a key
  - _self_

lr: 0.1  # beside the key
# above the key
# on two lines
trainer:
  max_steps: 3  # nested
  name: "a # b"  # after a quoted hash
  url: http://x#y
plain: 1
"""
    assert yaml_comments(text, "pkg") == {
        "pkg": "What this file is.",
        "pkg.lr": "beside the key",
        "pkg.trainer": "above the key on two lines",
        "pkg.trainer.max_steps": "nested",
        "pkg.trainer.name": "after a quoted hash",
    }


def test_docstring_args_google_style():
    def f(a, b, c):
        """Do it.

        Args (beyond the base's):
            a (int): the first,
                continued.
            b: the second.

        Returns:
            c: not an argument.
        """

    assert docstring_args(f) == {"a": "the first, continued.", "b": "the second."}


@pytest.mark.parametrize(
    ("hint", "text"),
    [
        ("PositiveInt", "int >= 1"),
        ("PositiveInt | None", "int >= 1 | null"),
        ("Fraction", "float > 0 and < 1"),
        ("list[str] | None", "list[str] | null"),
        ("Literal['a', 'b']", "a | b"),
        ("dict[str, int]", "dict"),
        ("str | dict", "str | dict"),
    ],
)
def test_type_text(hint, text):
    from typing import Literal  # noqa: F401  (the hints are evaluated here)

    from runner.config import Fraction, PositiveInt  # noqa: F401

    assert type_text(eval(hint)) == text


def test_a_sweeps_help_shows_its_first_job():
    assert first_job(["optimizer.lr=1e-3,1e-2", "trainer.seed=range(3)", "model.hidden_size=8"]) == [
        "optimizer.lr=0.001",
        "trainer.seed=0",
        "model.hidden_size=8",
    ]
    assert first_job(["optimizer.lr=interval(1e-4,1e-2)", "+data.x=1"]) == ["+data.x=1"]  # sampled: left out
