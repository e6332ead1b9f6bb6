"""Search: every configuration cuBLASLt can run for one of the step's products, not only the few its
heuristic ranks (bench_cublaslt.py times those). For each algorithm id cuBLASLt lists for bf16 with fp32
accumulation (cublasLtMatmulAlgoGetIds) that supports the product's epilogue, every tile, stage count, CTA
swizzle, custom option and cluster shape its capabilities allow is checked (cublasLtMatmulAlgoCheck, on
the host) and, if accepted, timed. With --split-k, the search of a product with a deep inner dimension (the
weight gradients, lm_head's input gradient; the others are searched whole) is over split-K configurations
instead (the inner dimension in parts, summed in fp32 in the workspace by default: --reductions), for outputs
too small to fill the GPU with tiles; the search takes each tile with each split that fills whole waves of the
SMs (the tiles' shapes read from the cublasLt.h beside the library), with the swizzles, custom options and
cluster shapes narrowed to those earlier searches chose.

Each product is one the GPT-2 124M step (B=64, T=1024; another shape with --B, --T) runs, through
kernels/cublaslt.py, on fresh random operands. The quick screen (--budget-s seconds) times each candidate over a
millisecond of calls against the heuristic's first choice, timed again every 10 candidates (the card warms over a
search and its clock moves more than candidates differ); it takes the heuristic's algorithm ids first, then the
others in turn. The --top fastest, the heuristic's first and what the model runs now (its TUNED_ALGOS entry, or
torch's call) are then timed in --rounds alternated rounds, as bench_cublaslt times (best of 5 rounds of 20 calls)
and at the card's power cap (--sustain-ms of calls, then as many timed), and their results compared with the
heuristic's first choice (max |difference| over max |value|: the order of the sums may differ, nothing else
should). --graph-calls N times every candidate as N calls captured in a CUDA graph and replayed, as the step
runs them: the smallest products (~0.05 ms) called one by one from Python are bound by the host. --json writes
the results and a suggested table: TUNED_ALGOS with each product whose fastest finalist (a configuration, or the
heuristic's first choice as rank 0) beats the model's call by --margin in every round, which bench_step
--tuned-from (and so ab_step) runs. Whether a product's gain reaches the step only the step can say.

    PYTHONPATH=src:. python -m bench.kernels.search_cublaslt [--products dgelu ...] [--B 16] [--json F]
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import itertools
import json
import math
import statistics
import sys
import time

C, VP = 768, 50304
CW = C + 8  # ln2's row with fc's bias column (model.FC_BIAS_COLUMNS)


def chunk_rows(B: int, T: int) -> int:
    """The rows of one of the classifier's chunks in GPT-2 124M's bf16 step (model.default_classifier_chunks):
    8192 at B * T = 65536, 32768 and 16384."""
    import torch

    from llmpy.config import GPT2Config
    from llmpy.model import default_classifier_chunks
    return B * T // default_classifier_chunks(GPT2Config(), B, T, torch.bfloat16)


def products(B: int = 64, T: int = 1024) -> dict:
    """name -> (kernels.cublaslt function, its operands' shapes (the output first), the product's key in
    kernels.matmul.TUNED_ALGOS without the GPU capability), for the step at B x T; bias and pre_gelu as the
    model passes them. lm_head's products run on one chunk of the classifier's rows."""
    bt, rows = B * T, chunk_rows(B, T)
    return {
        "dgelu": ("linear_input_grad", dict(dinp=(bt, 4 * C), dout=(bt, C), weight=(C, 4 * C), pre_gelu=(bt, 4 * C)),
                  ("dinp_dgelu", bt, C, 4 * C)),
        "fc_gelu": ("linear_forward", dict(out=(bt, 4 * C), inp=(bt, C), weight=(4 * C, C), bias=(4 * C,),
                                           pre_gelu=(bt, 4 * C)), ("gelu_aux_bias", bt, C, 4 * C)),
        "qkv_fwd": ("linear_forward", dict(out=(bt, 3 * C), inp=(bt, C), weight=(3 * C, C), bias=(3 * C,)),
                    ("fwd_bias", bt, C, 3 * C)),
        # the projections as the default step runs them (bias only; the residual add is in the LayerNorm pass)
        "attproj_fwd": ("linear_forward", dict(out=(bt, C), inp=(bt, C), weight=(C, C), bias=(C,)),
                        ("fwd_bias", bt, C, C)),
        "fcproj_fwd": ("linear_forward", dict(out=(bt, C), inp=(bt, 4 * C), weight=(C, 4 * C), bias=(C,)),
                       ("fwd_bias", bt, 4 * C, C)),
        # and with residual_in_product (bench_step --residual-in-product)
        "attproj_fwd_residual": ("linear_forward", dict(out=(bt, C), inp=(bt, C), weight=(C, C), bias=(C,),
                                                        residual=(bt, C)), ("fwd_bias_residual", bt, C, C)),
        "fcproj_fwd_residual": ("linear_forward", dict(out=(bt, C), inp=(bt, 4 * C), weight=(C, 4 * C), bias=(C,),
                                                       residual=(bt, C)), ("fwd_bias_residual", bt, 4 * C, C)),
        "lm_head_fwd": ("linear_forward", dict(out=(rows, VP), inp=(rows, C), weight=(VP, C)), ("fwd", rows, C, VP)),
        "qkv_dinp": ("linear_input_grad", dict(dinp=(bt, C), dout=(bt, 3 * C), weight=(3 * C, C)),
                     ("dinp", bt, 3 * C, C)),
        "attproj_dinp": ("linear_input_grad", dict(dinp=(bt, C), dout=(bt, C), weight=(C, C)), ("dinp", bt, C, C)),
        "fc_dinp": ("linear_input_grad", dict(dinp=(bt, C), dout=(bt, 4 * C), weight=(4 * C, C)),
                    ("dinp", bt, 4 * C, C)),
        "lm_head_dinp": ("linear_input_grad", dict(dinp=(rows, C), dout=(rows, VP), weight=(VP, C)),
                         ("dinp", rows, VP, C)),
        "qkv_dweight": ("linear_weight_grad", dict(dweight=(3 * C, C), dout=(bt, 3 * C), inp=(bt, C)),
                        ("dweight", bt, 3 * C, C)),
        "attproj_dweight": ("linear_weight_grad", dict(dweight=(C, C), dout=(bt, C), inp=(bt, C)),
                            ("dweight", bt, C, C)),
        "fcproj_dweight": ("linear_weight_grad", dict(dweight=(C, 4 * C), dout=(bt, C), inp=(bt, 4 * C)),
                           ("dweight", bt, C, 4 * C)),
        "lm_head_dweight": ("linear_weight_grad", dict(dweight=(VP, C), dout=(rows, VP), inp=(rows, C)),
                            ("dweight", rows, VP, C)),
        # fc's weight and bias gradients in one product into fp32 (matmul.weight_grad_bias_column): ln2's rows with
        # their bias column, the sums overwritten, not accumulated
        "fc_dweight_wide": ("linear_weight_grad", dict(dweight=(4 * C, CW), dout=(bt, 4 * C), inp=(bt, CW)),
                            ("dweight_wide", bt, 4 * C, CW)),
    }


PRODUCTS = products()
FP32_OUTPUTS = {"fc_dweight_wide"}  # products whose output is fp32 (their inputs bf16)
# cublasLtClusterShape_t ids tried (the names for reading results: 3 is 2 x 1 CTAs)
CLUSTERS = {0: "auto", 2: "1x1", 3: "2x1", 5: "1x2", 6: "2x2", 4: "4x1", 8: "1x4"}
MAX_CUSTOM = 15  # custom options tried at most (0..15)
_CAP_SPLITK, _CAP_REDUCTION_MASK = 0, 1
_CAP_TILE_IDS, _CAP_STAGES_IDS, _CAP_SWIZZLE, _CAP_CUSTOM_MAX, _CAP_EPILOGUE_MASK = 6, 13, 2, 7, 12
# split-K candidates: the cluster shapes and nvjet custom options the plain searches chose (runs AC, AD), no swizzle
SPLIT_CLUSTERS, SPLIT_CUSTOMS = (0, 2, 3, 5), (0, 1, 3, 7)
SPLIT_MIN_PART = 2048  # the shallowest part of the inner dimension a split-K candidate may have


def tile_shapes(header: str | None = None) -> dict:
    """cublasLtMatmulTile_t id -> (rows, columns), parsed from cublasLt.h (NVIDIA's pip packages ship it in
    include/ beside lib/); {} when there is none."""
    import os
    import re

    from llmpy.kernels import cublaslt
    if header is None:
        library = cublaslt._find_library()
        if not library:
            return {}
        header = os.path.join(os.path.dirname(os.path.dirname(library)), "include", "cublasLt.h")
    try:
        with open(header) as f:
            text = f.read()
    except OSError:
        return {}
    return {int(i): (int(r), int(c)) for r, c, i in re.findall(r"CUBLASLT_MATMUL_TILE_(\d+)x(\d+)\s*=\s*(\d+)", text)}


def splits_for(k: int, splits: tuple) -> tuple:
    """The splits a product of inner dimension k is searched with: none (searched whole) when even the smallest
    would leave parts under SPLIT_MIN_PART deep."""
    return splits if splits and k // min(splits) >= SPLIT_MIN_PART else ()


def split_fills_waves(m: int, n: int, k: int, tile: tuple, splitk: int, sms: int,
                      min_part: int = SPLIT_MIN_PART) -> bool:
    """Whether splitting k in splitk parts (each at least min_part deep) makes the tiles of the m x n output
    (tile rows x columns, either way round; 128 x 128 or larger: smaller ones read more bytes a FLOP than the
    products at their best) fill whole waves of sms CTAs to 85 %, where there are fewer than eight waves of
    them (beyond that, splitting buys nothing)."""
    if k // splitk < min_part or tile[0] * tile[1] < 128 * 128 or min(tile) < 64:
        return False
    for rows, cols in (tile, tile[::-1]):
        ctas = -(-m // rows) * -(-n // cols) * splitk
        waves = ctas / sms
        if sms <= ctas <= 8 * sms and waves / -(-ctas // sms) >= 0.85:
            return True
    return False


def _cap(lib, algo, attr, ctype=ctypes.c_uint32):
    """A scalar capability, or None when cuBLASLt does not say."""
    v, written = ctype(0), ctypes.c_size_t(0)
    status = lib.cublasLtMatmulAlgoCapGetAttribute(algo, attr, ctypes.byref(v), ctypes.sizeof(v),
                                                   ctypes.byref(written))
    return int(v.value) if status == 0 else None


def _cap_list(lib, algo, attr):
    """A capability that is an array of uint32 (tile ids, stage ids); [0] (undefined) when empty."""
    need = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(algo, attr, None, 0, ctypes.byref(need)) != 0 or not need.value:
        return [0]
    buf = (ctypes.c_uint32 * (need.value // 4))()
    written = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(algo, attr, buf, need.value, ctypes.byref(written)) != 0:
        return [0]
    return list(buf) or [0]


def _operands(shapes: dict, seed: int, fp32_output: bool = False):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    ops = {}
    for i, (name, shape) in enumerate(shapes.items()):
        scale = 0.02 if name == "weight" else 1.0
        dtype = torch.float32 if fp32_output and i == 0 else torch.bfloat16
        ops[name] = (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)
    return ops


def candidates(plan, epilogue: int, budget_s: float = 180.0, algo_ids=None, splits=(), reductions=(2,), mnk=None):
    """Every AlgoConfig cuBLASLt accepts (AlgoCheck) for the plan's problem, with its workspace bytes; and
    how many configurations were checked. With splits (and the problem's m, n, k): the split-K ones instead,
    for the tiles that each split makes fill whole waves (split_fills_waves)."""
    import torch

    from llmpy.kernels import cublaslt
    lib = cublaslt._lib()
    state = cublaslt._device_state(torch.device("cuda"))
    ids = (ctypes.c_int32 * 1024)()
    count = ctypes.c_int32(0)
    cublaslt._check(lib.cublasLtMatmulAlgoGetIds(state.handle, cublaslt._COMPUTE_32F, cublaslt._CUDA_R_32F,
                                                 *plan.types, 1024, ids, ctypes.byref(count)), "AlgoGetIds")
    found, checked, t0 = [], 0, time.time()
    shapes = tile_shapes() if splits else {}
    if splits and not shapes:
        print("  no cublasLt.h: split-K candidates are not narrowed by their waves", flush=True)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count if splits else 0
    for algo_id in list(ids)[:count.value]:
        if time.time() - t0 > budget_s:
            print(f"  check budget spent at algo {algo_id}", flush=True)
            break
        if algo_ids and algo_id not in algo_ids:
            continue
        algo = ctypes.create_string_buffer(64)
        if lib.cublasLtMatmulAlgoInit(state.handle, cublaslt._COMPUTE_32F, cublaslt._CUDA_R_32F, *plan.types,
                                      algo_id, algo) != 0:
            continue
        mask = _cap(lib, algo, _CAP_EPILOGUE_MASK)
        if epilogue != cublaslt.EPILOGUE_DEFAULT and mask is not None and mask & epilogue != epilogue:
            continue
        tiles = _cap_list(lib, algo, _CAP_TILE_IDS)
        stages = _cap_list(lib, algo, _CAP_STAGES_IDS)
        swizzles = [0, 1] if _cap(lib, algo, _CAP_SWIZZLE) else [0]
        customs = range(min(_cap(lib, algo, _CAP_CUSTOM_MAX, ctypes.c_int32) or 0, MAX_CUSTOM) + 1)
        print(f"  algo {algo_id}: {len(tiles)} tiles, {len(stages)} stage counts, {len(swizzles)} swizzles, "
              f"{len(customs)} custom options", flush=True)
        if splits:
            if not _cap(lib, algo, _CAP_SPLITK, ctypes.c_int32):
                continue
            mask = _cap(lib, algo, _CAP_REDUCTION_MASK) or 0
            schemes = [r for r in reductions if mask & r]
            fills = {(t, sk) for t, sk in itertools.product(tiles, splits)  # each (tile, split) judged once
                     if not shapes or (t in shapes and split_fills_waves(*mnk, shapes[t], sk, sms))}
            variants = [(t, st, 0, cu, cl, sk, r) for t, st, cu, cl, sk, r in itertools.product(
                tiles, stages, [c for c in customs if c in SPLIT_CUSTOMS], SPLIT_CLUSTERS, splits, schemes)
                if (t, sk) in fills]
        else:
            variants = [(*v, 1, 0) for v in itertools.product(tiles, stages, swizzles, customs, CLUSTERS)]
        for tile, stage, swizzle, custom, cluster, splitk, reduction in variants:
            config = cublaslt.AlgoConfig(algo_id, tile, stage, swizzle, custom, cluster, splitk=splitk,
                                         reduction=reduction)
            checked += 1
            try:
                _, workspace = plan.configured(state, config)
            except cublaslt.CublasLtError:
                continue
            found.append((config, workspace))
    return found, checked


def screening_order(found: list, preferred_ids: list) -> list:
    """The candidates in the order the quick screen times them, so that a short budget still reaches every
    kind of kernel: the algorithm ids the heuristic lists first, then the others taking turns (one
    configuration of each in turn, each id's in cuBLASLt's order)."""
    by_id: dict = {}
    for item in found:
        by_id.setdefault(item[0].algo_id, []).append(item)
    ordered = []
    for group in ([i for i in by_id if i in preferred_ids], [i for i in by_id if i not in preferred_ids]):
        queues = [by_id[i] for i in group]
        for turn in range(max((len(q) for q in queues), default=0)):
            ordered += [q[turn] for q in queues if turn < len(q)]
    return ordered


QUICK_WINDOW_MS = 1.0  # the quick screen times each candidate over calls lasting about this long


def quick_calls(base_ms: float) -> int:
    """Calls a quick-screen timing takes for a product of about base_ms a call: at least 5, and enough to last
    QUICK_WINDOW_MS (a 0.04 ms product timed over 5 calls is noise), at most 100."""
    from bench.timing import calls_to_sustain
    return max(5, min(100, calls_to_sustain(None, QUICK_WINDOW_MS, estimate_ms=base_ms)))


def _quick_ms(run, calls=5):
    from bench.timing import mean_ms
    run()
    return mean_ms(run, calls)


def _torch_call(fn_name: str, ops: dict):
    """The call the model makes through torch for a product without a cuBLASLt-only epilogue, else None."""
    import torch
    if "pre_gelu" in ops or "residual" in ops:
        return None
    if fn_name == "linear_input_grad":
        return lambda: torch.mm(ops["dout"], ops["weight"], out=ops["dinp"])
    if fn_name == "linear_forward":
        return lambda: torch.addmm(ops["bias"], ops["inp"], ops["weight"].t(), out=ops["out"])
    if ops["dweight"].dtype != ops["dout"].dtype:  # weight_grad_bias_column's product
        return lambda: torch.mm(ops["dout"].t(), ops["inp"], out_dtype=ops["dweight"].dtype, out=ops["dweight"])
    return lambda: ops["dweight"].addmm_(ops["dout"].t(), ops["inp"])


def _epilogue(fn_name: str, ops: dict) -> int:
    from llmpy.kernels import cublaslt
    if "pre_gelu" in ops:
        return cublaslt.EPILOGUE_DGELU if fn_name == "linear_input_grad" else cublaslt.EPILOGUE_GELU_AUX_BIAS
    return cublaslt.EPILOGUE_BIAS if "bias" in ops else cublaslt.EPILOGUE_DEFAULT


def search(name: str, top: int, sustain_ms: float, budget_s: float, seed: int, rounds: int = 3,
           algo_ids=None, margin: float = 0.02, splits=(), reductions=(2,), shape_products=None,
           graph_calls: int = 0) -> dict:
    """One product's search (of shape_products, PRODUCTS by default). splits: search split-K configurations with
    these splits instead, where the product's inner dimension is deep enough (SPLIT_MIN_PART a part: the weight
    gradients, lm_head's input gradient); a shallower product is searched whole. graph_calls > 0: every timing
    replays that many calls captured in a CUDA graph (timing.graphed), as the step runs them, instead of calls
    made one by one from Python."""
    import dataclasses

    import torch

    from bench.kernels.bench_cublaslt import _ms_per_call
    from bench.timing import graphed, sustained_ms
    from llmpy.kernels import cublaslt
    from llmpy.kernels import matmul
    fn_name, shapes, tuned_key = (shape_products or PRODUCTS)[name]
    fn = getattr(cublaslt, fn_name)
    if name in FP32_OUTPUTS:  # overwritten, as weight_grad_bias_column runs it
        fn = functools.partial(fn, accumulate=False)
    ops = _operands(shapes, seed, fp32_output=name in FP32_OUTPUTS)
    out_name = next(iter(shapes))  # the product's output (pre_gelu is one too in the forward)
    fresh = {k: v.clone() for k, v in ops.items()}
    before = set(cublaslt._plans)
    fn(**ops)
    key = next(k for k in cublaslt._plans if k not in before)  # the plan this first call made
    plan = cublaslt._plans[key]
    splits = splits_for(key[3], splits)  # key: (device, m, n, k, ...) of cuBLAS's column-major call

    def caller(algo):
        return lambda: fn(**ops, algo_index=algo)

    per = max(graph_calls, 1)  # product calls a timed run makes

    def timed(call):
        return graphed(call, graph_calls) if graph_calls else call

    def runner(algo):
        return timed(caller(algo))

    def result_of(algo):
        for k, v in fresh.items():
            ops[k].copy_(v)
        ops[out_name].fill_(float("nan"))
        if fn_name == "linear_weight_grad":
            ops[out_name].zero_()  # it accumulates
        fn(**ops, algo_index=algo)
        return ops[out_name].float().clone()

    reference = result_of(0)
    heuristic = []
    for rank in range(8):
        try:
            caller(rank)()
        except cublaslt.CublasLtError:
            break
        algo = cublaslt._plans[key[:14] + (rank,) + key[15:]].algo
        try:
            heuristic.append(dataclasses.asdict(cublaslt.config_of(algo)))
        except cublaslt.CublasLtError as e:
            heuristic.append(str(e))
    print(f"[{name}] the heuristic's list: " + "; ".join(map(str, heuristic)), flush=True)
    t0 = time.time()
    found, checked = candidates(plan, _epilogue(fn_name, ops), algo_ids=algo_ids, splits=splits,
                                reductions=reductions, mnk=key[1:4])
    per_algo = collections.Counter(c.algo_id for c, _ in found)
    print(f"[{name}] {checked} configurations checked, {len(found)} accepted ({time.time() - t0:.1f} s): "
          f"{dict(per_algo)}", flush=True)
    found = screening_order(found, [h["algo_id"] for h in heuristic if isinstance(h, dict)])
    # quick screen: each candidate's time over the heuristic's first, timed again every 10 candidates (the
    # card warms over a search and its clock moves more than the candidates differ)
    base = runner(0)
    screened, base_ms = [], None
    runs = math.ceil(quick_calls(_quick_ms(base) / per) / per)  # runs of `per` calls: the screen's window
    t0 = time.time()
    for i, (config, workspace) in enumerate(found):
        if time.time() - t0 > budget_s:
            print(f"[{name}] budget spent after {len(screened)} timed", flush=True)
            break
        if i % 10 == 0:
            base_ms = _quick_ms(base, runs)
        try:
            screened.append((_quick_ms(runner(config), runs) / base_ms, config, workspace))
        except cublaslt.CublasLtError:
            continue
    screened.sort(key=lambda r: r[0])
    # the finalists: the heuristic's first, the screen's fastest, and what the model runs now (its table's
    # entry, else torch's call where there is one, else the heuristic's first)
    capability = tuple(torch.cuda.get_device_capability())
    current = matmul.TUNED_ALGOS.get((*tuned_key, capability))
    torch_call = _torch_call(fn_name, ops)
    finalists = [{"label": "heuristic 0", "algo": 0, "ratio": 1.0}]
    finalists += [{"label": dataclasses.asdict(c), "algo": c, "ratio": q} for q, c, _ in screened[:top]]
    if current not in (None, 0):
        finalists.append({"label": f"current: {current}", "algo": current, "ratio": None})
    elif torch_call is not None:
        finalists.append({"label": "current: torch", "algo": "torch", "ratio": None})
    else:
        finalists[0]["label"] = "current: heuristic 0"
    scale = reference.abs().max().item()
    rows = []
    for f in finalists:
        diff = float("nan") if f["algo"] == "torch" else \
            (result_of(f["algo"]) - reference).abs().max().item() / scale
        rows.append({"config": f["label"], "quick_ratio": f["ratio"], "diff": diff, "ms": [], "cap_ms": []})
    for _ in range(rounds):  # alternated: every finalist once a round, best-of-5 and at the cap
        for row, f in zip(rows, finalists):
            run = timed(torch_call) if f["algo"] == "torch" else runner(f["algo"])
            row["ms"].append(_ms_per_call(run) / per)
            row["cap_ms"].append(sustained_ms(run, sustain_ms) / per)
    for r in rows:
        r["ms_median"], r["cap_ms_median"] = statistics.median(r["ms"]), statistics.median(r["cap_ms"])
        ratio = f"x{r['quick_ratio']:.3f}" if r["quick_ratio"] else "-"
        print(f"[{name}] quick {ratio}, best {r['ms_median']:.4f}, at cap {r['cap_ms_median']:.4f}"
              f" ms ({' '.join(f'{v:.4f}' for v in r['cap_ms'])}), diff {r['diff']:.1e}: {r['config']}", flush=True)
    suggested = suggestion(rows, tuned_key, margin)
    print(f"[{name}] suggested: {suggested}", flush=True)
    return {"product": name, "suggested": suggested, "checked": checked, "accepted": len(found),
            "timed": len(screened), "per_algo": dict(per_algo), "graph_calls": graph_calls,
            "heuristic": heuristic, "rows": rows, "quick": [(q, dataclasses.asdict(c)) for q, c, _ in screened[:100]]}


def suggestion(rows: list, tuned_key: tuple, margin: float) -> dict | None:
    """The TUNED_ALGOS entry a search suggests from its finalists' rows (search's "rows"): the fastest at the
    cap among the configurations and the heuristic's first choice (as rank 0, unless the model runs that now),
    if it beats the model's current call by margin in every round and computes the same product; else None."""
    now = next(r for r in rows if str(r["config"]).startswith("current"))
    others = [r for r in rows if isinstance(r["config"], dict) or r["config"] == "heuristic 0"]
    best = min(others, key=lambda r: r["cap_ms_median"], default=None)
    if best is None or max(best["cap_ms"]) >= min(now["cap_ms"]) * (1 - margin) or not best["diff"] < 1e-2:
        return None
    entry = {"rank": 0} if best["config"] == "heuristic 0" else {"config": best["config"]}
    return {"key": list(tuned_key), **entry, "cap_ms": best["cap_ms_median"], "current_cap_ms": now["cap_ms_median"]}


