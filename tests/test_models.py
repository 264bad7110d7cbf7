import pytest
import torch

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
