"""bench/kernels/bench_blas.py without a GPU: every product kind computes the math it stands for, in the
layout it claims (the timings themselves run on the device)."""
import pytest
import torch

from bench.kernels import bench_blas


@pytest.mark.parametrize("kind", ["bias", "fwd", "dinp", "dinp-wt", "acc", "acc-t"])
def test_product_kinds(kind):
    M, K, N = 24, 40, 16
    gen = torch.Generator().manual_seed(0)
    a, b, bias, out = bench_blas._operands(kind, M, K, N, gen, device="cpu")
    assert a.shape == (M, K) and b.shape == (K, N) and out.shape == (M, N)
    # the layouts: weights enter transposed in the forward (and as a transposed copy), dout^T in dweight
    assert b.is_contiguous() == (kind not in ("bias", "fwd", "dinp-wt"))
    assert a.is_contiguous() == (kind not in ("acc", "acc-t"))
    before = out.clone()
    bench_blas._product(kind, a, b, bias, out)
    expect = a.double() @ b.double()
    if kind == "bias":
        expect = expect + bias.double()
    if kind in ("acc", "acc-t"):
        expect = expect + before.double()
    err = ((out.double() - expect).norm() / expect.norm()).item()
    assert err < 1e-2, (kind, err)


def test_products_cover_a_step():
    """Every product of the step is counted (forward, input and weight gradients of the 4 layer matmuls
    and the lm_head), and the layout variants are not."""
    names = [p[0] for p in bench_blas.PRODUCTS]
    for layer in ("qkv", "attproj", "fc", "fcproj", "lm_head"):
        for part in ("fwd", "dinp", "dweight"):
            assert f"{layer} {part}" in names
    assert all(p[1] == 0 for p in bench_blas.LAYOUT_VARIANTS)
    flops = sum(calls * 2 * M * K * N for _, calls, _, M, K, N in bench_blas.PRODUCTS)
    assert abs(flops / 1e12 - 48.6) < 0.5  # ANCHORS.md: the step's linear layers, 48.6 TFLOP


def test_bench_cublaslt_report(capsys):
    """bench_cublaslt's table: step totals (torch, the first-ranked algorithm, the best of all) and the
    fused epilogues against their unfused pairs, with '-' where cuBLASLt had no algorithm."""
    from bench.kernels import bench_cublaslt
    rows = [dict(name="fc fwd", calls=2, torch=1.0, lt={"0": 1.2, "1": 0.8},
                 gelu_aux_bias={"0": 1.1, "1": None}, **{"torch+gelu": 1.5}),
            dict(name="qkv dweight", calls=3, torch=0.5, lt={"0": None, "1": 0.6},
                 bgradb={"0": None, "1": None}, **{"torch+bias": 0.7})]
    bench_cublaslt.report({"rows": rows}, 2)
    out = capsys.readouterr().out
    # torch 2*1.0 + 3*0.5; first algorithm 2*1.2 + 3*0.5 (none: torch's); best 2*0.8 + 3*0.5
    assert "step: torch 3.50 ms, cuBLASLt first algorithm 3.90 ms, best of all 3.10 ms" in out
    assert "gelu_aux_bias" in out and "vs torch+gelu   1.500" in out and "vs torch+bias   0.700" in out
