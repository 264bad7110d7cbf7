"""Data sources on their own: the samples they make, the sizes they give the model, the files and
columns they refuse; and the shapes a task refuses."""

from __future__ import annotations

import re

import pytest
import torch
from hydra import compose, initialize_config_dir

from runner.config import CONF_DIR
from runner.data import RandomTokens, SyntheticRegression, TableFile, TextFile, digits
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.tasks import Classification, Regression
from runner.train import Trainer
from runner.validate import check_job


def loaded(**options) -> RandomTokens:
    data = RandomTokens(**options)
    data.setup()
    return data


def test_random_tokens_are_windows_of_their_vocabulary_fixed_by_the_seed():
    data = loaded(vocab_size=7, seq_len=5, num_samples=30, eval_samples=4, seed=1, batch_size=8)
    assert (len(data.train_set), len(data.eval_set), data.dims) == (30, 4, {"vocab_size": 7})
    tokens = torch.stack([data.train_set[i]["inputs"] for i in range(30)])
    assert tokens.shape == (30, 5) and tokens.min() == 0 and tokens.max() == 6
    first, second = data.train_set[0], data.train_set[1]
    assert torch.equal(first["targets"][:-1], first["inputs"][1:])  # targets are the inputs shifted by one
    assert first["targets"][-1] == second["inputs"][0]  # consecutive windows of one stream
    assert torch.equal(
        loaded(vocab_size=7, seq_len=5, num_samples=30, seed=1).train_set[3]["inputs"], tokens[3]
    )
    assert not torch.equal(
        loaded(vocab_size=7, seq_len=5, num_samples=30, seed=2).train_set[3]["inputs"], tokens[3]
    )
    assert next(iter(data.train_dataloader(seed=0)))["inputs"].shape == (8, 5)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"vocab_size": 1}, "data.vocab_size=1"),
        ({"seq_len": 0, "eval_samples": 0}, "data.seq_len=0, data.eval_samples=0"),
    ],
)
def test_random_tokens_refuse_empty_sizes(options, named):
    with pytest.raises(ConfigError, match=named):
        RandomTokens(**options)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a,b,y\n1,2,x\n3,4,y,5\n5,6,x\n", "line 3 has 4 field(s) and the header 3"),  # not dropped
        ("a,b,y\n1,2,x\n3,4\n5,6,x\n", "line 3 has 2 field(s) and the header 3"),
        ("a,b,y\n1,2,x\n3,4,\n5,6,z\n", "1 row(s) have no label, e.g. data row(s) [2]"),
        (
            "a,b,y\n1,2,0.5\n3,4,1.25\n5,6,2\n",
            "holds numbers with fractions (0.5, 1.25, ...: 3 distinct values in 3 rows), which classification "
            "would take as that many classes. Give class labels (names or integers), or data.task=regression",
        ),
    ],
)
def test_a_table_refuses_rows_and_labels_it_would_misread(tmp_path, content, message):
    (tmp_path / "rows.csv").write_text(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        TableFile(str(tmp_path / "rows.csv"), target="y").setup()


@pytest.mark.parametrize(
    ("column", "message"),
    [
        ("a", "column 'a' holds '1e+39' on data row 2, beyond float32's range"),
        ("y", "data.target='y': values reach 1e+20, whose squared error overflows float32"),
        (
            "b",
            "column 'b' holds '1e+30' on data row 2, 7.29e+29 standard deviations from the training rows' mean",
        ),
    ],
)
def test_a_table_refuses_values_that_overflow_float32_instead_of_diverging(tmp_path, column, message):
    """Without these checks each trains to an inf loss, reported as divergence (lower the lr...)."""
    rows = [{"a": i % 7, "b": i % 5, "y": i % 3} for i in range(40)]
    rows[1][column] = {"a": 1e39, "y": 1e20, "b": 1e30}[column]
    (tmp_path / "rows.csv").write_text("a,b,y\n" + "".join(f"{r['a']},{r['b']},{r['y']}\n" for r in rows))
    data = TableFile(str(tmp_path / "rows.csv"), target="y", task="regression", eval_fraction=0.5)
    data.split_seed = next(  # row 2 in the eval half: standardised by the training half's mean and std
        seed
        for seed in range(100)
        if 1 in torch.randperm(40, generator=torch.Generator().manual_seed(seed))[:20]
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        data.setup()


def test_regression_refuses_outputs_and_targets_of_other_shapes():
    regression = Regression()
    same = regression.loss(torch.ones(4, 1), {"targets": torch.zeros(4, 1)})
    assert same.item() == 1.0
    with pytest.raises(ValueError, match=re.escape("output has shape (4, 1) and the targets (4,)")):
        regression.loss(torch.ones(4, 1), {"targets": torch.zeros(4)})  # MSE would broadcast to (4, 4)
    with pytest.raises(ValueError, match=r"targets are class indices .* use task=classification"):
        regression.loss(torch.ones(4, 3), {"targets": torch.zeros(4, dtype=torch.long)})


@pytest.mark.parametrize(
    ("setting", "pinned"), [("null", torch.cuda.is_available()), ("true", True), ("false", False)]
)
def test_data_pin_memory_pins_the_run_loaders_and_makes_their_copies_non_blocking(tmp_path, setting, pinned):
    """null pins where CUDA is there; pinned batches go to the device without waiting (on a machine without
    CUDA, torch's loader does not pin even when asked: the settings are what the run gives it)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["tracker=none", f"+data.pin_memory={setting}"])
    built = Trainer(cfg, tmp_path)
    assert built.train_loader.pin_memory == built.eval_loader.pin_memory == pinned
    assert built.engine.non_blocking == pinned


def test_a_rank_on_the_checks_data_starts_where_one_that_read_it_would(tmp_path):
    """A rank in the launching process trains on the data its checks read (the blueprint's): a data source
    that draws from torch's global RNG as it reads leaves that rank's RNGs where a rank that read the data
    itself has them, so both build the same starting weights."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config", overrides=["tracker=none", "trainer.plots=false", "data._target_=probes.GlobalRNGRegressionData"]
        )
    built, _ = check_job(cfg)
    (tmp_path / "reused").mkdir(), (tmp_path / "read").mkdir()
    reused = Trainer(cfg, tmp_path / "reused", blueprint=built.blueprint)
    read = Trainer(cfg, tmp_path / "read")
    for (name, mine), theirs in zip(reused.model.state_dict().items(), read.model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


def _set_up(source):
    source.setup()
    return source


def _stacked(dataset, key: str) -> torch.Tensor:
    return torch.stack([dataset[i][key] for i in range(len(dataset))])


def test_synthetic_regression_draws_the_sizes_noise_and_samples_its_settings_say():
    """data=regression: num_features and num_targets are each sample's sizes (and the model's), noise is
    the spread of the targets around the teacher's output, the seed draws another set."""

    def regression(**options) -> SyntheticRegression:
        return _set_up(SyntheticRegression(num_samples=400, batch_size=8, **options))

    wide = regression(num_features=5, num_targets=3)
    assert wide.train_set[0]["inputs"].shape == (5,) and wide.train_set[0]["targets"].shape == (3,)
    assert wide.dims == {"in_features": 5, "out_features": 3}
    quiet, noisy = regression(noise=0.0), regression(noise=0.5)
    assert torch.equal(_stacked(quiet.train_set, "inputs"), _stacked(noisy.train_set, "inputs"))
    spread = (_stacked(noisy.train_set, "targets") - _stacked(quiet.train_set, "targets")).std().item()
    assert 0.45 < spread < 0.55
    other = regression(seed=1)
    assert not torch.equal(_stacked(other.train_set, "inputs"), _stacked(quiet.train_set, "inputs"))


def test_text_windows_start_every_stride_bytes(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(32, 127)))  # 95 bytes: the eval split is the last 19

    def windows(stride: int):
        return _set_up(TextFile(path=str(path), seq_len=8, stride=stride, eval_fraction=0.2, batch_size=4))

    every, fourth = windows(1).train_set, windows(4).train_set
    assert (len(every), len(fourth)) == (68, 17)
    for i in range(len(fourth)):
        assert torch.equal(fourth[i]["inputs"], every[4 * i]["inputs"])


def test_normalize_standardises_each_feature_by_the_training_rows():
    """data=digits (a table): data.normalize=true (the default) gives each pixel column of the training
    split mean 0 and std 1 (blank columns only centred); false keeps the pixels' 0-16 counts."""
    raw = _stacked(_set_up(digits(normalize=False, batch_size=8)).train_set, "inputs")
    assert raw.min() == 0 and raw.max() == 16 and torch.equal(raw, raw.round())
    standard = _stacked(_set_up(digits(batch_size=8)).train_set, "inputs")
    assert standard.mean(0).abs().max() < 1e-4
    varied = raw.std(0) > 1e-6
    assert torch.allclose(standard.std(0)[varied], torch.ones(int(varied.sum())), atol=1e-4)


def test_label_smoothing_spreads_the_targets_over_the_classes():
    """task.label_smoothing: a confident, right prediction costs more with smoothing, by what
    cross-entropy against the smoothed targets says."""
    logits, batch = torch.tensor([[8.0, 0.0, 0.0, 0.0]]), {"targets": torch.tensor([0])}
    plain = Classification().loss(logits, batch)
    smoothed = Classification(label_smoothing=0.2).loss(logits, batch)
    targets = torch.tensor([[0.85, 0.05, 0.05, 0.05]])  # 1 - 0.2 + 0.2 / 4, and 0.2 / 4
    expected = -(targets * torch.log_softmax(logits, dim=1)).sum()
    assert plain < smoothed and torch.allclose(smoothed, expected)
