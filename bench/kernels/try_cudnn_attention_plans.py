"""Throwaway: every cuDNN execution plan for GPT-2 124M's causal attention, against the model's calls.

The model builds cuDNN's SDPA forward with the frontend's default (implementation AUTO, heuristics A then
FALLBACK, first plan that builds). This lists every plan the frontend offers for the forward (and for the
deterministic backward), for each implementation (AUTO, COMPOSITE, UNIFIED), each heuristic mode and each
engine's knob settings; checks each against the model's result; times it with do_bench; then alternates
the fastest few with the model's call, sustained at the power cap.

    PYTHONPATH=src:.:.vendor python bench/kernels/try_cudnn_attention_plans.py [--backward]
"""
import argparse
import itertools
import math
import sys
import time

import torch
from triton.testing import do_bench

sys.path[:0] = ["src", ".", ".vendor"]  # run from the repository root
from llmpy.kernels import cudnn_attention as ca  # noqa: E402
from llmpy.kernels import flash_attention as fa  # noqa: E402

import cudnn  # noqa: E402

B, T, NH, hs = 64, 1024, 12, 64
C = NH * hs
dev = torch.device("cuda")


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


def first_line(e):
    return (str(e).splitlines() or [repr(e)])[0][:150]


def describe_knobs(g, engine):
    try:
        knobs = g.get_knobs_for_engine(engine)
    except Exception as e:  # noqa: BLE001
        return None, f"get_knobs_for_engine failed: {first_line(e)}"
    out = []
    for k in knobs:
        fields = {a: getattr(k, a, None) for a in ("type", "min_value", "max_value", "stride")}
        out.append(fields)
    return out, ", ".join(f"{f['type']}[{f['min_value']}..{f['max_value']}/{f['stride']}]" for f in out)


def knob_settings(knobs, cap=64):
    """Every combination of knob values (each range walked by its stride), at most cap of them."""
    ranges = []
    for f in knobs:
        lo, hi, st = f["min_value"], f["max_value"], f["stride"] or 1
        if lo is None or hi is None or hi - lo > 64 * st:
            return []
        ranges.append([(f["type"], v) for v in range(lo, hi + 1, st)])
    combos = list(itertools.product(*ranges))
    return [dict(c) for c in combos[:cap]]


