"""Composition and validation in this process, through Hydra's compose API (fast)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
import random
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import rank_checks
import torch
import yaml
from conftest import cli_env
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, HydraException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError
from safetensors.torch import save_file

from hydra_plugins.runner_sweeper.resumable_sweeper import unfinished_batches
from runner.build import locate
from runner.compose import check_intervals, options_first
from runner.config import CONF_DIR, FORMER_NAMES, Declared, Range, TrainerConfig, declared_ranges
from runner.errors import ConfigError, describe_compose_error
from runner.group_schemas import SCHEMAS, register_configs
from runner.schemas import GENERATED, OPTIONS, schemas, source
from runner.validate import check_job, validate

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def test_at_least_two_experiments_ship():
    assert {"gpt_sonnets", "mlp_digits"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    # An inference experiment runs weights given on the command line (their files are checked, not their
    # tensors' names).
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    weights = [f"checkpoint={tmp_path}"] if experiment == "gpt_generate" else []
    cfg = compose("config", overrides=[f"experiment={experiment}", *weights])
    validate(cfg)
    assert cfg.trainer.max_steps > 0


@pytest.mark.parametrize(
    "group", ["hardware", "precision", "model", "data", "optimizer", "scheduler", "task"]
)
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
        cfg = compose("config", overrides=[f"{group}={option}"])
        assert cfg[group]._target_


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("trainer.max_step=5", (ConfigKeyError, ConfigAttributeError)),  # typo in a typed group
        ("trainer.max_steps=abc", ValidationError),  # wrong type
        ("hardware.devices=2", ConfigAttributeError),
        ("precision.dtype=3", ConfigAttributeError),  # fp32 has no dtype
    ],
)
def test_schema_refuses_typos_and_wrong_types_at_compose_time(override, error):
    with pytest.raises(ConfigCompositionException) as info:
        compose("config", overrides=[override])
    assert isinstance(info.value.__cause__, error)
    assert override.split("=")[0].lstrip("+").split(".")[-1] in str(info.value.__cause__)


def test_unknown_group_option_is_refused():
    with pytest.raises(Exception, match="Could not find 'hardware/gpu9'"):
        compose("config", overrides=["hardware=gpu9"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model._target_=nope.Model"],
            "model._target_='nope.Model' cannot be imported (no module named 'nope'; "
            "looked in the working directory ",
        ),
        (["+model.hiden=3"], "runner.models.MLP does not accept these settings"),
        (
            ["+model.hiden_size=3"],
            "model: runner.models.MLP does not accept these settings (got an unexpected keyword argument "
            "'hiden_size'); did you mean model.hidden_size? Its parameters are: in_features,",
        ),
        (["data=table"], "data.path: no value was given"),
        (["data=table", "data.path=missing.csv", "data.target=y"], "data.path='missing.csv': no such file"),
        (["+trainer.extra=1"], "trainer.extra: not a setting of trainer"),
        (["model._target_=runner.models.Nope"], "'runner.models' has no attribute 'Nope'"),
        (["trainer.max_steps=null"], "trainer.max_steps and trainer.max_epochs are both null"),
        (["trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps=0: must be >= 1"),
        (["trainer.max_grad_norm=-1"], "trainer.max_grad_norm=-1.0: must be > 0"),
        (["trainer.hang_timeout_s=0.01"], "trainer.hang_timeout_s=0.01: must be >= 1, or 0 (off)."),
        (
            [
                "trainer.compile.scope=model",
                "trainer.compile.mode=max-autotune",
                "trainer.compile.options={max_autotune: true}",
            ],
            "trainer.compile.mode=max-autotune and trainer.compile.options: torch.compile takes one of them",
        ),
        (
            ["trainer.compile.scope=model", "trainer.compile.options=3"],
            "trainer.compile.options=3: expected a mapping of the backend's options",
        ),
        (["tracker.uri=not-a-uri"], "tracker.uri='not-a-uri' (or $MLFLOW_TRACKING_URI): not a store MLflow"),
        (
            ["tracker.uri=':::garbage:::'"],
            "tracker.uri=':::garbage:::' (or $MLFLOW_TRACKING_URI): not a store",
        ),
        (["tracker.uri=file:///tmp/store"], "MLflow's file store (a plain path or file://) is not taken"),
        (["tracker.experiment_name=''"], "tracker.experiment_name='': an MLflow experiment needs a name"),
        (["tracker=tensorboard", "tracker.logging_dir=/proc/1/tb"], "/proc/1 cannot be written here"),
        # a directory access() lets root write, where no file can be made
        (["tracker=tensorboard", "tracker.logging_dir=/proc/tb"], "/proc cannot be written here"),
    ],
)
def test_validation_names_the_key(overrides, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert expected in str(info.value)


class ResMLP(torch.nn.Module):
    """A user's model with plain annotations (no Range): its settings' types are checked before launch."""

    def __init__(
        self,
        in_features: int | None = None,
        out_features: int | None = None,
        width: int = 64,
        activation: typing.Literal["relu", "gelu"] = "relu",
        dropout: float | None = None,
        norm: bool = True,
        names: list[str] | None = None,
        hidden_size: int = 8,  # the mlp option's other settings
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        self.net = torch.nn.Linear(in_features or 1, out_features or 1)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.width=abc", "model.width='abc': expected an integer."),
        ("model.width=1.5", "model.width=1.5: expected an integer."),
        ("model.dropout=high", "model.dropout='high': expected a number."),
        ("model.norm=3", "model.norm=3: expected true or false."),
        ("model.activation=tanh", "model.activation='tanh': expected one of 'relu', 'gelu'."),
        ("model.names=[a,1]", "model.names[1]=1: expected a string."),
        ("model.names=a", "model.names='a': expected a list of strings."),
    ],
)
def test_a_user_classes_plain_annotations_are_checked_before_launch(
    override, expected, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cfg = compose("config", overrides=["model._target_=test_config.ResMLP", f"++{override}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert expected in str(info.value)
    fine = [
        "++model.width=32",
        "++model.activation=gelu",
        "++model.dropout=0",
        "++model.names=[a,b]",
        "++model.norm=false",
    ]
    validate(compose("config", overrides=["model._target_=test_config.ResMLP", *fine]))


def test_validation_reports_every_problem_at_once():
    cfg = compose("config", overrides=["model._target_=nope.Model", "trainer.log_every=0"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "model._target_" in str(info.value) and "trainer.log_every=0" in str(info.value)


def test_assets_exist():
    assets = Path(__file__).resolve().parents[1] / "runner" / "data" / "assets"
    assert (assets / "digits.csv.gz").stat().st_size > 10_000 and (
        assets / "sonnets.txt"
    ).stat().st_size > 5_000


def accepted_parameters(cls: type) -> set[str]:
    """The keyword arguments `cls(...)` takes, following `**kwargs` up to the base classes that take them."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {
            "self"
        }
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


