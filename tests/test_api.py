"""The Python API: create, train, sample, on a tiny model and random shards."""
import numpy as np

import llmpy
from llmpy.data import write_shard


def test_create_train_sample(tmp_path):
    rng = np.random.default_rng()
    # a learnable stream: a repeated random phrase, so the loss must fall
    phrase = rng.integers(0, 256, 40)
    write_shard(tmp_path / "t_train_000000.bin", np.tile(phrase, 100))
    write_shard(tmp_path / "t_val_000000.bin", np.tile(phrase, 20))
    model = llmpy.create_model("layers=1,channels=32,heads=2,seq=32,vocab=257")
    assert model.config.padded_vocab_size == 384
    result = llmpy.train(log=lambda *_: None, train_data=str(tmp_path / "t_train_*.bin"),
                         val_data=str(tmp_path / "t_val_*.bin"), model="layers=1,channels=32,heads=2,seq=32,vocab=257",
                         batch_size=4, seq_len=32, max_steps=30, learning_rate=1e-2, val_every=10, val_max_steps=2,
                         gen_tokens=0, progress=0)
    assert len(result.train_losses) == 30
    assert result.train_losses[-1] < 0.5 * result.train_losses[0]
    assert result.val_losses[-1][1] < result.val_losses[0][1]
    text = llmpy.sample(result.model, "ab", gen_tokens=5, temperature=0)
    assert isinstance(text, str) and len(text) > 0


def test_sample_with_the_kernel_model_matches_the_reference(device):
    """sample() takes the kernel model train() returns on a GPU (logits_last on its fixed (B, T) batch)
    and continues a prompt as the CPU reference does (fp32, greedy: the same tokens)."""
    import torch
    from llmpy.model import GPT2Model
    ref_model = llmpy.create_model("layers=1,channels=32,heads=2,seq=16,vocab=257", seed=3)
    kernel_model = GPT2Model(ref_model.config, ref_model.params_flat, 2, 8, device=device, dtype=torch.float32,
                             cuda_graph=False)
    # 12 tokens from a 3-token prompt: the context outgrows the model's T = 8 and is cropped to the last 8
    want = llmpy.sample(ref_model, "ab", gen_tokens=12, temperature=0)
    got = llmpy.sample(kernel_model, "ab", gen_tokens=12, temperature=0)
    assert got == want