def new_graph(kind, implementation):
    cud, g, (q, k, v), qkv_layout, out_layout, lse_layout = ca._begin(dev, B, T, NH, hs, torch.bfloat16, kind)
    extra = {} if implementation is None else {"implementation": implementation}
    if kind == "forward":
        out, lse = g.sdpa(q, k, v, generate_stats=True, attn_scale=1.0 / math.sqrt(hs), use_causal_mask=True,
                          name="sdpa", **extra)
        out.set_output(True).set_dim(out_layout[0]).set_stride(out_layout[1])
        lse.set_output(True).set_data_type(cud.data_type.FLOAT).set_dim(lse_layout[0]).set_stride(lse_layout[1])
        return g, {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    out = g.tensor(*out_layout, name="out")
    dout = g.tensor(*out_layout, name="dout")
    lse = g.tensor(*lse_layout, data_type=cud.data_type.FLOAT, name="lse")
    dq, dk, dv = g.sdpa_backward(q, k, v, out, dout, lse, attn_scale=1.0 / math.sqrt(hs), use_causal_mask=True,
                                 use_deterministic_algorithm=True, name="sdpa_backward", **extra)
    for t in (dq, dk, dv):
        t.set_output(True).set_dim(qkv_layout[0]).set_stride(qkv_layout[1])
    return g, {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ws-cap-gib", type=float, default=2.0)
    args = ap.parse_args()
    kind = "backward" if args.backward else "forward"
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, T, 3 * C, device=dev, generator=gen).bfloat16()
    out_ref = torch.empty(B, T, C, device=dev, dtype=torch.bfloat16)
    lse_ref = torch.empty(B, NH, T, device=dev, dtype=torch.float32)
    ca.cudnn_attention_forward(out_ref, lse_ref, qkv, NH)
    dout = torch.randn(B, T, C, device=dev, generator=gen).bfloat16()
    dqkv_ref = torch.empty_like(qkv)
    delta = torch.empty(B, NH, T, device=dev, dtype=torch.float32)
    if kind == "forward":
        model_run = lambda: ca.cudnn_attention_forward(out_ref, lse_ref, qkv, NH)  # noqa: E731
    else:
        model_run = lambda: fa.flash_attention_backward(dqkv_ref, dout, qkv, out_ref, lse_ref, NH, delta=delta)  # noqa: E731
    model_run()
    torch.cuda.synchronize()
    print(f"cuDNN {cudnn.backend_version_string()} frontend {cudnn.__version__}; model's {kind}: "
          f"{do_bench(model_run, warmup=10, rep=50):.4f} ms (do_bench)")

    base = qkv.data_ptr()
    step = C * 2
    state = ca._device_state(dev)
    found = []
    impls = [("default", None)] + [(n, getattr(cudnn.attention_implementation, n)) for n in ("AUTO", "COMPOSITE", "UNIFIED")
                                   if hasattr(cudnn.attention_implementation, n)]
    for impl_name, impl in impls:
        try:
            g, t = new_graph(kind, impl)
            g.validate()
            g.build_operation_graph()
        except Exception as e:  # noqa: BLE001
            print(f"[{impl_name}] graph refused: {first_line(e)}")
            continue
        try:
            n_eng = g.get_engine_count()
        except Exception as e:  # noqa: BLE001
            n_eng = 0
            print(f"[{impl_name}] get_engine_count failed: {first_line(e)}")
        print(f"[{impl_name}] {n_eng} engines")
        heur = [getattr(cudnn.heur_mode, m) for m in ("A", "B", "FALLBACK") if hasattr(cudnn.heur_mode, m)]
        try:
            g.create_execution_plans(heur)
        except Exception as e:  # noqa: BLE001
            print(f"[{impl_name}] heuristic plans failed: {first_line(e)}")
        n_heur = g.get_execution_plan_count()
        for e_id in range(n_eng):
            knobs, text = describe_knobs(g, e_id)
            print(f"[{impl_name}] engine {e_id}: knobs {text}")
            for setting in (knob_settings(knobs) if knobs else [{}]):
                try:
                    g.create_execution_plan(e_id, setting)
                except Exception as e:  # noqa: BLE001
                    print(f"   engine {e_id} {setting}: {first_line(e)}")
        n = g.get_execution_plan_count()
        print(f"[{impl_name}] {n} plans ({n_heur} from heuristics)")
        outs = {}
        if kind == "forward":
            outs = {"out": torch.empty_like(out_ref), "lse": torch.empty_like(lse_ref)}
            pack = {t["q"]: base, t["k"]: base + step, t["v"]: base + 2 * step,
                    t["out"]: outs["out"].data_ptr(), t["lse"]: outs["lse"].data_ptr()}
        else:
            dq = torch.empty_like(qkv)
            outs = {"dqkv": dq}
            pack = {t["q"]: base, t["k"]: base + step, t["v"]: base + 2 * step,
                    t["dq"]: dq.data_ptr(), t["dk"]: dq.data_ptr() + step, t["dv"]: dq.data_ptr() + 2 * step,
                    t["out"]: out_ref.data_ptr(), t["dout"]: dout.data_ptr(), t["lse"]: lse_ref.data_ptr()}
        for i in range(n):
            try:
                g.build_plan_at_index(i)
                ws = g.get_workspace_size_plan_at_index(i)
                name = g.get_plan_name_at_index(i)
            except Exception as e:  # noqa: BLE001
                print(f"   plan {i}: not built: {first_line(e)}")
                continue
            if ws > args.ws_cap_gib * 2**30:
                print(f"   plan {i} {name}: workspace {ws / 2**20:.0f} MiB, skipped")
                continue
            work = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)

            def run(i=i, g=g, pack=pack, work=work):
                state.bind()
                g.execute_plan_at_index(pack, work.data_ptr(), i, handle=state.handle)
            try:
                for o in outs.values():
                    o.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"   plan {i} {name}: run failed: {first_line(e)}")
                continue
            if kind == "forward":
                err = [(outs["out"].float() - out_ref.float()).abs().max().item(),
                       (outs["lse"] - lse_ref).abs().max().item()]
                same = torch.equal(outs["out"], out_ref)
            else:
                err = [(outs["dqkv"].float() - dqkv_ref.float()).abs().max().item()]
                same = torch.equal(outs["dqkv"], dqkv_ref)
            ms = do_bench(run, warmup=10, rep=50)
            print(f"   plan {i} {name}: {ms:.4f} ms, ws {ws / 2**20:.1f} MiB, max diff {['%.2e' % x for x in err]}"
                  f"{' (bitwise the model)' if same else ''}")
            if all(math.isfinite(x) and x < 5e-2 for x in err):
                found.append((ms, f"{impl_name}/{i}/{name}", run))
    found.sort(key=lambda x: x[0])
    print("fastest by do_bench:", [(round(m, 4), lbl) for m, lbl, _ in found[:6]])
    finalists = [("model", model_run)] + [(lbl, r) for _, lbl, r in found[:4]]
    times = {lbl: [] for lbl, _ in finalists}
    for _ in range(args.rounds):
        for lbl, r in finalists:
            times[lbl].append(sustained(r))
    for lbl, ts in times.items():
        print(f"at the cap: {lbl}: {', '.join('%.4f' % x for x in ts)} ms")


if __name__ == "__main__":
    main()