def typed_option_files() -> list[str]:
    return sorted(
        f"{group}/{path.stem}"
        for group in ("hardware", "precision", "launcher", "tracker")
        for path in (CONF_DIR / group).glob("*.yaml")
        if path.stem not in FORMER_NAMES.get(group, {})
    )


@pytest.mark.parametrize(
    ("group", "former", "option"), [(g, f, o) for g, names in FORMER_NAMES.items() for f, o in names.items()]
)
def test_a_former_option_name_is_its_option_under_another_name(group, former, option):
    """`hardware=multi_gpu` in a user's YAML or command line is `hardware=ddp`: the same config composed
    (the file extends the option and sets nothing), with the option's own settings overridable."""
    document = yaml.safe_load((CONF_DIR / group / f"{former}.yaml").read_text())
    assert document == {"defaults": [option, "_self_"]}
    assert compose("config", overrides=[f"{group}={former}"])[group] == compose(
        "config", overrides=[f"{group}={option}"]
    )[group]
    changed = compose("config", overrides=[f"{group}={former}", f"{group}.peak_flops=1e12"])[group]
    target = OPTIONS[group][option]
    assert changed.peak_flops == 1e12 and changed._target_ == f"{target.__module__}.{target.__qualname__}"


@pytest.mark.parametrize("option", typed_option_files())
def test_each_option_yaml_schema_and_class_agree(option):
    """A typed option's YAML sets exactly its schema's fields, and its class accepts every one of them
    (it may take more, for use from Python): a setting one of the three lacks would be refused, or never
    reach the object."""
    group, name = option.split("/")
    document = yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text())
    if document.get("_target_") is None:  # tracker=none: nothing is built
        return
    schema = next(
        entry for entry in document["defaults"] if isinstance(entry, str) and entry.startswith("/schema/")
    )
    assert schema == f"/schema/{group}/{name}@_here_", f"conf/{option}.yaml starts from {schema}"
    assert locate(document["_target_"]) is OPTIONS[group][name], (
        f"conf/{option}.yaml builds {document['_target_']}, its schema is derived from {OPTIONS[group][name]}"
    )
    fields = {f.name for f in dataclasses.fields(schemas()[group][name])} - {"_target_"}
    settings = set(document) - {"defaults", "_target_"}
    assert settings == fields, (
        f"conf/{option}.yaml sets {sorted(settings ^ fields)} that its schema lacks, or not"
    )
    accepted = accepted_parameters(locate(document["_target_"]))
    assert fields <= accepted, f"{document['_target_']} does not accept {sorted(fields - accepted)}"


@pytest.mark.parametrize("option", typed_option_files())
def test_a_composed_config_pickles_with_its_derived_schemas(option):
    """Spawned ranks and SLURM jobs receive the config pickled: its schema classes must be found again by
    name (`runner.group_schemas`), not be anonymous."""
    group, name = option.split("/")
    cfg = compose("config", overrides=[f"{group}={name}"])
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_the_schemas_the_command_composes_against_are_the_derived_ones():
    """`runner/group_schemas.py` is the derivation from the constructors written out (`python -m
    runner.schemas` writes it again after a constructor changes): the same text, and the same fields,
    types and defaults once imported."""
    assert GENERATED.read_text() == source(), f"{GENERATED.name} is stale: run `python -m runner.schemas`"
    for group, options in schemas().items():
        for option, derived in options.items():
            written = SCHEMAS[group][option]
            assert written.__name__ == derived.__name__
            assert [
                (f.name, f.type, f.default, f.default_factory() if callable(f.default_factory) else None)
                for f in dataclasses.fields(written)
            ] == [
                (f.name, f.type, f.default, f.default_factory() if callable(f.default_factory) else None)
                for f in dataclasses.fields(derived)
            ], f"{group}={option}"


def test_a_typo_is_refused_by_a_composition_that_imports_no_torch():
    """Composing the command's config, and refusing a misspelt key, a wrong type or an unknown option,
    needs none of the classes the options build: torch is not imported."""
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from hydra.errors import ConfigCompositionException\n"
        "from runner.config import CONF_DIR\n"
        "from runner.group_schemas import register_configs\n"
        "register_configs()\n"
        "with initialize_config_dir(config_dir=str(CONF_DIR), version_base='1.3'):\n"
        "    compose('config', overrides=['hardware=fsdp', 'tracker=wandb', 'launcher=slurm'])\n"
        "    for bad in ('trainer.max_step=5', 'hardware.num_processes=two', 'hardware=fdsp'):\n"
        "        try:\n"
        "            compose('config', overrides=[bad])\n"
        "        except ConfigCompositionException:\n"
        "            pass\n"
        "        else:\n"
        "            raise AssertionError(bad)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# Where the class's default is written otherwise than the schema's, and means the same (why).
