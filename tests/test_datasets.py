"""`data=hf` (a parquet file and a saved dataset, tokenized by a local tokenizer) and `data=image_folder` (a
generated folder of PNGs): they train, shard over ranks and resume bitwise like the built-in sources, and
refuse broken input before launch."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_to_end
from omegaconf import OmegaConf
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from runner.build import model_dims
from runner.checkpoint.weights import load_weights
from runner.data.hf import HFDataset
from runner.data.image_folder import ImageFolder
from runner.engine.data_loader import DataLoaderShard, StreamReading, shard_dataloader
from runner.errors import ConfigError
from runner.export import export_hf
from runner.models.hf import causal_lm
from runner.state import GradientState

SONNETS = Path(__file__).resolve().parents[1] / "runner" / "data" / "assets" / "sonnets.txt"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A word-level tokenizer trained on the sonnets, their lines as parquet files (one row group, and 5),
    JSON lines, text, CSV and a saved DatasetDict, and 3 classes of 20 small PNGs of different sizes."""
    root = tmp_path_factory.mktemp("datasets")
    lines = [line.strip() for line in SONNETS.read_text().splitlines() if line.strip()]  # 196
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        lines, trainers.WordLevelTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    ).save_pretrained(root / "tokenizer")
    labels = ["love" if "love" in line.lower() else "other" for line in lines]
    table = datasets.Dataset.from_dict({"text": lines, "label": labels})
    table.to_parquet(root / "lines.parquet")
    pq.write_table(table.data.table, root / "groups.parquet", row_group_size=40)  # 5 row groups
    table.to_json(root / "lines.jsonl")
    (root / "lines.txt").write_text("\n".join(lines) + "\n")
    table.to_csv(root / "lines.csv")
    datasets.DatasetDict(
        {"train": table.select(range(150)), "test": table.select(range(150, len(lines)))}
    ).save_to_disk(root / "saved")
    rng = random.Random(0)
    for index, color in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        folder = root / "images" / f"class_{index}"
        folder.mkdir(parents=True)
        for i in range(20):
            size = (rng.randint(10, 16), rng.randint(10, 16))
            pixel = tuple(min(255, max(0, c + rng.randint(-80, 80))) for c in color)
            image = Image.new("RGB", size, pixel)
            image.putpixel((0, 0), (255, 255, 255))  # a corner mark: a flip moves it
            image.save(folder / f"{i}.png")
    return root


def _cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_to_end(run_dir, "tracker=none", "scheduler=constant", "trainer.eval_every=0", *overrides)


def _sources(files: Path) -> dict[str, list[str]]:
    return {
        "hf_parquet": [
            "data=hf",
            f"data.path={files / 'lines.parquet'}",
            f"data.tokenizer={files / 'tokenizer'}",
            "data.seq_len=16",
            "data.batch_size=8",
            "model=hf_causal_lm",
            "model.config.hidden_size=32",
            "model.config.intermediate_size=64",
            "task=language_modeling",
            "+model.config.attention_dropout=0.1",  # an RNG in play
        ],
        "image_folder": [
            "data=image_folder",
            f"data.path={files / 'images'}",
            "data.image_size=8",
            "data.batch_size=8",
            "task=classification",
            "model.hidden_size=32",
            "model.dropout=0.1",
        ],
    }


RANKS = {1: [], 2: ["hardware=ddp", "hardware.num_processes=2"]}


@pytest.mark.slow
@pytest.mark.parametrize(("source", "ranks"), [("hf_parquet", 1), ("image_folder", 1), ("image_folder", 2)])
def test_a_run_stopped_mid_epoch_resumes_to_the_same_weights(files, tmp_path, source, ranks):
    overrides = [*_sources(files)[source], *RANKS[ranks], "trainer.checkpoint_every=5"]
    whole = tmp_path / "whole"
    _cli(whole, *overrides, "trainer.max_steps=12")
    parts = tmp_path / "parts"
    _cli(parts, *overrides, "trainer.max_steps=5")  # checkpoints at step 5, in the middle of an epoch
    resumed = _cli(parts, *overrides, "trainer.max_steps=12")
    assert "resumed from" in resumed.stderr + (parts / "runner.log").read_text()
    assert (parts / "model" / "model.safetensors").read_bytes() == (
        whole / "model" / "model.safetensors"
    ).read_bytes()


