"""Token shards (`runner prepare-data`, `data=tokens`): what preparing writes from each kind of source, an
interrupted preparation finishing byte for byte, the order that takes no memory, the refusals from metadata,
and runs that train and resume from shards on 1 and 2 ranks."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import rank_checks
import torch
from conftest import REPO, cli_env, metrics_of, run_to_end, runner_command
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from runner.build import model_dims
from runner.config import CONF_DIR
from runner.data import TokenShards
from runner.data import prepare as preparing
from runner.data.prepare import prepare
from runner.data.shards import TokenStore
from runner.data.tokens import ShuffledOrder, document_positions
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.models.gpt import GPT
from runner.task import SOURCE, model_outputs
from runner.telemetry.history import read_history
from runner.train import Trainer
from runner.validate import check_job

SONNETS = REPO / "runner" / "data" / "assets" / "sonnets.txt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The sonnets as 3 text files, their lines as jsonl, parquet and a saved dataset, and a word-level
    tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    text = SONNETS.read_text()
    for i in range(3):
        (root / f"part{i}.txt").write_text(text[i * 2000 :])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    (root / "lines.jsonl").write_text(
        "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(lines))
    )
    table = datasets.Dataset.from_dict({"text": lines})
    table.to_parquet(root / "lines.parquet", batch_size=50)  # row groups of 50
    table.save_to_disk(root / "saved")
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        lines, trainers.WordLevelTrainer(vocab_size=400, special_tokens=["[UNK]", "[EOS]"])
    )
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        root / "tokenizer"
    )
    return root


def all_tokens(directory: Path) -> np.ndarray:
    store = TokenStore(directory)
    return store.read(0, len(store))


def test_text_files_become_their_bytes_in_shards_with_a_document_index(corpus, tmp_path):
    files = sorted(corpus.glob("part*.txt"))
    manifest = prepare(
        tmp_path / "shards", str(corpus / "part*.txt"), shard_mb=0.01, workers=1, progress=False
    )
    expected = b"".join(p.read_bytes() for p in files)
    assert (manifest.tokens, manifest.documents, manifest.vocab_size) == (len(expected), 3, 256)
    assert len(manifest.shards) == 2 and manifest.dtype == "<u2"  # part0+part1 fill 10 kB, part2 alone
    assert (
        all_tokens(tmp_path / "shards").tobytes() == np.frombuffer(expected, np.uint8).astype("<u2").tobytes()
    )
    starts = np.fromfile(tmp_path / "shards" / "shard_00000.idx", dtype="<i8")
    assert starts.tolist() == [0, files[0].stat().st_size]
    # The same sources and settings again: nothing is written; other sources into the same dir: refused.
    before = (tmp_path / "shards" / "shard_00000.bin").stat().st_mtime_ns
    prepare(tmp_path / "shards", str(corpus / "part*.txt"), shard_mb=0.01, workers=1, progress=False)
    assert (tmp_path / "shards" / "shard_00000.bin").stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match="prepared from other sources or settings"):
        prepare(tmp_path / "shards", str(files[0]), shard_mb=0.01, workers=1, progress=False)


def test_a_directory_of_code_is_its_text_files_of_any_suffix_without_hidden_or_binary_ones(tmp_path):
    """A source directory gives every text file in it whatever its suffix (.py, .c, a Makefile), one
    document each in sorted order, and leaves out binary files (a NUL in their first 8000 bytes, as git
    tells) and hidden ones (.git/); a file named on its own is text whatever its suffix."""
    code = tmp_path / "code"
    (code / "src").mkdir(parents=True)
    (code / ".git").mkdir()
    texts = {
        "Makefile": "all:\n\tcc main.c\n",
        "main.c": "int main(void) { return 0; }\n",
        "src/train.py": "print('hello')\n",
        "src/notes.rst": "Notes\n=====\n",
    }
    for name, text in texts.items():
        (code / name).write_text(text)
    (code / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(64))
    (code / ".git" / "config").write_text("[core]\n")
    (code / ".env").write_text("SECRET=1\n")
    manifest = prepare(tmp_path / "shards", str(code), workers=1, progress=False)
    expected = b"".join((code / name).read_bytes() for name in sorted(texts, key=lambda n: str(code / n)))
    assert [Path(source[0]).relative_to(code).as_posix() for source in manifest.sources] == sorted(texts)
    assert (manifest.documents, manifest.tokens) == (4, len(expected))
    assert all_tokens(tmp_path / "shards").astype(np.uint8).tobytes() == expected
    alone = prepare(tmp_path / "one", str(code / "src" / "train.py"), workers=1, progress=False)
    assert alone.tokens == len(texts["src/train.py"])
    with pytest.raises(ConfigError, match=r"logo\.png is not UTF-8 text"):
        prepare(tmp_path / "png", str(code / "logo.png"), workers=1, progress=False)


@pytest.mark.parametrize("source", ["lines.jsonl", "lines.parquet", "saved"])
def test_rows_are_tokenized_with_an_end_of_sequence_token_each_whatever_the_units(corpus, tmp_path, source):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(corpus / "tokenizer")
    lines = [json.loads(line)["text"] for line in (corpus / "lines.jsonl").read_text().splitlines()]
    expected = [
        i
        for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]
        for i in [*ids, tokenizer.eos_token_id]
    ]
    one = prepare(
        tmp_path / "one", str(corpus / source), str(corpus / "tokenizer"), workers=1, progress=False
    )
    many = prepare(
        tmp_path / "many",
        str(corpus / source),
        str(corpus / "tokenizer"),
        shard_mb=0.001,
        workers=1,
        progress=False,
    )
    assert len(one.shards) == 1 and len(many.shards) > 2
    assert (one.documents, one.vocab_size, one.eos_token_id) == (
        len(lines),
        len(tokenizer),
        tokenizer.eos_token_id,
    )
    assert all_tokens(tmp_path / "one").tolist() == expected == all_tokens(tmp_path / "many").tolist()


def test_token_id_arrays_are_converted_in_the_narrowest_dtype_and_checked_against_the_vocabulary(tmp_path):
    ids = np.random.default_rng(0).integers(0, 70000, 5000)
    np.save(tmp_path / "wide.npy", ids)
    ids[:3000].astype(np.uint16).tofile(tmp_path / "narrow.bin")
    wide = prepare(
        tmp_path / "w", str(tmp_path / "wide.npy"), "ids", shard_mb=0.01, workers=1, progress=False
    )
    assert (wide.dtype, wide.vocab_size, len(wide.shards)) == ("<u4", ids.max() + 1, 4)  # 10 kB of int64
    assert all_tokens(tmp_path / "w").tolist() == ids.tolist()
    narrow = prepare(
        tmp_path / "n",
        str(tmp_path / "narrow.bin"),
        "ids",
        "text",
        "uint16",
        70000,
        workers=1,
        progress=False,
    )
    assert (narrow.dtype, narrow.vocab_size, narrow.tokens) == (
        "<u4",
        70000,
        3000,
    )  # the vocabulary needs 4 bytes
    assert all_tokens(tmp_path / "n").tolist() == ids[:3000].astype(np.uint16).tolist()
    with pytest.raises(ConfigError, match=r"holds token id 69\d\d\d, outside the vocabulary \[0, 1000\)"):
        prepare(tmp_path / "v", str(tmp_path / "wide.npy"), "ids", vocab_size=1000, workers=1, progress=False)
    with pytest.raises(ConfigError, match=r"data\.source_dtype is null"):
        prepare(tmp_path / "d", str(tmp_path / "narrow.bin"), "ids", workers=1, progress=False)
    with pytest.raises(ConfigError, match=r"need data\.tokenizer=ids"):
        prepare(tmp_path / "t", str(tmp_path / "wide.npy"), "bytes", workers=1, progress=False)
    # arrays that are not a flat list of integer ids: refused before any shard, naming the file
    np.save(tmp_path / "floats.npy", ids[:100].astype(np.float32) + 0.5)
    np.save(tmp_path / "table.npy", ids[:100].reshape(10, 10))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    for name, said in [
        ("floats.npy", r"floats\.npy holds float32 values: token ids are integers"),
        ("table.npy", r"table\.npy is a 2-D array \(10, 10\): token ids are one flat array"),
        ("odd.bin", r"odd\.bin has 3 bytes, not a whole number of data\.source_dtype=uint16 ids \(2 bytes each\)"),
    ]:
        with pytest.raises(ConfigError, match=said):
            prepare(tmp_path / f"to_{name}", str(tmp_path / name), "ids", "text", "uint16", workers=1, progress=False)
        assert not (tmp_path / f"to_{name}").exists()  # nothing written


def test_sources_that_are_not_what_they_claim_are_refused_naming_the_file_and_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.txt is not UTF-8 text \(byte 3: b'\\xe9'\)"):
        prepare(tmp_path / "l", str(tmp_path / "latin1.txt"), workers=1, progress=False)
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"text": "b"\n{"body": "c"}\n')
    with pytest.raises(ConfigError, match=r"rows\.jsonl \(line 2 after byte 0\) is not a JSON object"):
        prepare(tmp_path / "j", str(tmp_path / "rows.jsonl"), workers=1, progress=False)
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"body": "c"}\n')
    with pytest.raises(
        ConfigError, match=r"data\.text_column='text': a record of .*line 2 after byte 0.* holds None"
    ):
        prepare(tmp_path / "j", str(tmp_path / "rows.jsonl"), workers=1, progress=False)


def test_an_interrupted_preparation_keeps_its_whole_shards_and_finishes_byte_for_byte(
    corpus, tmp_path, monkeypatch
):
    source = str(corpus / "lines.jsonl")
    prepare(tmp_path / "whole", source, str(corpus / "tokenizer"), shard_mb=0.002, workers=1, progress=False)
    make = preparing._make_shard
    made = []

    def interrupted(task):
        if len(made) == 2:
            raise KeyboardInterrupt
        made.append(task[1])
        return make(task)

    monkeypatch.setattr(preparing, "_make_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(
            tmp_path / "parts", source, str(corpus / "tokenizer"), shard_mb=0.002, workers=1, progress=False
        )
    assert not (tmp_path / "parts" / "manifest.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "parts").glob("shard_0000[01].*")}
    (tmp_path / "parts" / "shard_00002.bin").write_bytes(b"half a shard")  # a write cut short, no record
    monkeypatch.setattr(preparing, "_make_shard", make)
    prepare(tmp_path / "parts", source, str(corpus / "tokenizer"), shard_mb=0.002, workers=2, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "parts").glob("shard_0000[01].*")} == kept
    whole = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert whole == sorted(p.name for p in (tmp_path / "parts").iterdir())
    for name in whole:
        ours, theirs = (tmp_path / "parts" / name).read_bytes(), (tmp_path / "whole" / name).read_bytes()
        if name.endswith(".json"):  # records: the same but for the time each file was written
            ours, theirs = (_without_times(json.loads(content)) for content in (ours, theirs))
        assert ours == theirs, name


TIMES = ("mtime_ns", "index_mtime_ns")


def _without_times(record: dict) -> dict:
    shards = [{k: v for k, v in s.items() if k not in TIMES} for s in record.get("shards", [])]
    return {k: v for k, v in record.items() if k not in TIMES} | {"shards": shards}


@pytest.mark.parametrize("size", [1, 2, 5, 64, 1000, 65537])
def test_the_shuffled_order_is_a_permutation_fixed_by_seed_and_epoch(size):
    order = ShuffledOrder(size, seed=3)
    first = list(order)
    assert sorted(first) == list(range(size)) and list(order) == first
    order.set_epoch(1)
    if size >= 5:
        assert list(order) != first and list(ShuffledOrder(size, seed=4)) != first
    if size >= 64:  # shuffled, not shifted: neighbours are not kept together
        adjacent = sum(abs(a - b) == 1 for a, b in itertools.pairwise(first))
        assert adjacent < size // 8


def test_windows_hold_out_the_end_for_evaluation_and_give_the_vocabulary(corpus, tmp_path):
    prepare(tmp_path / "s", str(corpus / "part0.txt"), workers=1, progress=False)
    data = TokenShards(str(tmp_path / "s"), seq_len=16, eval_samples=4, batch_size=4)
    data.setup()
    tokens = torch.tensor(all_tokens(tmp_path / "s").astype(np.int64))
    windows = (len(tokens) - 1) // 16
    assert (len(data.train_set), len(data.eval_set), data.dims) == (windows - 4, 4, {"vocab_size": 256})
    sample = data.train_set[5]
    assert torch.equal(sample["inputs"], tokens[80:96]) and torch.equal(sample["targets"], tokens[81:97])
    assert torch.equal(data.eval_set[0]["inputs"], tokens[(windows - 4) * 16 :][:16])
    batch = next(iter(data.train_dataloader(seed=0)))
    assert batch["inputs"].shape == (4, 16) and batch["inputs"].dtype == torch.int64
    # Its memory maps open (a sample was read), a loader worker still receives no data through the pickle.
    assert len(pickle.dumps(data.train_set)) < 4096 < len(tokens)


def test_broken_shards_and_mismatched_settings_are_refused_from_metadata(corpus, tmp_path):
    shards = tmp_path / "s"
    prepare(shards, str(corpus / "part*.txt"), shard_mb=0.01, workers=1, progress=False)

    def refused(match: str, directory: Path = shards, **options) -> None:
        with pytest.raises(ConfigError, match=match):
            TokenShards(str(directory), **options).setup()

    refused("no token shards there .no such directory.*runner prepare-data", tmp_path / "none")
    refused("eval_samples=null: without data.eval_path", eval_samples=None)
    refused(
        r"prepared from 3 file\(s\).*data.source and data.tokenizer name 1 file",
        source=str(corpus / "part0.txt"),
    )
    refused(
        "with tokenizer 'bytes'.*and '/",
        source=str(corpus / "part*.txt"),
        tokenizer=str(corpus / "tokenizer"),
    )
    refused("none left to train on", seq_len=4000)
    TokenShards(str(shards), source=str(corpus / "part*.txt")).setup()  # made from what it names: fine

    cut = tmp_path / "cut"
    shutil.copytree(shards, cut)
    with open(cut / "shard_00001.bin", "r+b") as f:
        f.truncate(100)
    refused(r"shard_00001.bin has 100 bytes where its \d+ entries take", cut)
    changed = tmp_path / "changed"
    shutil.copytree(shards, changed)
    data = bytearray((changed / "shard_00000.bin").read_bytes())
    data[10] ^= 1
    (changed / "shard_00000.bin").write_bytes(bytes(data))
    refused("shard_00000.bin holds other data than was written", changed)
    copied = tmp_path / "copied"
    shutil.copytree(shards, copied)  # new times, same contents: read once and found whole
    TokenShards(str(copied)).setup()
    manifest = json.loads((shards / "manifest.json").read_text())
    beyond = tmp_path / "beyond"
    shutil.copytree(shards, beyond)
    (beyond / "manifest.json").write_text(json.dumps(manifest | {"vocab_size": 100}))
    refused("it holds token id 122, beyond its vocabulary of 100", beyond)
    # the document index rewritten with wrong starts (same size): its checksum is read, as the tokens'
    moved = tmp_path / "moved"
    shutil.copytree(shards, moved)
    index = np.fromfile(moved / "shard_00000.idx", dtype="<i8")
    (index[::-1] if len(index) > 1 else index + 1).tofile(moved / "shard_00000.idx")
    refused("shard_00000.idx holds other data than was written", moved)
    # a source edited after prepare-data (same name): the sizes and times the manifest keeps differ
    edited = tmp_path / "edited"
    shutil.copytree(corpus, edited)
    prepare(tmp_path / "e", str(edited / "part*.txt"), shard_mb=0.01, workers=1, progress=False)
    with open(edited / "part1.txt", "a") as f:
        f.write("one more line\n")
    refused(
        rf"data.source: {edited / 'part1.txt'} changed since the shards in .* were prepared from it "
        r"\(\d+ bytes then, \d+ now",
        tmp_path / "e", source=str(edited / "part*.txt"),
    )
    data = TokenShards(str(shards))
    data.setup()
    with pytest.raises(
        ConfigError, match=r"model\.vocab_size=512 does not match the data, which has vocab_size=256"
    ):
        model_dims(OmegaConf.create({"_target_": "runner.models.GPT", "vocab_size": 512}), data.dims)


def _command(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", *arguments],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="a small or read-only mount needs root"
)
@pytest.mark.parametrize(("mount", "reason"), [("full", "the disk is full"), ("ro", "the file system is read-only")])
def test_prepare_data_that_cannot_write_says_why_and_leaves_no_partial_file(corpus, tmp_path, mount, reason):
    """Its data.path on a 48 kB file system (two of the shards fit) or a read-only one."""
    small = tmp_path / "small"
    small.mkdir()
    command = shlex.join([
        sys.executable, "-m", "runner", "prepare-data", "data=tokens", f"data.path={small / 'shards'}",
        f"data.source={corpus / 'part*.txt'}", "data.shard_mb=0.01", "data.prepare_workers=1",
    ])  # fmt: skip
    setup = f"mount -t tmpfs -o size=48k tmpfs {small}" if mount == "full" else f"mount --bind -o ro {small} {small}"
    script = f"{setup} && {command}; code=$?; find {small} -name '*partial*'; exit $code"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr
    assert f"Data not prepared: runner prepare-data could not write to {small / 'shards'}: {reason}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip() == ""  # no partial file left


def test_prepare_data_into_a_file_is_refused(corpus, tmp_path):
    (tmp_path / "shards").write_text("a file")
    proc = _command(
        "prepare-data", "data=tokens", f"data.path={tmp_path / 'shards'}", f"data.source={corpus / 'part0.txt'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Configuration error: data.path={str(tmp_path / 'shards')!r}: a file is there, not a directory" in proc.stderr


@pytest.fixture(scope="module")
def gpt_shards(corpus, tmp_path_factory) -> list[str]:
    """The sonnets prepared by `runner prepare-data` in 2 processes: a run's data overrides."""
    root = tmp_path_factory.mktemp("gpt")
    data = [
        "data=tokens",
        f"data.path={root / 'shards'}",
        f"data.source={corpus / 'part*.txt'}",
        "data.shard_mb=0.01",
    ]
    # By the `runner` script, whose workers import it again (where a worker's SIGTERM handler said "Training
    # interrupted" as the pool ended, in 5 of 6 runs).
    script = Path(sys.executable).with_name("runner")
    prepared = subprocess.run(
        [str(script), "prepare-data", *data, "data.prepare_workers=2"], cwd=root, env=cli_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    assert "interrupted" not in prepared.stderr and "Traceback" not in prepared.stderr, prepared.stderr
    size = sum(p.stat().st_size for p in corpus.glob("part*.txt"))
    assert (
        f"{size:,} tokens in 3 documents, 2 shard(s) of <u2, vocabulary 256 (tokenizer bytes)"
        in prepared.stdout
    )
    return [*data, "data.seq_len=64", "data.batch_size=16", "data.eval_samples=16"]


def test_prepare_data_refuses_data_without_shards_or_a_path_before_reading_anything(tmp_path):
    refused = rank_checks.command([*rank_checks.RUNNER, "prepare-data", "data=sonnets"], tmp_path, env=cli_env())
    assert refused.returncode == 2 and "nothing to prepare" in refused.stderr, refused.stderr
    refused = rank_checks.command(
        [*rank_checks.RUNNER, "prepare-data", "data=tokens", "data.source=corpus.txt"], tmp_path, env=cli_env()
    )
    assert refused.returncode == 2 and "data.path: no value was given" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_a_gpt_resumes_from_token_shards_exactly_and_on_another_number_of_ranks(gpt_shards, tmp_path):
    """24 whole batches of 16 per epoch (data.drop_last: the incomplete 25th dropped, which 2 ranks would
    complete from the epoch's start, as Accelerate's even batches do): 30 steps cross an epoch; checkpoints at
    10, 20 and 30."""
    run = [
        *gpt_shards,
        "model=gpt",
        "task=language_modeling",
        "scheduler=constant",
        "trainer.max_steps=30",
        "trainer.checkpoint_every=10",
        "trainer.keep_checkpoints=null",
        "trainer.eval_every=0",
        "trainer.split_batches=true",
        "hardware=fsdp",  # its checkpoints reshard onto another number of ranks
        "hardware.device=cpu",
        "hardware.num_processes=1",
    ]
    whole = run_to_end(tmp_path / "whole", *run)
    at_10 = tmp_path / "whole" / "checkpoints" / "checkpoint_0"
    resumed = run_to_end(tmp_path / "resumed", *run, f"trainer.resume={at_10}")
    assert "resumed from" in resumed.stderr and "at step 10" in resumed.stderr
    weights = "model/model.safetensors"
    assert (tmp_path / "resumed" / weights).read_bytes() == (tmp_path / "whole" / weights).read_bytes()
    # On 2 ranks from the 1-rank checkpoint, then back on 1 rank from the 2-rank run's: the same global batches.
    two = run_to_end(tmp_path / "two", *run, "hardware.num_processes=2", f"trainer.resume={at_10}")
    back = run_to_end(
        tmp_path / "back", *run, f"trainer.resume={tmp_path / 'two' / 'checkpoints' / 'checkpoint_1'}"
    )
    assert "at step 20" in back.stderr
    expected = metrics_of(whole)
    for other in (two, back):
        got = metrics_of(other)
        assert (
            abs(got["train/loss"] - expected["train/loss"]) < 1e-4
            and abs(got["eval/loss"] - expected["eval/loss"]) < 1e-4
        ), (got, expected)


@pytest.mark.slow
def test_a_resume_on_other_shards_at_the_same_path_is_refused(corpus, tmp_path):
    """The shards at data.path replaced by another corpus's between a checkpoint and its resume: the saved
    position would pick other windows. The checkpoint records what the shards are (their checksums)."""
    for name, part in (("a", "part0.txt"), ("b", "part2.txt")):
        prepare(tmp_path / name, str(corpus / part), shard_mb=0.01, workers=1, progress=False)
    shards = tmp_path / "shards"
    shutil.copytree(tmp_path / "a", shards)
    run = ["data=tokens", f"data.path={shards}", "data.seq_len=32", "model=gpt", "task=language_modeling",
           "trainer.checkpoint_every=3", "trainer.eval_every=0"]  # fmt: skip
    run_to_end(tmp_path / "run", *run, "trainer.max_steps=3")
    shutil.rmtree(shards)
    shutil.copytree(tmp_path / "b", shards)
    proc = subprocess.run(
        runner_command(tmp_path / "run", *run, "trainer.max_steps=6"), env=cli_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        f"Configuration error: trainer.resume: {tmp_path / 'run' / 'checkpoints' / 'checkpoint_0'} was written by a run "
        "that read other data: the token shards at data.path are not those it trained on" in proc.stderr
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    shutil.rmtree(shards)
    shutil.copytree(tmp_path / "a", shards)  # the same shards again (copied: new times): it resumes
    run_to_end(tmp_path / "run", *run, "trainer.max_steps=6")


@pytest.mark.slow
def test_a_transformers_causal_lm_trains_from_token_shards(corpus, tmp_path):
    data = [
        "data=tokens",
        f"data.path={tmp_path / 'shards'}",
        f"data.source={corpus / 'lines.parquet'}",
        f"data.tokenizer={corpus / 'tokenizer'}",
    ]
    prepared = _command("prepare-data", *data, "data.prepare_workers=1", cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    run = run_to_end(
        tmp_path / "run", *data, "data.seq_len=16", "data.batch_size=8", "model=hf_causal_lm", "task=language_modeling",
        "trainer.max_steps=20", "trainer.eval_every=0", "trainer.log_every=5",
    )  # fmt: skip
    losses = [
        float(line.split("train/loss=")[1].split()[0])
        for line in run.stderr.splitlines()
        if "train/loss=" in line
    ]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    assert "training LlamaForCausalLM" in run.stderr


def test_a_mixture_draws_its_sources_in_proportion_continues_them_across_epochs_and_holds_out_each(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "low.npy", rng.integers(0, 100, 40_000).astype(np.uint16))  # 2,499 windows of 16
    np.save(tmp_path / "high.npy", rng.integers(100, 200, 12_000).astype(np.uint16))  # 749
    for name in ("low", "high"):
        prepare(
            tmp_path / name, str(tmp_path / f"{name}.npy"), "ids", vocab_size=256, workers=1, progress=False
        )
    sources = [{"path": str(tmp_path / "low"), "weight": 1}, {"path": str(tmp_path / "high"), "weight": 3}]
    data = TokenShards(sources=sources, seq_len=16, eval_samples=8, batch_size=50)
    data.setup()
    assert len(data.train_set) == 2497 + 743 and len(data.eval_set) == 2 + 6  # each holds out its share
    assert all(data.eval_set[i]["inputs"].max() < 100 for i in range(2))
    assert all(data.eval_set[i]["inputs"].min() >= 100 for i in range(2, 8))
    assert [data.eval_set[i][SOURCE] for i in range(8)] == [0] * 2 + [1] * 6  # each sample says its source
    assert data.mixture == {"low": 0.25, "high": 0.75}  # named after their directories

    def highs(batches) -> list[bool]:
        pairs = [zip(b["inputs"], b[SOURCE], strict=True) for b in batches]
        drawn = [(bool(s.min() >= 100), int(source)) for batch in pairs for s, source in batch]
        assert all(high == source for high, source in drawn)
        return [high for high, _ in drawn]

    loader = data.train_dataloader(seed=0)
    epoch = highs(loader)
    assert sum(epoch) == 2430 and len(epoch) == 3240  # exactly 3/4 of the epoch
    assert abs(np.mean(epoch[:1000]) - 0.75) < 0.04  # and mixed all along it
    assert highs(data.train_dataloader(seed=0)) == epoch  # fixed by the seed

    # "high" holds 743 windows and is drawn 2430 times: it repeats; "low" is drawn 810 of 2497: the next
    # epoch continues with windows it did not draw.
    def lows() -> set[tuple[int, ...]]:
        return {tuple(data.train_set[i]["inputs"].tolist()) for i in range(810)}

    first = lows()
    data.train_set.set_epoch(1)
    second = lows()
    assert len(first) == len(second) == 810 and not first & second


@pytest.mark.slow
def test_a_mixture_logs_each_sources_eval_and_the_shares_it_drew_exactly_across_a_resume(tmp_path):
    """Two sources (ids below 100, ids from 100; weights 1:3), holding out 2 and 6 of 8 eval windows. Each
    source's eval loss and perplexity equal that source's evaluated alone at the run's final weights. The
    share of the training samples each gave so far, logged at every log step beside the weights, is the
    same in the uninterrupted run on 1 rank and in the run resumed from its step-6 checkpoint on 2 (split
    batches: the same global batches, counted over both ranks)."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "low.npy", rng.integers(0, 100, 8_000).astype(np.uint16))
    np.save(tmp_path / "high.npy", rng.integers(100, 200, 4_000).astype(np.uint16))
    for name in ("low", "high"):
        prepare(tmp_path / name, str(tmp_path / f"{name}.npy"), "ids", vocab_size=256, workers=1, progress=False)
    data = ["data=tokens", "data.seq_len=16", "data.batch_size=8", "model=gpt", "task=language_modeling"]
    run = [
        *data, "data.path=null", f"data.sources=[{{path: {tmp_path / 'low'}, weight: 1}}, {{path: {tmp_path / 'high'}, weight: 3, name: hi}}]",
        "data.eval_samples=8", "trainer.max_steps=12", "trainer.log_every=3", "trainer.checkpoint_every=6",
        "trainer.keep_checkpoints=null", "trainer.eval_every=0", "trainer.split_batches=true", "hardware=fsdp",
        "hardware.device=cpu",
    ]  # fmt: skip
    whole = run_to_end(tmp_path / "whole", *run, "hardware.num_processes=1")
    final = metrics_of(whole)
    assert "drawn from the mixture's sources: low 28.1% (weight 25.0%), hi 71.9% (weight 75.0%)" in whole.stderr
    for source, held_out in (("low", 2), ("high", 6)):
        alone = run_to_end(
            tmp_path / source, *data, "mode=evaluate", f"checkpoint={tmp_path / 'whole'}",
            f"data.path={tmp_path / source}", f"data.eval_samples={held_out}",
        )  # fmt: skip
        name = "hi" if source == "high" else source
        for metric in ("loss", "perplexity"):
            assert metrics_of(alone)[f"eval/{metric}"] == pytest.approx(final[f"eval/{metric}/{name}"], abs=1e-6)
    resumed = run_to_end(
        tmp_path / "resumed", *run, "hardware.num_processes=2",
        f"trainer.resume={tmp_path / 'whole' / 'checkpoints' / 'checkpoint_0'}",
    )  # fmt: skip
    assert "at step 6" in resumed.stderr

    def shares(run_dir: Path) -> dict[int, tuple[float, ...]]:
        rows = [row for row in read_history(run_dir) if "data/share/low" in row]
        assert all((row["data/weight/low"], row["data/weight/hi"]) == (0.25, 0.75) for row in rows)
        return {int(row["step"]): (row["data/share/low"], row["data/share/hi"]) for row in rows}

    drawn = shares(tmp_path / "whole")
    assert list(drawn) == [3, 6, 9, 12] and all(sum(pair) == pytest.approx(1) for pair in drawn.values())
    assert drawn[12] == (27 / 96, 69 / 96)  # the samples drawn, not the weights
    assert shares(tmp_path / "resumed") == {9: drawn[9], 12: drawn[12]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"sources": [{"path": "a", "weight": 0}]},
            r"data\.sources\[0\]\.weight=0: a weight must be a positive",
        ),
        ({"sources": [{"path": "a", "weight": -1}]}, r"weight=-1: a weight must be a positive finite number"),
        ({"sources": [{"path": "a", "weight": float("inf")}]}, r"data\.sources\[0\]\.weight=inf: a weight must be a positive finite"),
        ({"sources": [{"path": "a", "weight": float("nan")}]}, r"data\.sources\[0\]\.weight=nan: a weight must be a positive finite"),
        ({"sources": [{"path": "a"}]}, r"data\.sources\[0\]=\{'path': 'a'\}: expected \{path"),
        ({"sources": []}, r"data\.sources=\[\]: expected a list"),
        ({"path": "a", "sources": [{"path": "a", "weight": 1}]}, "give one"),
        (
            {"sources": [{"path": "x/web", "weight": 1}, {"path": "y/web/", "weight": 1}]},
            r"data\.sources\[1\] and data\.sources\[0\] are both named 'web'.*name: web",
        ),
        ({"sources": [{"path": "a", "weight": 1, "name": "a b"}]}, r"data\.sources\[0\]: its name 'a b' is not"),
        ({}, "give one"),
    ],
)
def test_a_mixture_without_positive_weights_or_with_a_path_too_is_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        TokenShards(**options)


def test_document_mask_gives_each_token_its_position_in_its_document(corpus, tmp_path):
    """The sonnets' lines, a document each (an end-of-sequence token each, about 40 bytes): every window
    crosses documents. Positions restart where the document index says a document starts, in the training
    and the eval windows, across shards too."""
    prepare(tmp_path / "s", str(corpus / "lines.jsonl"), shard_mb=0.005, workers=1, progress=False)
    store = TokenStore(tmp_path / "s")
    assert len(store.manifest.shards) > 1
    starts = set()
    for number, shard in enumerate(store.manifest.shards):
        index = np.fromfile(tmp_path / "s" / f"{shard.name}.idx", dtype="<i8")
        starts |= {int(start) + store.starts[number] for start in index}
    data = TokenShards(str(tmp_path / "s"), seq_len=64, eval_samples=4, batch_size=4, document_mask=True)
    data.setup()
    for windows, first in ((data.train_set, 0), (data.eval_set, len(data.train_set) * 64)):
        for i in (0, 1, len(windows) - 1):
            positions, start = windows[i]["positions"], first + i * 64
            restarts = [t for t in range(1, 64) if positions[t] == 0]
            assert restarts == [t for t in range(1, 64) if start + t in starts] and restarts
            assert all(positions[t] == positions[t - 1] + 1 for t in range(1, 64) if t not in restarts)
    batch = next(iter(data.train_dataloader(seed=0)))
    assert batch["positions"].shape == (4, 64)
    assert "positions" not in TokenShards(str(tmp_path / "s"), seq_len=64, eval_samples=4).load()[0][0]


def test_a_window_stride_starts_a_training_window_every_stride_tokens(corpus, tmp_path):
    """data.window_stride=8 (and 1) of seq_len 32: window i starts at token 8i, the windows reach up to
    the first held-out token and no further, the eval windows are those of the default stride; a run
    trains on other windows than the default's (another loss curve). A stride above seq_len is refused."""
    prepare(tmp_path / "s", str(corpus / "lines.jsonl"), workers=1, progress=False)
    store = TokenStore(tmp_path / "s")
    plain = TokenShards(str(tmp_path / "s"), seq_len=32, eval_samples=4)
    plain.setup()
    held_out = len(plain.train_set) * 32
    for stride in (8, 1):
        data = TokenShards(str(tmp_path / "s"), seq_len=32, eval_samples=4, window_stride=stride)
        data.setup()
        assert len(data.train_set) == (held_out - 32) // stride + 1
        last = len(data.train_set) - 1
        for i in (0, 1, last):
            expected = torch.from_numpy(store.read(i * stride, i * stride + 33).astype(np.int64))
            assert torch.equal(data.train_set[i]["inputs"], expected[:-1])
            assert torch.equal(data.train_set[i]["targets"], expected[1:])
        assert last * stride + 32 <= held_out < last * stride + 32 + stride
        assert all(torch.equal(data.eval_set[i]["inputs"], plain.eval_set[i]["inputs"]) for i in range(4))
    with pytest.raises(ConfigError, match=r"data.window_stride=33: above data.seq_len=32"):
        TokenShards(str(tmp_path / "s"), seq_len=32, window_stride=33)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["data=tokens", f"data.path={tmp_path / 's'}", "data.seq_len=32", "data.batch_size=4",
                       "task=language_modeling", "model=gpt", "tracker=none", "trainer.max_steps=5",
                       "trainer.plots=false", "trainer.save_model=false"],
        )  # fmt: skip
    losses = {}
    for stride in (None, 4):
        cfg.data.window_stride = stride
        (tmp_path / str(stride)).mkdir()
        losses[stride] = Trainer(cfg, tmp_path / str(stride)).fit()["train/loss"]
    assert losses[None] != losses[4]


def test_a_character_level_vocabulary_is_the_corpus_own_characters(corpus, tmp_path):
    """data.tokenizer=chars: the manifest lists the sources' characters, sorted; token i is the i-th (é
    one token, where byte-level it is two), the windows decode to the text, the model's vocab_size is
    their number; preparing again keeps the shards."""
    text = "".join(json.loads(line)["text"] + "\n" for line in (corpus / "lines.jsonl").read_text().splitlines())
    text += "café\n"
    (tmp_path / "corpus.txt").write_text(text)
    manifest = prepare(tmp_path / "c", str(tmp_path / "corpus.txt"), tokenizer="chars", workers=1, progress=False)
    assert manifest.characters == "".join(sorted(set(text))) and manifest.tokenizer == "chars"
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["characters"] == manifest.characters
    data = TokenShards(str(tmp_path / "c"), seq_len=32, eval_samples=2, tokenizer="chars", source=str(tmp_path / "corpus.txt"))
    data.setup()
    assert data.dims == {"vocab_size": len(set(text))} and len(set(text)) < 256
    decoded = "".join(manifest.characters[i] for i in data.train_set[0]["inputs"].tolist())
    assert decoded == text[:32]
    assert TokenStore(tmp_path / "c").manifest.tokens == len(text)  # é: one token
    again = prepare(tmp_path / "c", str(tmp_path / "corpus.txt"), tokenizer="chars", workers=1, progress=False)
    assert again.shards == manifest.shards


def test_a_gpt_given_positions_attends_within_each_document_only():
    """The logits of a document packed after another equal those of the document alone; without the
    positions (plain causal attention) they do not."""
    torch.manual_seed(0)
    model = GPT(vocab_size=50, max_seq_len=32, d_model=32, n_layers=2, n_heads=4).eval()
    first, second = torch.randint(50, (1, 7)), torch.randint(50, (1, 9))
    packed = torch.cat([first, second], dim=1)
    positions = document_positions(16, torch.tensor([7]))[None]
    assert positions.tolist() == [[*range(7), *range(9)]]
    with torch.no_grad():
        alone = model(second)
        masked = model_outputs(model, {"inputs": packed, "targets": packed, "positions": positions})
        plain = model(packed)
    torch.testing.assert_close(masked[:, 7:], alone)
    torch.testing.assert_close(masked[:, :7], model(first))
    assert not torch.allclose(plain[:, 7:], alone, atol=1e-3)


def test_document_mask_with_a_model_or_hardware_that_cannot_is_refused(corpus, tmp_path):
    prepare(tmp_path / "s", str(corpus / "lines.jsonl"), workers=1, progress=False)
    data = [
        "data=tokens", f"data.path={tmp_path / 's'}", "data.seq_len=32", "data.batch_size=4",
        "data.document_mask=true", "task=language_modeling",
    ]  # fmt: skip
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hf = compose("config", overrides=[*data, "model=hf_causal_lm", "tracker=none"])
        mamba = compose(  # a transformers LM whose attention-free blocks know no documents
            "config",
            overrides=[*data, "model=hf_causal_lm", "model.config.model_type=mamba", "tracker=none",
                       "~model.config.num_attention_heads", "~model.config.num_key_value_heads",
                       "~model.config.max_position_embeddings"],
        )  # fmt: skip
        cp = compose(
            "config",
            overrides=[*data, "model=gpt", "hardware=tensor_parallel", "hardware.cp_size=2", "hardware.tp_size=1",
                       "hardware.device=cpu", "tracker=none"],
        )  # fmt: skip
        pp = compose(
            "config",
            overrides=[*data, "model=gpt", "hardware=tensor_parallel", "hardware.pp_size=2", "hardware.tp_size=1",
                       "hardware.device=cpu", "tracker=none"],
        )  # fmt: skip
        ok = compose("config", overrides=[*data, "model=gpt", "tracker=none"])
    with pytest.raises(
        ConfigError, match=r"data.document_mask=true gives the model .* forward does not take it"
    ):
        check_job(mamba)
    check_job(hf)  # a Llama's attention masks follow the positions (test_chat checks its logits)
    with pytest.raises(ConfigError, match=r"hardware.cp_size=2 with samples that mask attention by document"):
        check_job(cp)
    with pytest.raises(ConfigError, match=r"hardware.pp_size=2 with samples that mask attention by document"):
        check_job(pp)
    check_job(ok)
    # the run trains with the mask: its losses are not those of plain causal attention
    losses = {}
    for masked in ("true", "false"):
        ok.data.document_mask = masked == "true"
        ok.trainer.max_steps, ok.trainer.plots, ok.trainer.save_model = 5, False, False
        (tmp_path / masked).mkdir()
        losses[masked] = Trainer(ok, tmp_path / masked).fit()["train/loss"]
    assert losses["true"] != losses["false"]