SAME_DEFAULT = {
    ("hardware/big_model", "max_memory"): "{'cpu': None}: no limit given, as None",
}


def _default_value(value: object) -> object:
    """A default as the three places write it: enums by value, sequences as lists, an empty container as
    the None a constructor takes for it (a mutable default is no Python default)."""
    value = getattr(value, "value", value)
    if isinstance(value, (list, tuple, dict)) and not value:
        return None
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("option", typed_option_files())
def test_each_option_yaml_schema_and_class_agree_in_defaults(option):
    """A setting's value in the option's YAML is its schema's default, which is its class's default: one
    value, whether the object is built from YAML or from Python (a YAML that passes on another setting,
    `${...}`, is the exception)."""
    group, name = option.split("/")
    document = yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text())
    if document.get("_target_") is None:
        return
    fields = dataclasses.fields(schemas()[group][name])
    parameters = {}
    for klass in locate(document["_target_"]).__mro__:
        if "__init__" in vars(klass):
            for parameter in inspect.signature(vars(klass)["__init__"]).parameters.values():
                parameters.setdefault(parameter.name, parameter)
    for field in fields:
        if field.name == "_target_" or (option, field.name) in SAME_DEFAULT:
            continue
        schema_default = (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        )
        written = document.get(field.name)
        if not (isinstance(written, str) and written.startswith("${")):
            assert _default_value(written) == _default_value(schema_default), (
                f"conf/{option}.yaml: {field.name}={written!r}, its schema's default is {schema_default!r}"
            )
        class_default = parameters[field.name].default
        if class_default is not inspect.Parameter.empty:
            assert _default_value(class_default) == _default_value(schema_default), (
                f"{document['_target_']}({field.name}={class_default!r}), its schema's default is {schema_default!r}"
            )


# Another valid value for settings whose type alone does not give one (else: bools flip, numbers grow).
OTHER_VALUES = {
    ("launcher/elastic", "endpoint"): "node1:29401",
    "device": "cpu",
    "backend": "gloo",
    "dtype": "float16",
    "start_method": "spawn",
    "shard_modules": ["Block"],
    "device_map": "sequential",
    "recipe": "rowwise",
    "pp_schedule": "gpipe",
    "keep": ["blocks.*"],
    "max_memory": {"cpu": "1GB"},
    "no_split_module_classes": ["Block"],
    "offload_folder": "elsewhere",
    "uri": "sqlite:///elsewhere.db",
    "experiment_name": "another",
    "run_name": "another",
    "tags": {"team": "another"},
    "parent_run_id": "0123",
    "config": {"steps_per_print": 7},
    ("hardware/deepspeed", "zero_stage"): 1,
    "backoff_factor": 0.25,  # doubled it would be out of its range, < 1
    ("tracker/wandb", "tags"): ["another"],
    "project": "another",
    "entity": "another",
    "group": "another",
    "notes": "another",
    "address": "10.0.0.1:6379",
    "placement": "spread",
    ("launcher/ray", "storage"): "/elsewhere",
    "runtime_env": {"env_vars": {"ANOTHER": "1"}},
    ("launcher/kubernetes", "image"): "registry.example.com/another:1",
    ("launcher/kubernetes", "namespace"): "another",
    ("launcher/kubernetes", "runtime"): "another-runtime",
    ("launcher/kubernetes", "volume"): "another-claim",
    ("launcher/kubernetes", "mount_path"): "/elsewhere",
    ("launcher/kubernetes", "run_dir"): "/runs/another",
    ("launcher/kubernetes", "env"): {"ANOTHER": "1"},
    ("launcher/kubernetes", "name"): "another",
}
# Where a setting is valid only next to another one (offload_params needs ZeRO-3).
BASE_OVERRIDES = {
    "hardware/deepspeed": ["hardware.zero_stage=3"],
    "tracker/wandb": ["tracker.mode=offline"],
    "launcher/elastic": ["launcher.max_nodes=4"],  # room for min_nodes to grow
}
# Settings the machine running the tests cannot give another value, and why.
CANNOT_VARY = {
    ("hardware/single_device", "device"): "the only device here is the CPU",
    ("hardware/ddp", "device"): "null picks the CPU here, as 'cpu' does",
    ("hardware/fsdp", "device"): "null picks the CPU here, as 'cpu' does",
    ("hardware/tensor_parallel", "device"): "null picks the CPU here, as 'cpu' does",
    ("hardware/deepspeed", "device"): "null picks the CPU here, as 'cpu' does",
    ("hardware/ddp", "backend"): "null picks gloo on the CPU",
    ("hardware/fsdp", "backend"): "null picks gloo on the CPU",
    ("hardware/tensor_parallel", "backend"): "null picks gloo on the CPU",
    ("hardware/deepspeed", "backend"): "null picks gloo on the CPU",
    ("tracker/wandb", "mode"): "online needs a W&B login, which the test machine has not",
}


