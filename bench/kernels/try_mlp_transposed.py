"""Throwaway: the MLP's products with the 4C activations stored transposed ((4C, B*T) row-major), the
layout in which cuBLASLt's DGELU / GELU_AUX run with m = B*T. Each product: current orientation (the
model's call) against the transposed one at heuristic ranks 0..5; results compared."""
import sys
import time

import torch
from triton.testing import do_bench

sys.path[:0] = ["src", ".vendor"]  # run from the repository root
from llmpy.kernels import cublaslt as lt  # noqa: E402
from llmpy.kernels import matmul as kmm  # noqa: E402

dev = torch.device("cuda")
torch.manual_seed(1)
M, C, H, CW = 65536, 768, 3072, 776


def sustained(fn, ms=150):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def r(*shape, scale=1.0):
    return (torch.randn(*shape, device=dev) * scale).bfloat16()


def compare(label, model_call, model_out, variants, out_t):
    """variants: rank -> callable writing out_t (the transposed result, compared with model_out.t())."""
    model_call()
    torch.cuda.synchronize()
    want = model_out.float()
    base = do_bench(model_call, warmup=10, rep=40)
    timed = []
    for rank, fn in variants.items():
        try:
            out_t.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = ((out_t.float().t() - want).abs().max() / want.abs().max()).item()
            timed.append((do_bench(fn, warmup=10, rep=40), rank, err, fn))
        except Exception as e:  # noqa: BLE001
            print(f"  {label} rank {rank}: {str(e)[:120]}")
    timed.sort(key=lambda t: t[0])
    print(f"{label}: model {base:.4f} ms; transposed " + "; ".join(f"r{rk} {ms:.4f} (err {err:.1e})" for ms, rk, err, _ in timed))
    if timed:
        best = timed[0][3]
        a, b = [], []
        for _ in range(3):
            a.append(sustained(model_call))
            b.append(sustained(best))
        print(f"  at the cap: model {' '.join('%.4f' % x for x in a)} | transposed r{timed[0][1]} {' '.join('%.4f' % x for x in b)}")


dout = r(M, C, scale=0.5)
w_fcp = r(C, H, scale=0.02)          # fcproj weight (C, 4C)
w_fc = r(H, CW, scale=0.02)          # fc weight with the bias as column 768 (and 7 zero columns)
w_fc[:, C + 1:] = 0
ln2 = r(M, CW)                       # ln2 with the bias column of ones
ln2[:, C] = 1
ln2[:, C + 1:] = 0
pre = r(M, H)
preT = pre.t().contiguous()

# DGELU: dpre = (dout @ w_fcp) * gelu'(pre)
cur = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
outT = torch.empty(H, M, device=dev, dtype=torch.bfloat16)
compare("DGELU (fcproj dinp)",
        lambda: kmm.matmul_backward(cur, None, None, dout, cur, w_fcp, pre_gelu=pre, dgelu_epilogue=True, use_cublaslt=True),
        cur, {rk: (lambda rk=rk: lt._gemm(outT, dout, w_fcp, M, H, C, True, True, C, H, M, epilogue=lt.EPILOGUE_DGELU,
                                           aux=preT, aux_ld=M, algo_index=rk)) for rk in range(6)}, outT)

# fc forward: pre, h = gelu(ln2 @ w_fc^T) (bias from the ones column); model: GELU_AUX_BIAS on ln2[:, :768]
h = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
p = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
hT = torch.empty(H, M, device=dev, dtype=torch.bfloat16)
pT = torch.empty(H, M, device=dev, dtype=torch.bfloat16)
bias = w_fc[:, C].contiguous()
w768 = w_fc[:, :C].contiguous()
compare("fc forward GELU_AUX",
        lambda: kmm.matmul_forward(h, ln2[:, :C], w768, bias, pre_gelu=p, gelu_epilogue=True, use_cublaslt=True),
        h, {rk: (lambda rk=rk: lt._gemm(hT, ln2, w_fc, M, H, CW, True, False, CW, CW, M, epilogue=lt.EPILOGUE_GELU_AUX,
                                         aux=pT, aux_ld=M, algo_index=rk)) for rk in range(6)}, hT)

# fcproj forward: out (M, C) = h @ w_fcp^T + b, reading h^T
hT.copy_(h.t())
b1 = r(C, scale=0.1)
o = torch.empty(M, C, device=dev, dtype=torch.bfloat16)
o2 = torch.empty(M, C, device=dev, dtype=torch.bfloat16)



