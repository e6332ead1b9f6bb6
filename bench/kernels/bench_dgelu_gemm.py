"""fcproj's DGELU product at GPT-2 124M's shape (65536 x 768 @ 768 x 3072, bf16): cuBLASLt's epilogue,
the plain product, and kernels/matmul_dgelu_wgmma.py's Gluon kernels in several configurations,
alternated round by round (triton.testing.do_bench medians). bench/RESULTS.md, run AB.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_dgelu_gemm
"""
from __future__ import annotations

import statistics

import torch
from triton.testing import do_bench

VARIANTS = {
    "n128 k32 s4, two programs an SM, epilogue via shared memory": dict(block_n=128, block_k=32, stages=4,
                                                                        programs_per_sm=2, epilogue_smem=True),
    "n128 k64 s3, two programs an SM, epilogue from registers": dict(block_n=128, block_k=64, stages=3,
                                                                     programs_per_sm=2, epilogue_smem=False),
    "n256 k64 s4, one program an SM, epilogue from registers": dict(block_n=256, block_k=64, stages=4,
                                                                    programs_per_sm=1, epilogue_smem=False),
    "warp-specialised ping-pong, k64 s6": dict(warp_specialize=True, block_k=64, stages=6),
}


def main(rounds: int = 3) -> None:
    from llmpy.kernels import cublaslt
    from llmpy.kernels.matmul_dgelu_wgmma import matmul_dgelu_wgmma
    g = torch.Generator(device="cuda").manual_seed(0)
    M, K, N = 65536, 768, 3072
    bf = torch.bfloat16
    dout = torch.randn(M, K, generator=g, device="cuda").to(bf)
    w = (torch.randn(K, N, generator=g, device="cuda") * 0.03).to(bf)
    pre = (torch.randn(M, N, generator=g, device="cuda") * 2).to(bf)
    out = torch.empty(M, N, device="cuda", dtype=bf)
    fns = {"cuBLASLt DGELU epilogue (rank 0)": lambda: cublaslt.linear_input_grad(out, dout, w, pre_gelu=pre),
           "torch.mm, no epilogue": lambda: torch.mm(dout, w, out=out)}
    for name, cfg in VARIANTS.items():
        fns[name] = lambda cfg=cfg: matmul_dgelu_wgmma(out, dout, w, pre, **cfg)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(do_bench(f, warmup=25, rep=200))
    for name, v in times.items():
        ms = statistics.median(v)
        print(f"{name:62s} {ms:.4f} ms  {2 * M * K * N / ms / 1e9:4.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