def other_value(key: str, value: object) -> object:
    if key in OTHER_VALUES and OTHER_VALUES[key] != value:
        return OTHER_VALUES[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2
    if value is None:
        return 3
    raise AssertionError(f"no other value for {key}={value!r}: add one to OTHER_VALUES")


def typed_options() -> list[str]:
    return sorted(
        f"{group}/{path.stem}"
        for group in ("hardware", "precision", "launcher", "tracker")
        for path in (CONF_DIR / group).glob("*.yaml")
        if path.stem not in ("none", "xla", "slurm", *FORMER_NAMES.get(group, {}))  # nothing built; torch_xla, sbatch: their own tests; the same option again
    )


@pytest.mark.parametrize("option", typed_options())
def test_every_setting_of_an_option_reaches_the_object_it_builds(option):
    """Built once with the option's values and once with one setting changed, the objects differ: no
    setting is dropped on the way from YAML to the object (what the object then does with it is each
    feature's own test)."""
    group, name = option.split("/")
    cfg = compose("config", overrides=[f"{group}={name}", *BASE_OVERRIDES.get(option, [])])[group]
    reference = state_of(instantiate(cfg))
    for key, value in cfg.items():
        if key == "_target_" or (option, key) in CANNOT_VARY:
            continue
        changed = cfg.copy()
        plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        changed[key] = OTHER_VALUES.get((option, key)) or other_value(key, plain)
        assert state_of(instantiate(changed)) != reference, f"{option}: {key} never reached {cfg._target_}"


def state_of(obj: object) -> str:
    """Everything an object holds, as text (nested objects by their own attributes)."""
    seen: set[int] = set()

    def describe(value: object) -> object:
        if id(value) in seen:
            return "..."
        if hasattr(value, "__dict__") and not isinstance(value, type):
            seen.add(id(value))
            return {k: describe(v) for k, v in sorted(vars(value).items())}
        if isinstance(value, dict):
            return {str(k): describe(v) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [describe(v) for v in value]
        return repr(value)

    return repr(describe(obj))


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # dotted below the group: compile.scope
    type: object
    declared: Declared | None  # its range


def typed_settings() -> list[tuple[str, str, Setting]]:
    """(group, option, setting) for every setting of every typed group's schema (trainer: no options)."""
    found = [("trainer", "", setting) for setting in nested_settings(TrainerConfig)]
    for group, options in schemas().items():
        for option, schema in options.items():
            found += [(group, option, setting) for setting in nested_settings(schema)]
    return found


def nested_settings(schema: type, prefix: str = "") -> list[Setting]:
    """The settings of `schema`, those of the nested schemas (`trainer.compile`) included."""
    found = []
    ranges, hints = declared_ranges(schema), typing.get_type_hints(schema, include_extras=True)
    for setting in dataclasses.fields(schema):
        default = setting.default_factory() if setting.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            found += nested_settings(type(default), f"{prefix}{setting.name}.")
        elif setting.name != "_target_":
            found.append(Setting(prefix + setting.name, hints[setting.name], ranges.get(setting.name)))
    return found


def is_numeric(setting: Setting) -> bool:
    return re.search(r"\b(int|float)\b", str(setting.type)) is not None


def test_every_numeric_setting_declares_its_range():
    """So that a new option cannot be added without one (`Annotated[int, Range(...)]` where the setting
    is declared: a constructor argument, a trainer field)."""
    missing = [
        f"{group}={option} {setting.name}"
        for group, option, setting in typed_settings()
        if is_numeric(setting) and setting.declared is None
    ]
    assert missing == []


def out_of_range(bounds: Range, rng: random.Random) -> float:
    """A value `bounds` refuses, at a random distance from the bound (not its `off` value)."""
    distance = rng.choice([1, 7, 1000])
    if bounds.ge is not None:
        below = bounds.ge - distance
        return (bounds.ge + below) / 2 if below == bounds.off else below
    if bounds.gt is not None:
        return bounds.gt - distance + 1 if bounds.gt == int(bounds.gt) else bounds.gt - distance
    return (bounds.le if bounds.le is not None else bounds.lt) + distance


WRONG_TYPES = ["abc", "[1,2]", "{a: 1}", "1.5.2"]


@pytest.mark.parametrize(
    ("group", "option", "setting"),
    [t for t in typed_settings() if is_numeric(t[2]) or "bool" in str(t[2].type)],
    ids=lambda value: getattr(value, "name", value),
)
def test_fuzzed_typed_settings_are_refused_by_name_before_launch(group, option, setting):
    """Out-of-range values and wrong types, for every numeric and boolean setting: each is a ConfigError
    (or a composition error) naming the key, never another exception."""
    rng = random.Random(f"{group}.{option}.{setting.name}")
    select = [f"{group}={option}"] if option else []
    key = f"{group}.{setting.name}"
    values = [rng.choice(WRONG_TYPES)]
    if setting.declared is not None:
        values.append(out_of_range(setting.declared.bounds, rng))
    for value in values:
        try:
            cfg = compose("config", overrides=[*select, f"{key}={value}"])
            validate(cfg)
        except ConfigError as err:
            assert key in str(err), (value, str(err))
        except (ValidationError, ConfigCompositionException, OmegaConfBaseException) as err:
            assert key in describe_compose_error(err), (value, describe_compose_error(err))
        else:
            raise AssertionError(f"{key}={value} was accepted")


@pytest.mark.parametrize(
    ("group", "option", "setting"),
    [t for t in typed_settings() if t[0] != "trainer" and t[2].declared is not None],
    ids=lambda value: getattr(value, "name", value),
)
def test_typed_classes_refuse_an_out_of_range_value_from_python(group, option, setting):
    """The same range, checked when the class is built from Python (`@checked`): a ConfigError naming the
    setting, before the constructor does anything."""
    value = out_of_range(setting.declared.bounds, random.Random(f"{group}.{option}.{setting.name}"))
    with pytest.raises(ConfigError, match=rf"^{group}\.{setting.name}={value}: must be"):
        OPTIONS[group][option](**{setting.name: value})


UNTYPED_GROUPS = ("model", "data", "task", "optimizer", "scheduler")
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def untyped_settings() -> list[tuple[str, str, str, object]]:
    """(group, option, key, YAML value) for every setting of every untyped group's options."""
    found = []
    for group in UNTYPED_GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            document = yaml.safe_load(path.read_text())
            found += [
                (group, path.stem, key, value) for key, value in document.items() if key not in HYDRA_KEYS
            ]
    return found


def takes_numbers(target: object, key: str, value: object) -> bool:
    """Whether `key` is a numeric setting: a number (or list of them) in YAML, or annotated int/float."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return True
    for function in [target, *(c.__init__ for c in getattr(target, "__mro__", ()) if "__init__" in vars(c))]:
        try:
            parameter = inspect.signature(function).parameters.get(key)
        except (TypeError, ValueError):
            continue
        if parameter is not None and any(
            word in str(parameter.annotation) for word in ("int", "float", "Int")
        ):
            return True
    return False


def test_every_numeric_setting_of_an_untyped_group_declares_its_range():
    """The classes and functions that model, data, task, optimizer and scheduler options instantiate
    declare a range for each numeric argument their YAML sets (`Annotated[int, Range(...)]`, or
    `runner.config.THIRD_PARTY_RANGES`), so that a new option cannot be added without one. Nested
    mappings (a transformers model's `config`) are checked by building the model on meta before launch."""
    missing = [
        f"{group}={option} {key}"
        for group, option, key, value in untyped_settings()
        if not isinstance(value, dict)
        and takes_numbers(
            target := locate(OmegaConf.load(CONF_DIR / group / f"{option}.yaml")._target_), key, value
        )
        and key not in declared_ranges(target)
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("group", "option", "key"),
    [
        (group, option, key)
        for group, option, key, _ in untyped_settings()
        if key in declared_ranges(locate(OmegaConf.load(CONF_DIR / group / f"{option}.yaml")._target_))
    ],
)
def test_fuzzed_untyped_settings_are_refused_by_name_before_launch(group, option, key, tmp_path):
    """A wrong type and an out-of-range value for each: a ConfigError naming the key, before anything is
    built (the paths the data needs point at nothing)."""
    document = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text())
    bounds = declared_ranges(locate(document["_target_"]))[key].bounds
    rng = random.Random(f"{group}.{option}.{key}")
    required = [f"{group}.{name}=no/such/thing" for name, value in document.items() if value == "???"]
    values = [rng.choice(["abc", "true", "{a: 1}"]), "[1,2]"]  # "[1,2]": a list where a number is expected
    if bounds != Range():  # any number: only a wrong type to refuse
        values.append(out_of_range(bounds, rng))
    for value in values:
        cfg = compose("config", overrides=[f"{group}={option}", *required, f"{group}.{key}={value}"])
        with pytest.raises(ConfigError, match=rf"{group}\.{key}(\[\d\])?="):
            validate(cfg)


def test_hydra_options_move_before_the_overrides():
    assert options_first(
        ["experiment=mine", "--config-dir", "conf", "-m", "trainer.seed=1,2", "-cn=other"]
    ) == ["--config-dir", "conf", "-m", "-cn=other", "experiment=mine", "trainer.seed=1,2"]
    assert options_first(["a=1", "--cfg", "job", "b=2", "--info", "searchpath", "c=3", "-i", "d=4"]) == [
        *("--cfg", "job", "--info", "searchpath", "-i"),
        *("a=1", "b=2", "c=3", "d=4"),
    ]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.max_step=5"],
            "trainer.max_step: there is no key 'max_step' in 'trainer'. Did you mean trainer.max_steps?",
        ),
        (
            ["trainer.max_steps=abc"],
            "trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            ["hardware=gpu9"],
            "hardware=gpu9: there is no option 'gpu9' in the config group 'hardware'. Available: big_model, cpu, ddp, deepspeed, fsdp, megatron, multi_gpu, single_device, tensor_parallel, tpu, xla.",
        ),
        (["data=table", "data.path=missing.csv", "data.target=y"], "data.path='missing.csv': no such file"),
        (["model._target_=nope.Model"], "model._target_='nope.Model' cannot be imported"),
        (["task._target_=nope.Task"], "task._target_='nope.Task' cannot be imported"),
        (["model=gpt"], "model.vocab_size is null and the data does not provide it"),
        (["hardware=ddp", "hardware.num_processes=0"], "hardware.num_processes=0: must be >= 1"),
        (["hardware.num_threads=0"], "hardware.num_threads=0: must be >= 1"),
        (["+max_steps=5"], "max_steps: not a setting of the top level (its settings are model, data,"),
        (["optimizer.lr=-1"], "optimizer.lr=-1: must be > 0."),
        (["optimizer.betas=[0.9]"], "optimizer: torch.optim.AdamW refuses its settings (IndexError: list index out of range)"),
        (["scheduler.warmup_ratio=2"], "scheduler.warmup_ratio=2: must be >= 0 and < 1."),
        (["scheduler.warmup_ratio=-0.5"], "scheduler.warmup_ratio=-0.5: must be >= 0 and < 1."),
        (["model.hidden_size=0"], "model.hidden_size=0: must be >= 1."),
        (["model.dropout=1.5"], "model.dropout=1.5: must be >= 0 and < 1."),
        (["experiment=gpt_sonnets", "model.n_layers=0"], "model.n_layers=0: must be >= 1."),
        (["data.batch_size=5000"], "data.batch_size=5000: the training set has 3686 sample(s)"),
        (["+data.eval_batch_size=0"], "data.eval_batch_size=0: must be >= 1."),
        (["+data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
        (["hardware=fsdp", "hardware.num_threads=-1"], "hardware.num_threads=-1: must be >= 1"),
        (
            [
                "hardware=ddp",
                "hardware.num_processes=2",
                "trainer.split_batches=true",
                "data.batch_size=33",
            ],
            "data.batch_size=33 is the global batch and must split evenly over the 2 processes",
        ),
        (
            [
                "hardware=ddp",
                "hardware.num_processes=2",
                "data.num_samples=20",
                "data.eval_fraction=0.05",
                "data.batch_size=4",
            ],
            "the eval set has 1 sample(s), fewer than the 2 processes",
        ),
        (["hardware=ddp", "hardware.device=tpu"], "hardware.device='tpu': expected 'cuda', 'cpu'"),
        (["hardware=ddp", "hardware.device=cuda"], "this machine has 0 visible GPU(s)"),
        (["launcher.start_method=thread"], "launcher.start_method='thread': expected one of"),
        (["hardware=fsdp", "precision=fp16"], "precision=fp16 with hardware=fsdp"),
        (["hardware=deepspeed", "precision=fp16"], "precision=fp16 with hardware=deepspeed on the CPU"),
        (["hardware=deepspeed", "hardware.zero_stage=4"], "hardware.zero_stage=4: must be >= 1 and <= 3"),
        (["hardware=deepspeed", "hardware.offload_params=true"], "needs hardware.zero_stage=3"),
        (["hardware=deepspeed", "hardware.config=missing.json"], "not a readable DeepSpeed JSON file"),
        (
            ["hardware=deepspeed", "+hardware.config.gradient_clipping=1.0"],
            "hardware.config.gradient_clipping=1.0 contradicts",
        ),
        (
            ["hardware=deepspeed", "precision=bf16", "+hardware.config.bf16.enabled=false"],
            "hardware.config.bf16.enabled=False contradicts the run's value True (from the precision group)",
        ),
        (
            ["hardware=deepspeed", "+hardware.config.train_micro_batch_size_per_gpu=4"],
            "hardware.config.train_micro_batch_size_per_gpu=4 contradicts the run's value 64 (from data.batch_size",
        ),
        (
            ["hardware=deepspeed", "+hardware.config.train_batch_size=64"],
            "hardware.config.train_batch_size=64 contradicts the run's value 128 (from data.batch_size x "
            "trainer.gradient_accumulation_steps x 2 ranks)",
        ),
        (
            ["hardware=fsdp", "hardware.shard_modules=[Linear,NoSuchClass]"],
            "hardware.shard_modules=['Linear', 'NoSuchClass']: MLP has no submodule of class NoSuchClass. Its "
            "classes are: Dropout, GELU, Linear, Sequential.",
        ),
        (
            ["trainer.objective=eval/accurcy"],
            "trainer.objective=eval/accurcy: the run reports no such metric; its final metrics are eval/loss, "
            "eval/mae, train/loss, train/lr and perf/*.",
        ),
        (["trainer.objective=train/los"], "trainer.objective=train/los: the run reports no such metric"),
    ],
)
def test_bad_input_is_refused_in_one_paragraph_before_launch(overrides, expected):
    """What `python -m runner` refuses before any rank starts, one paragraph each (the command's own
    handling of them, its exit code and that it writes nothing: tests/test_cli.py)."""
    try:
        check_job(compose("config", overrides=[*overrides, "tracker=none"]))
    except ConfigError as err:
        message = str(err)
    except (HydraException, OmegaConfBaseException) as err:  # composing: the command says the same
        message = describe_compose_error(err)
    else:
        raise AssertionError(f"{overrides} was accepted")
    assert expected in message and "\n" not in message, message


def test_broken_data_files_and_a_model_that_does_not_fit_are_refused_before_launch(tmp_path, monkeypatch):
    """The launch reads the data and runs a step on meta as the ranks will: what fails there is refused."""
    monkeypatch.chdir(tmp_path)  # the files are given as relative paths, as users type them
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "cut.jsonl").write_text('{"x": 1, "y": 2}\n{"x": ')
    (tmp_path / "table.csv.gz").write_bytes(b"not gzip at all")
    (tmp_path / "nan.csv").write_text("x,y\n" + "".join(f"{i},{i % 2}\n" for i in range(30)) + "nan,1\n")
    (tmp_path / "one_class.csv").write_text("x,y\n" + "".join(f"{i},cat\n" for i in range(30)))
    cases = {
        (
            "data=text",
            "data.path=empty.txt",
            "model=gpt",
        ): "data: runner.data.TextFile failed to read its data from data.path=empty.txt",
        ("data=table", "data.path=cut.jsonl", "data.target=y"): "from data.path=cut.jsonl (JSONDecodeError",
        ("data=table", "data.path=table.csv.gz", "data.target=y"): "from data.path=table.csv.gz (BadGzipFile",
        ("data=table", "data.path=nan.csv", "data.target=y"): "column 'x' holds 'nan' on data row 31",
        (
            "data=table",
            "data.path=one_class.csv",
            "data.target=y",
        ): "every row of one_class.csv has the class 'cat'",
        (
            "experiment=gpt_sonnets",
            "model.max_seq_len=16",
        ): "one training step of runner.models.GPT on the first batch",
        (
            "experiment=gpt_sonnets",
            "model.max_seq_len=16",
            "hardware=ddp",
            "hardware.num_processes=2",
        ): ("sequence length 64 exceeds model.max_seq_len=16"),
    }
    for overrides, expected in cases.items():
        with pytest.raises(ConfigError) as refused:
            check_job(compose("config", overrides=[*overrides, "tracker=none"]))
        assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_sweep_interval_written_backwards_is_refused_before_the_sweep():
    check_intervals(["-m", "optimizer.lr=interval(1e-5,1e-2)", "trainer.seed=1,2", "broken=interval("])
    with pytest.raises(ConfigError, match=re.escape("Write optimizer.lr=interval(1e-05,0.01).")):
        check_intervals(["optimizer.lr=interval(1e-2,1e-5)"])


