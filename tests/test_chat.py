"""`data=chat`: conversations rendered by a chat template, the loss on the assistant's tokens only (checked
token by token on a hand-made conversation), packing that gives each conversation the loss it has alone
(runner's GPT and a transformers Llama, through the positions), and the input it refuses before launch."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from conftest import run_to_end
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from runner.config import CONF_DIR
from runner.data.chat import IGNORED, ChatData
from runner.errors import ConfigError
from runner.export import export_hf
from runner.group_schemas import register_configs
from runner.models.gpt import GPT
from runner.models.hf import causal_lm
from runner.task import model_outputs
from runner.validate import check_job

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [
    "how", "are", "you", "fine", "thanks", "and", "good", "what", "is", "two", "plus", "three", "five",
    *"abcdefghijklmnop",
]  # fmt: skip
HAND_MADE = [
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "and you"},
    {"role": "assistant", "content": "good"},
]


def conversation(i: int) -> list[dict[str, str]]:
    """A conversation of 1 to 3 exchanges of a few words each, different for each i."""
    rng = torch.Generator().manual_seed(i)

    def words(n: int) -> str:
        return " ".join(WORDS[j] for j in torch.randint(len(WORDS), (n,), generator=rng).tolist())

    turns = []
    for _ in range(1 + i % 3):
        turns += [
            {"role": "user", "content": words(2 + i % 4)},
            {"role": "assistant", "content": words(1 + i % 5)},
        ]
    return turns


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A word-level tokenizer with a chat template, 60 conversations as JSON lines and the same as
    system/prompt/response columns in parquet."""
    root = tmp_path_factory.mktemp("chat")
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]", *ROLES])
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
        additional_special_tokens=ROLES,
    )  # fmt: skip
    fast.save_pretrained(root / "plain_tokenizer")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(root / "tokenizer")
    rows = [conversation(i) for i in range(60)]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": turns}) + "\n" for turns in rows))
    pairs = [conversation(i)[:2] for i in range(60)]
    (root / "pairs.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "system", "content": "a b"}, *turns]}) + "\n" for turns in pairs
        )
    )
    datasets.Dataset.from_dict(
        {
            "sys": ["a b"] * 60,
            "prompt": [turns[0]["content"] for turns in pairs],
            "response": [turns[1]["content"] for turns in pairs],
        }
    ).to_parquet(root / "pairs.parquet")
    return root


def chat(files: Path, **settings) -> ChatData:
    data = ChatData(
        path=str(files / settings.pop("name", "chats.jsonl")), tokenizer=str(files / "tokenizer"), **settings
    )
    data.setup()
    return data


def test_the_trained_targets_are_exactly_the_assistants_tokens(files, tmp_path):
    """A hand-made conversation: the targets kept are the assistant's words and the `<|end|>` that
    closes each assistant turn, at the positions that predict them; the headers, the user's words and
    the padding are masked."""
    path = tmp_path / "one.jsonl"
    path.write_text(
        json.dumps({"messages": HAND_MADE}) + "\n" + json.dumps({"messages": HAND_MADE[:2]}) + "\n"
    )
    data = ChatData(path=str(path), tokenizer=str(files / "tokenizer"), seq_len=20, eval_fraction=0.5)
    data.setup()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(files / "tokenizer")
    sample = next(s for s in [data.train_set[0], data.eval_set[0]] if (s["targets"] != IGNORED).sum() == 5)
    inputs, targets = sample["inputs"].tolist(), sample["targets"].tolist()
    assert tokenizer.convert_ids_to_tokens(inputs[:15]) == [
        "<|user|>", "how", "are", "you", "<|end|>", "<|assistant|>", "fine", "thanks", "<|end|>",
        "<|user|>", "and", "you", "<|end|>", "<|assistant|>", "good",
    ]  # fmt: skip
    trained = [t for t, target in enumerate(targets) if target != IGNORED]
    assert trained == [5, 6, 7, 13, 14]
    assert tokenizer.convert_ids_to_tokens([targets[t] for t in trained]) == [
        "fine", "thanks", "<|end|>", "good", "<|end|>"
    ]  # fmt: skip
    assert inputs[15:] == [tokenizer.pad_token_id] * 5 and targets[15:] == [IGNORED] * 5


