import pytest
import torch
from safetensors.torch import load_file

from runner.models import GPT, MLP


def test_gpt_is_causal_and_generates():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4).eval()
    ids = torch.randint(0, 32, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 32  # alter only the future of position 7
    logits, logits_changed = model(ids), model(changed)
    assert logits.shape == (2, 12, 32)
    assert torch.allclose(logits[:, :8], logits_changed[:, :8], atol=1e-6)
    assert not torch.allclose(logits[:, 8:], logits_changed[:, 8:])
    out = model.generate(ids[:, :4], max_new_tokens=20)  # longer than max_seq_len: the context is cropped
    assert out.shape == (2, 24) and torch.equal(out[:, :4], ids[:, :4])
    assert model.lm_head.weight is model.tok_emb.weight


def test_gpt_refuses_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        GPT(vocab_size=8, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(vocab_size=8, max_seq_len=4, d_model=8, n_heads=2)(torch.zeros(1, 5, dtype=torch.long))


def test_mlp_shapes():
    assert MLP(in_features=5, out_features=3, hidden_size=7, num_layers=2)(torch.randn(4, 5)).shape == (4, 3)


def test_gpt_mlp_ratio_sizes_each_blocks_mlp_and_tie_embeddings_shares_the_output_layer():
    tied = GPT(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, mlp_ratio=3)
    assert all(block.mlp.fc_in.out_features == 48 for block in tied.blocks)
    untied = GPT(
        vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, mlp_ratio=3, tie_embeddings=False
    )
    assert untied.lm_head.weight is not untied.tok_emb.weight
    count = [sum(p.numel() for p in model.parameters()) for model in (tied, untied)]
    assert count[1] - count[0] == 32 * 16  # an output layer of its own


def test_gpt_bias_false_has_no_biases_and_scaled_init_narrows_the_residual_projections():
    sizes = {"vocab_size": 64, "max_seq_len": 8, "d_model": 256, "n_layers": 8, "n_heads": 4}
    torch.manual_seed(0)
    biased, plain = GPT(**sizes), GPT(**sizes, bias=False)
    biases = {name: p.numel() for name, p in biased.named_parameters() if name.endswith(".bias")}
    assert len(biases) == 8 * 8 + 1 and not [n for n, _ in plain.named_parameters() if n.endswith(".bias")]
    count = [sum(p.numel() for p in model.parameters()) for model in (biased, plain)]
    assert count[0] - count[1] == sum(biases.values())
    assert plain(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 64)

    scaled = GPT(**sizes, scaled_init=True)
    for block in scaled.blocks:
        for residual in (block.attn.o_proj, block.mlp.fc_out):  # 0.02 / sqrt(2 * 8) = 0.005
            assert residual.weight.std().item() == pytest.approx(0.005, rel=0.05)
        assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert biased.blocks[0].attn.o_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_gpt_bias_and_scaled_init_reach_the_model_from_yaml(run_cli):
    proc = run_cli(
        "experiment=gpt_sonnets", "model.bias=false", "model.scaled_init=true", "trainer.max_steps=1",
        "trainer.eval_every=0", "tracker=none", "trainer.plots=false",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    weights = {k: v for path in (proc.run_dir / "model").glob("*.safetensors") for k, v in load_file(path).items()}
    assert weights and not [name for name in weights if name.endswith(".bias")]
    # one AdamW step (lr 3e-3) after an init of std 0.02 / sqrt(2 * 2) = 0.01 for the residual projections
    assert weights["blocks.0.attn.o_proj.weight"].std() < 0.0125 < 0.0175 < weights["blocks.0.attn.q_proj.weight"].std()