def test_a_sweeps_unfinished_jobs_go_out_in_runs_of_at_most_max_batch_size():
    """`hydra.sweeper.max_batch_size` reaches runner's sweeper, which launches runs of consecutive
    unfinished jobs (on SLURM an array each) cut to that size."""
    cfg = compose("config", overrides=["hydra.sweeper.max_batch_size=2"], return_hydra_config=True)
    size = instantiate(cfg.hydra.sweeper).max_batch_size
    jobs = [[f"trainer.seed={seed}"] for seed in range(5)]
    assert unfinished_batches(jobs, {1}, None) == [(0, jobs[:1]), (2, jobs[2:])]
    assert unfinished_batches(jobs, {1}, size) == [(0, jobs[:1]), (2, jobs[2:4]), (4, jobs[4:])]


@pytest.mark.slow
def test_multirun_flag_after_the_overrides_runs_the_sweep(tmp_path):
    """`-m` typed after the overrides (argparse alone: "unrecognized arguments") runs the sweep."""
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "tracker=none", "trainer.max_steps=2", "trainer.progress_bar=false", "trainer.plots=false",
         f"hydra.sweep.dir={tmp_path}", "-m", "trainer.seed=1,2", "plan=true"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("LocalLauncher: 1 node x 1 process") == 2, proc.stdout