def test_prompt_and_response_columns_make_the_rows_of_the_same_messages(files):
    """system/prompt/response columns in parquet give exactly the rows of the same turns as messages."""
    pairs = chat(files, name="pairs.parquet", system_column="sys", seq_len=24)
    messages = chat(files, name="pairs.jsonl", seq_len=24)
    for split in ("train_set", "eval_set"):
        for key in ("inputs", "targets"):
            assert torch.equal(getattr(pairs, split).tensors[key], getattr(messages, split).tensors[key])


def token_losses(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The sum of the trained tokens' losses over `rows`, and their count."""
    with torch.no_grad():
        logits = model_outputs(model, rows)
    loss = F.cross_entropy(logits.flatten(0, 1), rows["targets"].flatten(), reduction="sum")
    return loss, int((rows["targets"] != IGNORED).sum())


@pytest.mark.parametrize("model", ["gpt", "llama", "llama_lora"])
def test_packed_conversations_have_the_loss_they_have_alone(files, model):
    """The same training conversations, packed (fewer rows) and one a row: every trained token's loss is
    the same within 1e-5 on runner's GPT and a transformers Llama (its mask from the positions), also
    under a LoRA adapter; the positions restart at each conversation."""
    torch.manual_seed(0)
    vocab = len(PreTrainedTokenizerFast.from_pretrained(files / "tokenizer"))
    built = {
        "gpt": lambda: GPT(vocab_size=vocab, max_seq_len=64, d_model=32, n_layers=2, n_heads=4),
        "llama": lambda: causal_lm(config=LLAMA, vocab_size=vocab),
        "llama_lora": lambda: causal_lm(config=LLAMA, vocab_size=vocab, peft={"method": "lora", "r": 4}),
    }[model]().eval()
    alone, packed = chat(files, seq_len=64), chat(files, seq_len=64, packing=True)
    rows = packed.train_set.tensors
    assert len(rows["inputs"]) < len(alone.train_set) // 2
    assert (rows["positions"][:, 0] == 0).all() and (rows["positions"] == 0).sum() > 2 * len(rows["inputs"])
    (summed, count), (packed_sum, packed_count) = (
        token_losses(built, alone.train_set.tensors),
        token_losses(built, rows),
    )
    assert count == packed_count > 0
    torch.testing.assert_close(packed_sum / packed_count, summed / count, rtol=1e-5, atol=1e-6)
    assert "positions" not in packed.eval_set.tensors  # evaluation: one conversation a row


LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
}  # fmt: skip


def test_overlong_conversations_are_dropped_or_truncated_and_counted(files, caplog):
    """seq_len 16: the long conversations are left out, or cut to 16 tokens; the log says how many."""
    whole = chat(files, seq_len=64)
    with caplog.at_level("INFO", logger="runner.data.chat"):
        dropped = chat(files, seq_len=16)
        truncated = chat(files, seq_len=16, overlong="truncate")
    assert len(dropped.train_set) < len(truncated.train_set) == len(whole.train_set)
    assert (truncated.train_set.tensors["targets"] != IGNORED).any(-1).all()
    lines = [r.getMessage() for r in caplog.records]
    count = len(whole.train_set) - len(dropped.train_set)
    assert any(f"; {count} longer than data.seq_len=16 dropped" in line for line in lines), lines
    assert any("longer than data.seq_len=16 truncated" in line for line in lines), lines
    assert any("trained (the assistant's)" in line and "masked" in line for line in lines), lines


