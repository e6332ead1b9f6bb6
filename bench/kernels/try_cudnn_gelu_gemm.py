"""Throwaway: cuDNN's matmul + GELU fusions (frontend graphs) against cuBLASLt's DGELU / GELU_AUX_BIAS
at GPT-2 124M's fc shapes. Every execution plan cuDNN offers is built, checked against an fp32 oracle and
timed; the best few are then timed alternated with cuBLASLt's kernel, sustained at the power cap."""
import math
import sys
import time
import traceback

import torch
from triton.testing import do_bench

sys.path[:0] = ["src", ".vendor"]  # run from the repository root
from llmpy.kernels import cublaslt as lt  # noqa: E402
from llmpy.kernels.matmul import _tuned  # noqa: E402

import cudnn  # noqa: E402

M, C, H = 65536, 768, 3072
dev = torch.device("cuda")
torch.manual_seed(1)
BF, F32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
handle = cudnn.create_handle()
cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)


def gelu_grad(x):
    k = math.sqrt(2 / math.pi)
    u = k * (x + 0.044715 * x ** 3)
    t = torch.tanh(u)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def sustained(fn, ms=150):
    """ms a call, back to back for ~ms at the cap (after a short warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def plans(g, tensors, outs, ref, label, ws_cap=1 << 30):
    g.validate()
    g.build_operation_graph()
    modes = [m for m in ("A", "B", "FALLBACK") if hasattr(cudnn.heur_mode, m)]
    g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in modes])
    try:
        g.check_support()
    except Exception as e:  # noqa: BLE001
        print(f"{label}: check_support: {e}")
    n = g.get_execution_plan_count()
    print(f"{label}: {n} plans (modes {modes})")
    found = []
    for i in range(n):
        try:
            g.build_plan_at_index(i)
            ws = g.get_workspace_size_plan_at_index(i)
            if ws > ws_cap:
                print(f"  plan {i}: workspace {ws} too big")
                continue
            work = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
            pack = {t: p.data_ptr() for t, p in tensors.items()}
            run = lambda i=i, pack=pack, work=work: g.execute_plan_at_index(pack, work.data_ptr(), i, handle=handle)  # noqa: E731
            for o in outs:
                o.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            errs = [((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, ref)]
            ms = do_bench(run, warmup=10, rep=40)
            try:
                notes = g.get_behavior_notes_for_plan_at_index(i)
            except Exception:  # noqa: BLE001
                notes = "?"
            print(f"  plan {i}: {ms:.4f} ms  rel err {['%.2e' % e for e in errs]}  ws {ws}  notes {notes}")
            if all(e < 2e-2 for e in errs):
                found.append((ms, i, run))
        except Exception as e:  # noqa: BLE001
            print(f"  plan {i}: failed: {str(e).splitlines()[0][:160]}")
    found.sort(key=lambda x: x[0])
    return found


def dgelu():
    dout = (torch.randn(M, C, device=dev) * 0.5).bfloat16()
    w = (torch.randn(C, H, device=dev) * 0.02).bfloat16()   # fcproj's weight (OC=C, H)
    pre = torch.randn(M, H, device=dev).bfloat16()
    ref = (dout.float() @ w.float()) * gelu_grad(pre.float())
    lt_out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    rank = _tuned("dinp_dgelu", M, C, H, dev) or 0
    lt_run = lambda: lt.linear_input_grad(lt_out, dout, w, pre_gelu=pre, algo_index=rank)  # noqa: E731
    lt_run()
    torch.cuda.synchronize()
    print(f"cuBLASLt DGELU (rank {rank}): rel err {((lt_out.float() - ref).abs().max() / ref.abs().max()).item():.2e}, "
          f"{do_bench(lt_run, warmup=10, rep=40):.4f} ms")
    mm_out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    mm_run = lambda: torch.mm(dout, w, out=mm_out)  # noqa: E731
    print(f"torch.mm plain: {do_bench(mm_run, warmup=10, rep=40):.4f} ms")

    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    a = g.tensor(name="a", dim=[1, M, C], stride=[M * C, C, 1], data_type=BF)
    b = g.tensor(name="b", dim=[1, C, H], stride=[C * H, H, 1], data_type=BF)
    p = g.tensor(name="pre", dim=[1, M, H], stride=[M * H, H, 1], data_type=BF)
    mm = g.matmul(name="mm", A=a, B=b, compute_data_type=F32)
    mm.set_data_type(F32)
    try:
        o = g.gelu_approx_tanh_backward(loss=mm, input=p, compute_data_type=F32, name="dgelu")
    except TypeError:
        print(g.gelu_approx_tanh_backward.__doc__)
        raise
    o.set_output(True).set_data_type(BF).set_dim([1, M, H]).set_stride([M * H, H, 1])
    out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    found = plans(g, {a: dout, b: w, p: pre, o: out}, [out], [ref], "cuDNN matmul + GELU_APPROX_TANH_BWD")
    alternate("dgelu", lt_run, mm_run, found)


def gelu_aux():
    x = torch.randn(M, C, device=dev).bfloat16()
    w = (torch.randn(H, C, device=dev) * 0.02).bfloat16()   # fc's weight (H, C)
    bias = (torch.randn(H, device=dev) * 0.1).bfloat16()
    pre_ref = x.float() @ w.float().t() + bias.float()
    ref = [pre_ref, gelu(pre_ref)]
    lt_out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    lt_pre = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    rank = _tuned("gelu_aux_bias", M, C, H, dev) or 0
    lt_run = lambda: lt.linear_forward(lt_out, x, w, bias, pre_gelu=lt_pre, algo_index=rank)  # noqa: E731
    lt_run()
    torch.cuda.synchronize()
    print(f"cuBLASLt GELU_AUX_BIAS (rank {rank}): rel err {((lt_out.float() - ref[1]).abs().max() / ref[1].abs().max()).item():.2e}, "
          f"{do_bench(lt_run, warmup=10, rep=40):.4f} ms")
    mm_out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    mm_run = lambda: torch.addmm(bias, x, w.t(), out=mm_out)  # noqa: E731

    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    a = g.tensor(name="a", dim=[1, M, C], stride=[M * C, C, 1], data_type=BF)
    b = g.tensor(name="b", dim=[1, C, H], stride=[C * H, 1, C], data_type=BF)
    bt = g.tensor(name="bias", dim=[1, 1, H], stride=[H, H, 1], data_type=BF)
    mm = g.matmul(name="mm", A=a, B=b, compute_data_type=F32)
    mm.set_data_type(F32)
    pre = g.add(a=mm, b=bt, compute_data_type=F32, name="bias_add")
    pre.set_output(True).set_data_type(BF).set_dim([1, M, H]).set_stride([M * H, H, 1])
    o = g.gelu_approx_tanh(input=pre, compute_data_type=F32, name="gelu")
    o.set_output(True).set_data_type(BF).set_dim([1, M, H]).set_stride([M * H, H, 1])
    out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    pre_out = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    found = plans(g, {a: x, b: w, bt: bias, pre: pre_out, o: out}, [pre_out, out], ref,
                  "cuDNN matmul + bias + GELU_APPROX_TANH (pre kept)")
    alternate("gelu_aux", lt_run, mm_run, found)


def alternate(label, lt_run, mm_run, found):
    if not found:
        print(f"{label}: no cuDNN plan passed")
        return
    cands = [("cublaslt", lt_run), ("torch.mm plain", mm_run)] + [(f"cudnn plan {i}", r) for _, i, r in found[:3]]
    rows = {name: [] for name, _ in cands}
    for _ in range(3):
        for name, fn in cands:
            rows[name].append(sustained(fn))
    for name, v in rows.items():
        print(f"  {label} at the cap: {name:16s} " + " ".join(f"{x:.4f}" for x in v))


for part in (dgelu, gelu_aux):
    try:
        part()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