COMPOSED_TWO_WAYS = """
import json, sys
import hydra
from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra_plugins.runner_launcher.launcher import RunnerLauncher
from hydra_plugins.runner_sweeper.resumable_sweeper import ResumableSweeper
from omegaconf import OmegaConf
from runner.compose import CONFIG_NAME, VERSION_BASE, run_composed_once
from runner.config import CONF_SEARCH_PATH
from runner.group_schemas import register_configs

compositions, seen = [], {}
compose = Hydra.compose_config
def counted(self, *args, **kwargs):
    compositions.append(kwargs["run_mode"].name)
    return compose(self, *args, **kwargs)
Hydra.compose_config = counted
def capture(cfg):
    seen[way] = {"compositions": compositions[:], "config": OmegaConf.to_container(cfg),
                 "hydra": OmegaConf.to_container(HydraConfig.get(), enum_to_str=True)}
    compositions.clear()
register_configs()
for plugin in (ResumableSweeper, RunnerLauncher):
    Plugins.instance().register(plugin)
sys.argv[1:] = json.loads(sys.argv[1])
way = "once"
ran = run_composed_once(get_args_parser().parse_args(), capture)
if not ran:
    seen["declined"] = compositions[:]
compositions.clear()
way = "hydra"
hydra.main(version_base=VERSION_BASE, config_path=CONF_SEARCH_PATH, config_name=CONFIG_NAME)(capture)()
print(json.dumps(seen, default=str))
"""


