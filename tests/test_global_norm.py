"""Global gradient norm (two deterministic levels) and the device-side clip scale."""
import math

import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels.global_norm import (AGGREGATE_BLOCK, NORM_CHUNK, clip_scale, global_norm_partials,
                                      global_norm_squared, norm_aggregate, norm_partials, num_norm_partials)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5}  # the sum is fp32 either way; bf16 only stores inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, 12345, 3 * NORM_CHUNK + 5])
def test_global_norm_matches_reference(device, dtype, n):
    grads = torch.randn(n, device=device).to(dtype)
    out = torch.full((1,), float("nan"), device=device)
    partials = global_norm_partials(device, n)
    global_norm_squared(out, grads, partials)
    expected = ref.global_norm(grads.float().cpu())
    assert math.isclose(math.sqrt(out.item()), expected, rel_tol=TOL[dtype])
    again = torch.full((1,), float("nan"), device=device)
    global_norm_squared(again, grads, partials)
    assert torch.equal(out, again)


def test_global_norm_accumulates_over_buffers(device):
    a, b = torch.randn(777, device=device), torch.randn(4099, device=device)
    out = torch.zeros(1, device=device)
    partials = global_norm_partials(device, 4099)
    global_norm_squared(out, a, partials)
    global_norm_squared(out, b, partials, accumulate=True)
    assert math.isclose(math.sqrt(out.item()), ref.global_norm(torch.cat([a, b]).cpu()), rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_partials_give_the_same_bits(device, dtype, world):
    """Shards cut at chunk boundaries (ZeRO-1): each shard's chunk partials, put side by side in chunk
    order and summed by the second level, give the whole buffer's norm bit for bit."""
    from llmpy.distributed import shard_bounds
    n = 7 * NORM_CHUNK + 123
    grads = torch.randn(n, device=device).to(dtype)
    whole = torch.full((1,), float("nan"), device=device)
    global_norm_squared(whole, grads, global_norm_partials(device, n))
    gathered = torch.full((num_norm_partials(n),), float("nan"), device=device)
    for lo, hi in shard_bounds(n, world, NORM_CHUNK):
        assert lo % NORM_CHUNK == 0
        c0 = lo // NORM_CHUNK
        norm_partials(gathered[c0:], grads[lo:hi])
    sharded = torch.full((1,), float("nan"), device=device)
    norm_aggregate(sharded, gathered, num_norm_partials(n))
    assert torch.equal(whole, sharded)


@pytest.mark.parametrize("accumulate", [False, True])
def test_norm_aggregate_more_partials_than_a_block(device, accumulate):
    """More partials than the second level adds a step (AGGREGATE_BLOCK; GPT-2 124M has ~1900): its loop
    runs three times, the last block partial; the slots past count (NaN) are not read; against float64,
    plus out's value when accumulating; bitwise repeatable."""
    count = 2 * AGGREGATE_BLOCK + 37
    partials = torch.full((count + 11,), float("nan"), device=device)
    partials[:count] = torch.randn(count, device=device) ** 2
    start = torch.rand(1, device=device) * count if accumulate else torch.full((1,), float("nan"), device=device)
    results = []
    for _ in range(2):
        out = start.clone()
        norm_aggregate(out, partials, count, accumulate=accumulate)
        results.append(out)
    expected = partials[:count].double().sum().item() + (start.item() if accumulate else 0.0)
    assert math.isclose(results[0].item(), expected, rel_tol=1e-5)
    assert torch.equal(results[0], results[1])


def test_strided_partials_rejected(device):
    """Both levels index the partials as one contiguous row: a strided view is an error, not a wrong norm."""
    n = 3 * NORM_CHUNK + 5
    grads = torch.randn(n, device=device)
    strided = torch.full((2 * num_norm_partials(n),), float("nan"), device=device)[::2]
    out = torch.zeros(1, device=device)
    with pytest.raises(AssertionError):
        global_norm_squared(out, grads, strided)
    with pytest.raises(AssertionError):
        norm_aggregate(out, strided, num_norm_partials(n))


@pytest.mark.parametrize("norm,max_norm", [(4.0, 1.0), (0.5, 1.0), (3.0, 0.0)])
def test_clip_scale(device, norm, max_norm):
    scale = torch.full((1,), float("nan"), device=device)
    clip_scale(scale, torch.tensor([norm * norm], device=device), max_norm)
    assert math.isclose(scale.item(), ref.clip_scale(norm, max_norm), rel_tol=1e-6)


@pytest.mark.gpu
def test_global_norm_gpt2_124m_sized():
    grads = (torch.randn(124_475_904, device="cuda") * 1e-3).bfloat16()
    out = torch.empty(1, device="cuda")
    global_norm_squared(out, grads, global_norm_partials("cuda", grads.numel()))
    assert math.isclose(math.sqrt(out.item()), grads.float().norm().item(), rel_tol=1e-4)