def suggested_table(results: list, tuned_algos: dict, capability: tuple) -> list:
    """The entries of a bench_step --tuned-from file (which replaces the whole table): tuned_algos' (a
    kernels.matmul.TUNED_ALGOS) entries for this GPU capability, with the searches' suggestions in."""
    import dataclasses
    table = {}
    for key, value in tuned_algos.items():
        if key[-1] == capability:
            entry = {"rank": value} if isinstance(value, int) else {"config": dataclasses.asdict(value)}
            table[key[:-1]] = {"key": list(key[:-1]), **entry}
    for r in results:
        if r["suggested"]:
            table[tuple(r["suggested"]["key"])] = r["suggested"]
    return list(table.values())


def main(argv=None) -> int:
    from bench.bench_step import _at_least_one
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--products", nargs="+", default=["dgelu"], choices=sorted(PRODUCTS))
    ap.add_argument("--B", type=_at_least_one, default=64, help="the step's batch size whose products are searched")
    ap.add_argument("--T", type=_at_least_one, default=1024, help="the step's sequence length")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--sustain-ms", type=float, default=200.0)
    ap.add_argument("--budget-s", type=float, default=60.0, help="seconds of quick timing a product at most")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds timing the finalists")
    ap.add_argument("--algo-ids", type=int, nargs="*", default=None, help="only these algorithm ids")
    ap.add_argument("--margin", type=float, default=0.02,
                    help="a configuration is suggested when it beats the current choice by this in every round")
    ap.add_argument("--json", default=None, help="results and the suggested table (bench_step --tuned-from)")
    ap.add_argument("--split-k", type=int, nargs="*", default=[],
                    help="search split-K configurations with these splits (each > 1) instead, for the products "
                         "deep enough to split (the weight gradients, lm_head's input gradient; the others whole)")
    ap.add_argument("--reductions", type=int, nargs="+", default=[2], choices=[1, 2, 4],
                    help="split-K reduction schemes: 1 in place (the output's type), 2 fp32 in the workspace, "
                         "4 the output's type in the workspace")
    ap.add_argument("--graph-calls", type=int, default=0,
                    help="> 0: time every candidate as that many calls captured in a CUDA graph and replayed, as "
                         "the step runs them (products of ~0.05 ms called from Python are bound by the host)")
    ap.add_argument("--workspace-mib", type=_at_least_one, default=None,
                    help="cuBLASLt's workspace in MiB (default 32, the model's): a split-K configuration keeps its "
                         "fp32 partial sums there, and one that needs more is refused")
    args = ap.parse_args(argv)
    if any(s < 2 for s in args.split_k):
        ap.error("--split-k: splits are 2 or more")
    if args.graph_calls < 0:
        ap.error("--graph-calls: 0 (calls from Python) or more")
    if args.workspace_mib is not None:
        from llmpy.kernels import cublaslt
        cublaslt.set_workspace_bytes(args.workspace_mib << 20)
    results, shape_products = [], products(args.B, args.T)
    for product in args.products:
        results.append(search(product, args.top, args.sustain_ms, args.budget_s, args.seed, args.rounds,
                              args.algo_ids, args.margin, tuple(args.split_k), tuple(args.reductions),
                              shape_products, args.graph_calls))
        if args.json:  # after every product: a timeout keeps what is done
            import torch

            from llmpy.kernels.matmul import TUNED_ALGOS
            capability = tuple(torch.cuda.get_device_capability())
            table = {"capability": list(capability), "tuned": suggested_table(results, TUNED_ALGOS, capability),
                     "search": results}
            with open(args.json, "w") as f:
                json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