@pytest.mark.slow
def test_a_run_composes_once_what_hydra_main_composes_twice(tmp_path):
    """`python -m runner` composes a run's config once (Hydra's `@hydra.main` composes it in MULTIRUN mode
    to read `hydra.mode`, then again): the config and Hydra's own config are what `@hydra.main` gives,
    with a user's `--config-dir`, an experiment, a key and a Hydra key overridden."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mlp\ntrainer:\n  max_steps: 3\n"
    )
    overrides = ["--config-dir", str(tmp_path / "conf"), "experiment=mine", "model.hidden_size=8",
                 f"hydra.run.dir={tmp_path / 'run'}", "hydra.job.name=mine"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", COMPOSED_TWO_WAYS, json.dumps(overrides)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["once"]["compositions"] == ["RUN"]
    assert seen["hydra"]["compositions"] == ["MULTIRUN", "RUN"]
    assert seen["once"]["config"] == seen["hydra"]["config"]
    assert seen["once"]["config"]["model"]["hidden_size"] == 8
    assert seen["once"]["config"]["trainer"]["max_steps"] == 3
    assert seen["once"]["hydra"] == seen["hydra"]["hydra"]
    assert seen["once"]["hydra"]["mode"] == "RUN" and seen["once"]["hydra"]["job"]["name"] == "mine"
    assert "hydra.mode=RUN" in seen["once"]["hydra"]["overrides"]["hydra"]


@pytest.mark.slow
def test_a_config_that_sets_hydra_mode_multirun_sweeps_without_m(tmp_path):
    """A config may ask for a sweep itself (`hydra.mode: MULTIRUN` and the sweeper's params): composing once
    leaves it to Hydra, which sweeps."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "seeds.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      trainer.seed: 1,2\n"
    )
    overrides = ["--config-dir", str(tmp_path / "conf"), "experiment=seeds",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", COMPOSED_TWO_WAYS, json.dumps(overrides)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["declined"] == ["RUN"] and "once" not in seen  # composed, then left to Hydra: nothing ran
    assert seen["hydra"]["hydra"]["mode"] == "MULTIRUN"


def test_a_config_dir_option_named_as_a_shipped_one_is_refused(forked_cli, tmp_path):
    """Hydra reads runner's groups before `--config-dir`'s: a user's `model/mlp.yaml` would never be read."""
    conf = tmp_path / "conf"
    for name in ("model/mlp.yaml", "hardware/fsdp.yaml", "model/mine.yaml"):
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text("_target_: runner.models.MLP\n")
    proc = forked_cli("--config-dir", str(conf), "model=mine", "plan=true")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"Configuration error: --config-dir {conf}: hardware/fsdp.yaml, model/mlp.yaml ")
    assert "hardware=fsdp, model=mlp" in proc.stderr and "Rename" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "run").exists()
    preparing = [*rank_checks.RUNNER, "prepare-data", "--config-dir", str(conf), "data=tokens"]
    prepared = rank_checks.command(preparing, tmp_path, env=cli_env())
    assert prepared.returncode == 2 and "hardware/fsdp.yaml, model/mlp.yaml have the name" in prepared.stderr
    searched = forked_cli(f"hydra.searchpath=[pkg://runner.conf,file://{conf}]", "model=mine", "plan=true")
    assert searched.returncode == 2 and searched.stderr.startswith(
        f"Configuration error: hydra.searchpath entry file://{conf}: hardware/fsdp.yaml, model/mlp.yaml have"
    )
    # a user's primary config may name the search path itself (Hydra reads `hydra.searchpath` there too)
    own = tmp_path / "own"
    own.mkdir()
    (own / "main.yaml").write_text(f"defaults:\n  - config\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n")
    primary = forked_cli("--config-dir", str(own), "--config-name", "main", "model=mine", "plan=true")
    assert primary.returncode == 2 and primary.stderr.startswith(
        f"Configuration error: hydra.searchpath entry file://{conf} in {own / 'main.yaml'}: hardware/fsdp.yaml"
    )
    (conf / "model" / "mlp.yaml").unlink()
    (conf / "hardware" / "fsdp.yaml").unlink()
    assert forked_cli("--config-dir", str(conf), "model=mine", "plan=true").returncode == 0
    assert forked_cli("--config-dir", str(own), "--config-name", "main", "model=mine", "plan=true").returncode == 0