def fcproj_fwd_T(rk):
    lt._gemm(o2, w_fcp, hT, C, M, H, True, True, H, M, C, epilogue=lt.EPILOGUE_BIAS, bias=b1, algo_index=rk)


model_fwd = lambda: kmm.matmul_forward(o, h, w_fcp, b1, use_cublaslt=True)  # noqa: E731
model_fwd()
torch.cuda.synchronize()
base = do_bench(model_fwd, warmup=10, rep=40)
res = []
for rk in range(6):
    try:
        fcproj_fwd_T(rk)
        torch.cuda.synchronize()
        err = ((o2.float() - o.float()).abs().max() / o.float().abs().max()).item()
        res.append((do_bench(lambda rk=rk: fcproj_fwd_T(rk), warmup=10, rep=40), rk, err))
    except Exception as e:  # noqa: BLE001
        print(f"  fcproj fwd rank {rk}: {str(e)[:120]}")
res.sort()
print(f"fcproj forward reading h^T: model {base:.4f}; " + "; ".join(f"r{rk} {ms:.4f} (err {err:.1e})" for ms, rk, err in res))

# fcproj dweight: dWp (C, H) += dout^T @ h, reading h^T
dwp = r(C, H, scale=0.01)
dwp2 = dwp.clone()
model_dw = lambda: kmm.matmul_backward(None, dwp, None, dout, h, w_fcp, use_cublaslt=True)  # noqa: E731
base = do_bench(model_dw, warmup=10, rep=40)
res = []
for rk in range(6):
    try:
        fn = lambda rk=rk: lt._gemm(dwp2, hT, dout, H, C, M, True, True, M, C, H, accumulate=True, algo_index=rk)  # noqa: E731
        res.append((do_bench(fn, warmup=10, rep=40), rk))
    except Exception as e:  # noqa: BLE001
        print(f"  fcproj dweight rank {rk}: {str(e)[:120]}")
res.sort()
print(f"fcproj dweight reading h^T: model {base:.4f}; " + "; ".join(f"r{rk} {ms:.4f}" for ms, rk in res))

# fc dweight (with the bias column, fp32 out in the model): dW (H, CW) = dpre^T @ ln2, dpre stored as dpre^T
dpT = outT
dW = torch.zeros(H, CW, device=dev, dtype=torch.bfloat16)
res = []
for rk in range(6):
    try:
        fn = lambda rk=rk: lt._gemm(dW, ln2, dpT, CW, H, M, False, False, CW, M, CW, accumulate=True, algo_index=rk)  # noqa: E731
        res.append((do_bench(fn, warmup=10, rep=40), rk))
    except Exception as e:  # noqa: BLE001
        print(f"  fc dweight rank {rk}: {str(e)[:120]}")
res.sort()
dW2 = torch.zeros(H, CW, device=dev, dtype=torch.bfloat16)
plain = lambda: lt._gemm(dW2, ln2, cur, CW, H, M, False, True, CW, H, CW, accumulate=True)  # noqa: E731
print(f"fc dweight: current layout (bf16, heuristic 0) {do_bench(plain, warmup=10, rep=40):.4f}; dpre^T " +
      "; ".join(f"r{rk} {ms:.4f}" for ms, rk in res))

# fc dinp: dln2 (M, C) = dpre @ w768, dpre stored as dpre^T
dl = torch.empty(M, C, device=dev, dtype=torch.bfloat16)
model_dinp = lambda: kmm.matmul_backward(dl, None, None, cur, ln2[:, :C], w768, use_cublaslt=True)  # noqa: E731
base = do_bench(model_dinp, warmup=10, rep=40)
res = []
for rk in range(6):
    try:
        fn = lambda rk=rk: lt._gemm(dl, w768, dpT, C, M, H, False, True, C, M, C, algo_index=rk)  # noqa: E731
        res.append((do_bench(fn, warmup=10, rep=40), rk))
    except Exception as e:  # noqa: BLE001
        print(f"  fc dinp rank {rk}: {str(e)[:120]}")
res.sort()
print(f"fc dinp reading dpre^T: model {base:.4f}; " + "; ".join(f"r{rk} {ms:.4f}" for ms, rk in res))