@pytest.mark.slow
def test_random_flips_reach_the_training_images(files, tmp_path):
    image = _sources(files)["image_folder"]
    flipped = _cli(tmp_path / "flip", *image, "trainer.max_steps=4")
    plain = _cli(tmp_path / "plain", *image, "trainer.max_steps=4", "data.random_flip=false")
    assert flipped.stderr.count("train/loss") and plain.stderr.count("train/loss")
    assert (tmp_path / "flip" / "model" / "model.safetensors").read_bytes() != (
        tmp_path / "plain" / "model" / "model.safetensors"
    ).read_bytes()


@pytest.mark.slow
def test_a_transformers_run_exports_from_its_checkpoint_with_the_datas_tokenizer(files, tmp_path):
    """`runner export` of a run that saved no model/: its latest checkpoint, the vocabulary the data gave
    the model, the tokenizer of data.tokenizer beside it; refused once that tokenizer is gone."""
    overrides = [*_sources(files)["hf_parquet"], "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    run_dir = tmp_path / "run"
    _cli(run_dir, *overrides, "trainer.save_model=false")
    exported = export_hf(run_dir, tmp_path / "hf")
    assert (exported.architecture, exported.checkpoint_format, exported.step) == (
        "LlamaForCausalLM",
        "full",
        4,
    )
    assert exported.tokenizer == str(files / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(files / "tokenizer").get_vocab()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    architecture = OmegaConf.load(run_dir / "resolved_config.yaml").model.config
    ours = causal_lm(config=architecture, vocab_size=len(tokenizer)).eval()
    load_weights(ours, run_dir / "checkpoints" / "checkpoint_1" / "model_0.safetensors")
    ids = tokenizer("Shall I compare thee to a summer's day?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (ours(ids).logits - loaded(ids).logits).abs().max() < 1e-5
    moved = files.parent / "tokenizer-moved"
    (files / "tokenizer").rename(moved)
    try:
        with pytest.raises(ConfigError, match=r"the run's data.tokenizer .* is not a tokenizer dir here"):
            export_hf(run_dir, tmp_path / "again")
    finally:
        moved.rename(files / "tokenizer")
    assert not (tmp_path / "again").exists()


def test_hf_language_modeling_blocks_and_classification_samples(files):
    lm = HFDataset(str(files / "lines.parquet"), str(files / "tokenizer"), seq_len=16, eval_fraction=0.1)
    lm.setup()
    sample = lm.train_set[0]
    assert sample.keys() == {"input_ids", "attention_mask", "labels"} and sample["input_ids"].shape == (16,)
    assert torch.equal(sample["labels"], sample["input_ids"])  # the task shifts them
    assert lm.dims == {"vocab_size": 400}
    classes = HFDataset(
        str(files / "saved"), str(files / "tokenizer"), task="classification", seq_len=12, eval_split="test"
    )
    classes.setup()
    assert len(classes.train_set) == 150 and len(classes.eval_set) == 46  # the saved splits
    assert classes.dims == {"vocab_size": 400, "num_labels": 2}
    assert classes.train_set[0]["labels"].item() in (0, 1)
    tested = HFDataset(str(files / "saved"), str(files / "tokenizer"), task="classification", split="test")
    tested.setup()  # data.split: the saved dict's test split is the one divided into training and eval
    assert len(tested.train_set) + len(tested.eval_set) == 46 and len(tested.eval_set) == 5


def test_hf_data_is_tokenized_once_per_machine_and_again_when_its_files_change(files, tmp_path, monkeypatch):
    """The launching process's checks tokenize; the ranks (and the next run) read the cached tensors. A
    changed data file or another setting is tokenized again; a cache entry cut short is rebuilt, never read
    as if whole."""
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "lines.parquet"
    shutil.copy(files / "lines.parquet", data)

    def load(**settings):
        source = HFDataset(str(data), str(files / "tokenizer"), **{"seq_len": 16, **settings})
        source.setup()
        return source

    def entries() -> list[Path]:
        return sorted((tmp_path / "cache" / "hf_data").glob("*.pt"))

    def tokens(source) -> torch.Tensor:
        return source.train_set[list(range(len(source.train_set)))]["input_ids"]

    first = load()
    (entry,) = entries()
    written = entry.stat().st_mtime_ns
    again = load()
    assert entry.stat().st_mtime_ns == written  # read, not written again
    assert torch.equal(tokens(again), tokens(first)) and again.dims == first.dims
    load(seq_len=8)  # another setting: an entry of its own
    assert len(entries()) == 2
    datasets.Dataset.from_parquet(str(data)).select(range(100)).to_parquet(data)  # the file changed
    assert len(load().train_set) < len(first.train_set)
    assert len(entries()) == 3

    shutil.rmtree(tmp_path / "cache")
    shutil.copy(files / "lines.parquet", data)
    reference = tokens(load())
    (entry,) = entries()
    os.truncate(entry, entry.stat().st_size // 2)
    assert torch.equal(tokens(load()), reference)  # tokenized again
    assert torch.equal(
        torch.load(entry, weights_only=True)["train"]["input_ids"],
        load().train_set.dataset.tensors["input_ids"],
    )


def test_image_folder_samples_follow_the_transforms(files):
    data = ImageFolder(
        str(files / "images"), image_size=8, grayscale=True, mean=[0.0], std=[1.0], flatten=False
    )
    data.setup()
    sample = data.eval_set[0]
    assert (
        sample["inputs"].shape == (1, 8, 8) and 0.0 <= sample["inputs"].min() <= sample["inputs"].max() <= 1.0
    )
    # image tensors have no `in_features`: an MLP on them is told about data.flatten
    assert data.dims == {"in_channels": 1, "out_features": 3, "num_classes": 3}
    assert len(data.train_set) + len(data.eval_set) == 60
    mlp = OmegaConf.create({"_target_": "runner.models.MLP", "in_features": None, "out_features": None})
    with pytest.raises(ConfigError, match=re.escape("data.flatten=false gives 1 x 8 x 8 image tensors")):
        model_dims(mlp, data.dims, data.withheld)
    flat = ImageFolder(str(files / "images"), image_size=8, grayscale=True)
    flat.setup()
    assert flat.eval_set[0]["inputs"].shape == (64,) and flat.dims["in_features"] == 64
    assert model_dims(mlp, flat.dims, flat.withheld) == {"in_features": 64, "out_features": 3}


def test_broken_datasets_are_refused_naming_the_key(files, tmp_path, monkeypatch):
    tokenizer = str(files / "tokenizer")
    cases = [
        (lambda: HFDataset(str(tmp_path / "none.parquet"), tokenizer), "data.path="),
        (lambda: HFDataset(str(files / "lines.parquet"), str(tmp_path)), "data.tokenizer="),
        (
            lambda: HFDataset(str(files / "lines.parquet"), tokenizer, text_column="body").setup(),
            "data.text_column='body'",
        ),
        (
            lambda: HFDataset(str(files / "saved"), tokenizer, eval_split="dev").setup(),
            "data.eval_split='dev'",
        ),
        (
            lambda: HFDataset(str(files / "lines.parquet"), tokenizer, seq_len=100000).setup(),
            "at least 2 are needed",
        ),
        (lambda: ImageFolder(str(tmp_path / "nothing")), "data.path="),
        (lambda: ImageFolder(str(files / "images"), mean=[0.5]), "data.mean=[0.5]"),
    ]
    broken = tmp_path / "broken" / "a"
    broken.mkdir(parents=True)
    (broken / "x.png").write_bytes(b"not a png")
    (tmp_path / "broken" / "b").mkdir()
    (tmp_path / "broken" / "b" / "y.png").write_bytes((files / "images" / "class_0" / "0.png").read_bytes())
    cases.append((lambda: ImageFolder(str(tmp_path / "broken")).setup(), "x.png: not a readable image"))
    # A whole header and half the pixels: it opens, and fails only when decoded.
    truncated = tmp_path / "truncated"
    shutil.copytree(files / "images", truncated)
    image = truncated / "class_1" / "3.png"
    image.write_bytes(image.read_bytes()[: len(image.read_bytes()) // 2])
    cases.append((lambda: ImageFolder(str(truncated)).setup(), "3.png: not a readable image"))
    # An image past Pillow's pixel limit (a decompression bomb): here the limit is lowered below the images.
    bombs = tmp_path / "bombs"
    shutil.copytree(files / "images", bombs)

    def bomb() -> None:
        with monkeypatch.context() as patched:
            patched.setattr(Image, "MAX_IMAGE_PIXELS", 10)
            ImageFolder(str(bombs)).setup()

    cases.append((bomb, f"{bombs / 'class_0' / '0.png'}: too large to decode"))
    # An eval folder with a class that the training folder lacks (its images would be left out).
    shutil.copytree(files / "images", tmp_path / "eval_images")
    shutil.copytree(files / "images" / "class_0", tmp_path / "eval_images" / "class_9")
    cases.append(
        (
            lambda: ImageFolder(str(files / "images"), eval_path=str(tmp_path / "eval_images")).setup(),
            "holds the class folder(s) ['class_9'] that data.path lacks",
        )
    )
    # Label columns that are not classes, an empty file, a tokenizer that cannot be loaded.
    rows = {
        "null": [{"text": "a b", "label": None if i == 3 else i % 2} for i in range(20)],
        "fractions": [{"text": "a b", "label": i * 0.37} for i in range(20)],
        "null_text": [{"text": None if i == 4 else "a b", "label": i % 2} for i in range(20)],
    }
    for name, content in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in content))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad_tokenizer").mkdir()
    (tmp_path / "bad_tokenizer" / "tokenizer_config.json").write_text("{")
    classify = {"task": "classification", "seq_len": 4}
    datasets.DatasetDict(  # a class in the eval split that the training split lacks
        {
            "train": datasets.Dataset.from_dict({"text": ["a b"] * 4, "label": ["x", "y"] * 2}),
            "test": datasets.Dataset.from_dict({"text": ["a b"] * 3, "label": ["x", "y", "z"]}),
        }
    ).save_to_disk(tmp_path / "unseen_class")
    cases.append(
        (
            lambda: HFDataset(
                str(tmp_path / "unseen_class"), tokenizer, eval_split="test", **classify
            ).setup(),
            "data.eval_split='test': classes ['z'] are not in the training split ['x', 'y']",
        )
    )
    cases += [
        (
            lambda: HFDataset(str(tmp_path / "null.jsonl"), tokenizer, **classify).setup(),
            "data.label_column='label' of " + str(tmp_path / "null.jsonl") + ": 1 row(s) have no label",
        ),
        (
            lambda: HFDataset(str(tmp_path / "fractions.jsonl"), tokenizer, **classify).setup(),
            "holds numbers with fractions (0.37, 0.74, 1.11, ...: 20 distinct values in 20 rows)",
        ),
        (lambda: HFDataset(str(tmp_path / "empty.jsonl"), tokenizer).setup(), "the file is empty"),
        (
            lambda: HFDataset(str(tmp_path / "null_text.jsonl"), tokenizer).setup(),
            f"data.text_column='text': row 5 of {tmp_path / 'null_text.jsonl'} holds None, not a text",
        ),
        (
            lambda: HFDataset(str(files / "lines.parquet"), str(tmp_path / "bad_tokenizer")).setup(),
            "data.tokenizer=" + repr(str(tmp_path / "bad_tokenizer")) + ": the tokenizer cannot be loaded",
        ),
    ]
    for build, expected in cases:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            build()


# ------------------------------------------------------------------------------------ streaming


def _streamed(files: Path, name: str, **settings) -> HFDataset:
    source = HFDataset(
        str(files / name),
        str(files / "tokenizer"),
        **{"seq_len": 16, "streaming": True, "eval_rows": 20, "shuffle_blocks": 1, **settings},
    )
    source.setup()
    return source


def _lines() -> list[str]:
    return [line.strip() for line in SONNETS.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["lines.txt", "lines.jsonl", "groups.parquet", "saved"])
def test_a_stream_cuts_the_rows_after_the_held_out_ones_into_units_each_read_once(files, name):
    """Whatever the number of readers, the units hold every training row once, in order; the eval set is
    the blocks of the first eval_rows rows (of the saved dict's train split: the one streamed)."""
    source = _streamed(files, name)
    rows = _lines()[:150] if name == "saved" else _lines()
    stream = source.train_set
    for readers in (1, 3):
        units = stream.units(readers)
        assert len(units) >= readers
        assert [text for unit in units for _, text in stream._texts(unit, None)] == rows[20:]
    assert stream.held_out_texts() == rows[:20]
    tokenizer = stream.tokenizer
    held_out = [i for row in tokenizer(rows[:20])["input_ids"] for i in [*row, tokenizer.eos_token_id]]
    eval_ids = source.eval_set.tensors["input_ids"]
    assert (
        eval_ids.flatten().tolist() == held_out[: len(eval_ids) * 16]
        and len(held_out) - eval_ids.numel() < 16
    )
    assert _streamed(files, name, eval_rows=40).eval_set.tensors["input_ids"].numel() > eval_ids.numel()


def test_a_stream_resumed_at_any_position_reads_on_to_the_same_blocks_pass_after_pass(files):
    """~110 blocks a pass: 300 cross two passes, each pass's units in another order, shuffled in windows
    of 8 blocks; a fresh stream started where any block left the first one reads the same blocks on."""
    stream = _streamed(files, "lines.jsonl", shuffle_blocks=8).train_set.with_seed(3)
    blocks, positions = [], []
    for sample in itertools.islice(stream, 300):
        blocks.append(sample["input_ids"])
        positions.append(stream.position)
        assert torch.equal(sample["labels"], sample["input_ids"]) and sample["attention_mask"].all()
    assert {p[1]["pass_"] for p in positions} == {0, 1, 2}
    for taken in (0, 6, 7, 150, 290):
        resumed = stream.with_seed(3)
        role, state = positions[taken]
        resumed.start_from({role: state}, rotation=0)
        again = [s["input_ids"] for s in itertools.islice(resumed, 9)]
        assert all(torch.equal(a, b) for a, b in zip(again, blocks[taken + 1 : taken + 10], strict=True))
    # shuffle_blocks: each window of 8 holds the blocks of the text in order, drawn in another order
    ordered = list(itertools.islice(_streamed(files, "lines.jsonl").train_set.with_seed(3), 16))
    for window in (slice(0, 8), slice(8, 16)):
        shuffled, plain = blocks[window], [s["input_ids"] for s in ordered[window]]
        assert sorted(map(tuple, map(torch.Tensor.tolist, shuffled))) == sorted(
            map(tuple, map(torch.Tensor.tolist, plain))
        )
        assert any(not torch.equal(a, b) for a, b in zip(shuffled, plain, strict=True))
    # another seed: units in another order
    other = [s["input_ids"] for s in itertools.islice(stream.with_seed(4), 8)]
    assert any(not torch.equal(a, b) for a, b in zip(other, blocks[:8], strict=True))


def test_streaming_refuses_what_it_cannot_follow(files, tmp_path, run_cli):
    def refused(match: str, name: str = "lines.jsonl", **settings) -> None:
        with pytest.raises(ConfigError, match=match):
            _streamed(files, name, **settings)

    refused("data.task='classification': streaming makes blocks of tokens", task="classification")
    refused(r"a \.csv file is not streamed", "lines.csv")
    refused("data.eval_rows=1: the 1 row.s. held out for evaluation make no block", eval_rows=1)
    refused("data.text_column='body': no such column", "groups.parquet", text_column="body")
    refused("data.eval_split='dev': .* has the splits", "saved", eval_split="dev")
    one_group = _streamed(files, "lines.parquet").train_set
    with pytest.raises(ConfigError, match=r"makes 1 unit.s. .*fewer than the 4 streams that read it"):
        one_group.check_readers(4)
    reading = StreamReading(workers=2, shards=1)
    with pytest.raises(
        ConfigError, match=r"read by 2 process.es. with 2 loader worker.s. each, this run has 1 with 2"
    ):
        reading.load_state_dict(StreamReading(workers=2, shards=2).state_dict())
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a line"}\nnot json\n' * 40)
    with pytest.raises(ConfigError, match="the line at byte 19 is not a JSON object"):
        _streamed(files, str(broken))  # an absolute path: files / it is it
    # before launch: an endless stream needs a number of steps, and each of 2 x 2 readers a unit of its own
    launched = run_cli(
        *_sources(files)["hf_parquet"],
        "data.streaming=true",
        "data.eval_rows=20",
        "data.num_workers=2",
        *RANKS[2],
        "trainer.max_steps=null",
        "trainer.max_epochs=1",
    )
    assert launched.returncode == 2 and not (tmp_path / "run" / "checkpoints").exists()
    assert "trainer.max_steps=null with a streamed training set" in launched.stderr, launched.stderr
    assert "makes 1 unit(s)" in launched.stderr and "fewer than the 4 streams" in launched.stderr


@pytest.mark.slow
def test_a_streamed_run_on_2_ranks_with_2_loader_workers_resumes_to_the_same_weights(files, tmp_path):
    """Each rank's 2 workers read streams of their own: 4 positions, kept per rank in the checkpoint; the
    run stopped at step 5 (worker 1's batch due next) resumes to the weights of the uninterrupted run."""
    overrides = [
        *_sources(files)["hf_parquet"],
        f"data.path={files / 'lines.jsonl'}",
        "data.streaming=true",
        "data.eval_rows=20",
        "data.shuffle_blocks=4",
        "data.num_workers=2",
        *RANKS[2],
        "trainer.checkpoint_every=5",
    ]
    whole = tmp_path / "whole"
    _cli(whole, *overrides, "trainer.max_steps=12")
    parts = tmp_path / "parts"
    _cli(parts, *overrides, "trainer.max_steps=5")
    kept = [
        torch.load(parts / "checkpoints" / "checkpoint_0" / f"dataloader_0.rank{rank}.pt")["stream"]
        for rank in (0, 1)
    ]
    assert [k["next"] for k in kept] == [1, 1] and kept[0]["starts"] != kept[1]["starts"]
    _cli(parts, *overrides, "trainer.max_steps=12")
    assert (parts / "model" / "model.safetensors").read_bytes() == (
        whole / "model" / "model.safetensors"
    ).read_bytes()


def test_a_stream_loader_that_skips_batches_reads_them_and_its_position_moves_past_them(files):
    source = _streamed(files, "lines.jsonl", batch_size=4)

    def prepared() -> DataLoaderShard:
        return DataLoaderShard(shard_dataloader(source.train_dataloader(seed=0), 1, 0), GradientState())

    whole = list(itertools.islice(iter(prepared()), 5))
    loader = prepared()
    skipping = loader.skip_first_batches(2)
    after = list(itertools.islice(iter(skipping), 3))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(after, whole[2:], strict=True))
    again = prepared()
    again.load_state_dict(loader.state_dict())  # the position of 5 batches: 2 skipped, 3 handed out
    resumed = next(iter(again))
    assert torch.equal(resumed["input_ids"], list(itertools.islice(iter(prepared()), 6))[5]["input_ids"])