def test_every_runner_path_in_conf_resolves():
    """The dotted paths the YAML names (`_target_`, a logging handler's `class`) import: a module moved
    without its YAML fails here, not in the first run."""
    paths = {
        (yaml_file.relative_to(CONF_DIR), match.group(1))
        for yaml_file in CONF_DIR.rglob("*.yaml")
        for match in re.finditer(
            r"^\s*(?:_target_|class):\s*(runner\.[\w.]+)\s*$", yaml_file.read_text(), re.M
        )
    }
    assert len(paths) > 30
    for where, path in sorted(paths):
        assert locate(path) is not None, f"conf/{where}: {path}"


def test_a_typo_in_your_experiment_yaml_names_the_file_and_the_key(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  max_step: 5\n")
    with pytest.raises(HydraException) as info:
        compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    assert describe_compose_error(info.value).startswith(
        "experiment/mine.yaml: trainer.max_step: there is no key 'max_step' in 'trainer'. Did you mean "
        "trainer.max_steps?"
    )


@pytest.mark.parametrize(
    ("override", "quoted"),
    [
        ("data.path=dönnées/p.csv", """'data.path="dönnées/p.csv"'"""),
        ("data.path=data/a=b.csv", """'data.path="data/a=b.csv"'"""),
    ],
)
def test_an_override_hydra_cannot_read_says_how_to_quote_it(override, quoted):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with pytest.raises(HydraException) as info:
        OverridesParser.create().parse_overrides([override])
    message = describe_compose_error(info.value)
    assert message.startswith(f"{override}: Hydra cannot read this value unquoted") and quoted in message


def test_a_yaml_whose_top_level_is_a_list_is_named(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "listy.yaml").write_text("- 1\n- 2\n")
    cfg = compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "model=listy", "tracker=none"])
    with pytest.raises(ConfigError, match="model: the YAML of model holds a list at its top level, not a mapping"):
        validate(cfg)


def test_a_refused_hardware_group_leaves_the_data_and_model_checks_to_report_too():
    """A problem of the hardware group does not hide those of the data, the model and the objective: they
    are checked as for one rank (what fails there fails on any number)."""
    overrides = ["hardware.num_threads=0", "data.batch_size=5000", "trainer.objective=eval/x", "tracker=none"]
    with pytest.raises(ConfigError) as info:
        check_job(compose("config", overrides=overrides))
    paragraphs = str(info.value).split("\n\n")
    assert paragraphs[0] == "hardware.num_threads=0: must be >= 1."
    assert paragraphs[1].startswith("trainer.objective=eval/x: the run reports no such metric")
    assert paragraphs[2].startswith("data.batch_size=5000: the training set has 3686 sample(s)")
    assert len(paragraphs) == 3


def test_start_weights_of_another_shape_are_refused_before_launch(tmp_path):
    """`checkpoint=` against the model built on meta, from the file's header: refused before any rank
    starts (under hardware=ddp the ranks' load would be the first to see it)."""
    from runner.models import MLP

    weights = tmp_path / "model.safetensors"
    save_file(MLP(16, 1, hidden_size=64, num_layers=2).state_dict(), weights)
    common = [f"checkpoint={weights}", "model.num_layers=2", "tracker=none", "hardware=ddp"]
    check_job(compose("config", overrides=[*common, "model.hidden_size=64"]))
    with pytest.raises(ConfigError, match=r"does not match MLP \(with another shape: net.0.weight \(64, 16\)"):
        check_job(compose("config", overrides=[*common, "model.hidden_size=32"]))