@pytest.mark.parametrize(
    ("rows", "settings", "expected"),
    [
        ([{"text": "a"}], {}, r"has neither a messages column .* its columns: \['text'\]"),
        ([{"messages": HAND_MADE}, {"messages": "how are you"}], {}, r"row 2 of .*bad\.jsonl holds 'how are you', not a list of turns"),
        ([{"messages": HAND_MADE}, {"messages": [{"role": "user", "content": "a"}]}], {}, r"row 2 of .* has no assistant turn"),
        ([{"messages": HAND_MADE}], {"tokenizer": "plain_tokenizer"}, r"the tokenizer has no chat template"),
        ([{"messages": HAND_MADE}], {"template": "{{ messages[-1]['content'] }}"}, r"row 1: the chat template renders the turns before assistant turn 2 differently"),
        ([{"messages": HAND_MADE}], {"seq_len": 3}, r"data.seq_len=3: none of the training conversations"),
    ],
)  # fmt: skip
def test_conversations_that_cannot_be_trained_on_are_refused_naming_the_file_and_row(
    files, tmp_path, rows, settings, expected
):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [*rows, *rows]))
    template = None
    if "template" in settings:
        template = tmp_path / "template.jinja"
        template.write_text(settings.pop("template"))
    tokenizer = files / settings.pop("tokenizer", "tokenizer")
    with pytest.raises(ConfigError, match=expected):
        ChatData(
            path=str(path),
            tokenizer=str(tokenizer),
            chat_template=template and str(template),
            eval_fraction=0.5,
            **settings,
        ).setup()


def test_a_chat_run_trains_on_the_assistants_tokens_and_packing_changes_its_rows(files, tmp_path):
    """Two real runs of a Llama with LoRA: the log gives the token counts; packed, the run has fewer rows
    and another loss curve. A model that cannot attend within conversations is refused before launch."""
    common = [
        "data=chat", f"data.path={files / 'chats.jsonl'}", f"data.tokenizer={files / 'tokenizer'}", "data.seq_len=64",
        "data.batch_size=4", "task=language_modeling", "model=hf_causal_lm", "model.config.hidden_size=32",
        "model.config.intermediate_size=64", "model/peft=lora", "optimizer.lr=1e-2", "trainer.max_steps=6",
        "trainer.log_every=1", "trainer.eval_every=0",
    ]  # fmt: skip
    consoles, curves = {}, {}
    for packing in ("false", "true"):
        run_dir = tmp_path / packing
        consoles[packing] = run_to_end(run_dir, *common, f"data.packing={packing}").stderr
        lines = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
        curves[packing] = [line["train/loss"] for line in lines if "train/loss" in line]
        assert (run_dir / "model" / "adapter_config.json").is_file()
    assert "54 conversations to train on, 6 to evaluate" in consoles["false"], consoles["false"]
    assert "trained (the assistant's)" in consoles["false"] and "packed" in consoles["true"]
    assert curves["false"] != curves["true"] and all(loss == loss for loss in curves["true"])
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        mamba = compose(
            "config",
            overrides=[*(o for o in common if o != "model/peft=lora"), "data.packing=true", "model.config.model_type=mamba", "tracker=none",
                       "~model.config.num_attention_heads", "~model.config.num_key_value_heads",
                       "~model.config.max_position_embeddings"],
        )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"data.packing=true gives the model .* does not attend within documents"
    ):
        check_job(mamba)


def test_a_pretrained_model_fine_tuned_on_chats_exports_with_its_tokenizer_and_template(files, tmp_path):
    """A pretrained Llama (the data's vocabulary is its own) fully fine-tuned on conversations: `runner
    export` reads its vocabulary from the model, not the data, and writes the tokenizer with its chat
    template; the exported model's logits are the checkpoint's."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(files / "tokenizer")
    torch.manual_seed(0)
    base = causal_lm(config=LLAMA, vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    run_dir = tmp_path / "run"
    run_to_end(
        run_dir, "data=chat", f"data.path={files / 'chats.jsonl'}", f"data.tokenizer={tmp_path / 'base'}",
        "data.seq_len=64", "task=language_modeling", "model=hf_causal_lm", f"model.pretrained={tmp_path / 'base'}",
        "trainer.max_steps=3", "trainer.eval_every=0",
    )  # fmt: skip
    exported = export_hf(run_dir, tmp_path / "hf")
    assert exported.architecture == "LlamaForCausalLM" and exported.max_difference < 1e-5
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == TEMPLATE
