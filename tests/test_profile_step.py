"""CPU tests of bench/profile_step.py's classification, aggregation and formatting (no GPU, no profiler)."""
import json

import pytest

from bench import profile_step as ps
from cli_helpers import config_error

NVJET = "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT"
CUTLASS = ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"
           "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)")


@pytest.mark.parametrize("name,group", [
    (NVJET, "matrix"),
    (CUTLASS, "matrix"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matrix"),
    ("_matmul_kernel", "matrix"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "matrix"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),  # says cutlass, but is attention
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
    ("_flash_fwd_kernel", "attention"),
    ("_softmax_backward_kernel", "attention"),
    ("_permute_kernel", "attention"),
    ("_fc_twopass_kernel", "memory-bound"),
    ("_layernorm_backward_reduce_kernel", "memory-bound"),
    ("_gelu_backward_inplace_kernel", "memory-bound"),
    ("_encoder_forward_kernel", "memory-bound"),
    ("_wte_backward_chunks_kernel", "memory-bound"),
    ("_fused_residual_forward_kernel", "memory-bound"),
    ("_bias_partial_kernel", "memory-bound"),
    ("Memcpy HtoD (Pinned -> Device)", "memory-bound"),
    ("Memset (Device)", "memory-bound"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "memory-bound"),
    ("adamw_kernel", "optimizer"),
    ("global_norm_squared_kernel", "optimizer"),
    ("clip_scale_kernel", "optimizer"),
    ("some_new_mystery_kernel", "other"),
    ("_matmul_tma_kernel", "matrix"),  # the Triton GEMM's persistent TMA grid (matmul.py, TMA=True on sm_90)
    ("_forward_pieces3_kernel", "memory-bound"),  # the LayerNorm forward taking a row as 3 tiles (layernorm.py)
])
def test_classify(name, group):
    assert ps.classify(name) == group


def fake_events():
    # two profiled steps; names repeat (summed), durations in us
    return [
        (NVJET, 30_000.0, 48), (NVJET, 30_000.0, 48),
        (CUTLASS, 40_000.0, 4),
        ("_flash_fwd_kernel", 8_000.0, 24),
        ("_flash_bwd_kernel", 16_000.0, 24),
        ("_fc_twopass_kernel", 6_000.0, 2),
        ("_layernorm_forward_kernel", 2_000.0, 50),
        ("adamw_kernel", 2_000.0, 2),
        ("some_new_mystery_kernel", 1_000.0, 2),
    ]


def test_aggregate_groups_and_shares():
    agg = ps.aggregate(fake_events(), steps=2, wall_ms_per_step=80.0)
    assert agg["kernel_ms"] == pytest.approx(67.5)
    assert agg["gaps_ms"] == pytest.approx(12.5)
    assert agg["step_ms"] == pytest.approx(80.0)
    g = agg["groups"]
    assert g["matrix"]["ms"] == pytest.approx(50.0)
    assert g["matrix"]["kernels"] == 2
    assert g["attention"]["ms"] == pytest.approx(12.0)
    assert g["memory-bound"]["ms"] == pytest.approx(4.0)
    assert g["optimizer"]["ms"] == pytest.approx(1.0)
    assert g["other"]["ms"] == pytest.approx(0.5)
    assert sum(v["share"] for v in g.values()) == pytest.approx(1.0)
    assert sum(r["share"] for r in agg["rows"]) + g["gaps"]["share"] == pytest.approx(1.0)
    # per kernel: the repeated nvjet name is one row, per step
    top = agg["rows"][0]
    assert top["name"] == NVJET and top["ms"] == pytest.approx(30.0) and top["calls"] == pytest.approx(48)
    assert [r["ms"] for r in agg["rows"]] == sorted((r["ms"] for r in agg["rows"]), reverse=True)
    assert agg["other"] == ["some_new_mystery_kernel"]
    assert g["matrix"]["floor_ms"] == (76.4, 76.4)
    json.dumps(agg)  # --json must be able to write it


def test_aggregate_overlap_and_no_wall():
    # overlapping streams: kernel sum above the wall time -> no negative gaps, shares still 100 %
    agg = ps.aggregate(fake_events(), steps=2, wall_ms_per_step=50.0)
    assert agg["gaps_ms"] == 0.0 and agg["step_ms"] == pytest.approx(67.5)
    assert sum(v["share"] for v in agg["groups"].values()) == pytest.approx(1.0)
    agg = ps.aggregate(fake_events(), steps=2)
    assert agg["gaps_ms"] == 0.0
    with pytest.raises(ValueError):
        ps.aggregate([], steps=0)
    empty = ps.aggregate([], steps=1)
    assert empty["step_ms"] == 0.0 and all(v["share"] == 0.0 for v in empty["groups"].values())
    ps.format_groups(empty), ps.format_kernels(empty), ps.format_markdown(empty)


def test_text_tables():
    agg = ps.aggregate(fake_events(), steps=2, wall_ms_per_step=80.0)
    kt = ps.format_kernels(agg, top=3)
    assert "nvjet_tst" in kt and "cutlass::Kernel2" in kt
    assert "(5 more kernels)" in kt
    assert "gaps" in kt and "12.500" in kt
    assert all(len(line) < 120 for line in kt.splitlines())  # long C++ names are cut
    gt = ps.format_groups(agg)
    for g in ("matrix", "attention", "memory-bound", "optimizer", "other", "gaps"):
        assert g in gt
    assert "76.4" in gt and "16.2" in gt and "5-8" in gt
    assert "some_new_mystery_kernel" in gt.split("unclassified")[1]


def test_markdown():
    agg = ps.aggregate(fake_events(), steps=2, wall_ms_per_step=80.0)
    meta = {"date": "2026-12-02", "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
            "commit": "abcdef0123", "dirty": False, "command": "python -m bench.profile_step",
            "graph_median_ms": 70.0}
    md = ps.format_markdown(agg, meta, top=None)
    lines = md.splitlines()
    assert "commit abcdef0" in md and "median 70.0 ms" in md
    tables = [l for l in lines if l.startswith("|")]
    # each table's rows have as many cells as its header
    assert all(l.count("|") == 7 for l in tables[:8])
    assert "| matrix | 50.00 | 62.5% | 2 | 76.4 | -26.4 |" in md
    assert "| memory-bound | 4.00 | 5.0% | 2 | 5-8 | -4.0 |" in md
    assert "| gaps | 12.50 | 15.6% |" in md
    assert "| **step** | **80.00** | 100.0% |" in md
    assert "`some_new_mystery_kernel`" in md.split("Unclassified")[1]
    # a '|' inside a kernel name must not break the table
    agg2 = ps.aggregate([("weird|name", 1000.0, 1)], steps=1)
    assert "weird\\|name" in ps.format_markdown(agg2)


def test_classes_table_is_extensible(monkeypatch):
    monkeypatch.setattr(ps, "_COMPILED", [("optimizer", __import__("re").compile("mystery"))] + ps._COMPILED)
    assert ps.classify("some_new_mystery_kernel") == "optimizer"


def test_parse_args_defaults():
    a = ps.parse_args([])
    assert (a.B, a.T, a.recompute, a.attention, a.classifier_chunks, a.gelu_fusion) == (64, 1024, 0, "auto", None, None)
    opts = ps._model_options(a, cuda_graph=False)
    assert opts["cuda_graph"] is False and "classifier_chunks" not in opts and "gelu_fusion" not in opts
    a = ps.parse_args(["--gelu-fusion", "2", "--classifier-chunks", "4", "--attention", "cudnn"])
    opts = ps._model_options(a, cuda_graph=True)
    assert opts["gelu_fusion"] == 2 and opts["classifier_chunks"] == 4 and opts["attention"] == "cudnn"


def test_model_switches_on_off():
    # not given: the model's own default; on/off: that value; the residual option only when asked
    opts = ps._model_options(ps.parse_args([]), cuda_graph=True)
    assert "proj_bias_in_layernorm" not in opts and "residual_in_product" not in opts
    opts = ps._model_options(ps.parse_args(["--proj-bias-in-ln", "off", "--residual-in-product"]), cuda_graph=True)
    assert opts["proj_bias_in_layernorm"] is False and opts["residual_in_product"] is True
    opts = ps._model_options(ps.parse_args(["--proj-bias-in-ln", "on"]), cuda_graph=True)
    assert opts["proj_bias_in_layernorm"] is True


def test_overlap_switch():
    assert "overlap_weight_grads" not in ps._model_options(ps.parse_args([]), cuda_graph=True)
    for mode in ("off", "on", "priority"):
        opts = ps._model_options(ps.parse_args(["--overlap-weight-grads", mode]), cuda_graph=True)
        assert opts["overlap_weight_grads"] == mode
    with pytest.raises(SystemExit):
        ps.parse_args(["--overlap-weight-grads", "sideways"])


def test_timeline_graphs_idle_and_between():
    # two replays 1000 us apart. Each graph: a (0-100), b (50-120) overlapping a, a 3 us hole, c (123-200),
    # a 1 us hole, d (201-300); then the host's copies: a 40 us hole, copy (340-345), and the next graph
    ev = []
    for base in (0.0, 1000.0):
        ev += [("a", base, base + 100), ("b", base + 50, base + 120), ("c", base + 123, base + 200),
               ("d", base + 201, base + 300), ("copy", base + 340, base + 345)]
    tl = ps.timeline(ev, steps=2, wall_ms_each=[1.0, 1.2])
    assert tl["kernel_ms"] == pytest.approx((100 + 70 + 77 + 99 + 5) / 1e3)
    assert tl["busy_ms"] == pytest.approx((120 + 77 + 99) / 1e3)  # the graphs only; copies are the host's
    assert tl["graph_ms"] == pytest.approx(300 / 1e3)
    assert tl["graph_idle_ms"] == pytest.approx(4 / 1e3)
    assert tl["graph_holes"] == pytest.approx(2)
    assert tl["between_ms_each"] == [pytest.approx(0.7)] and tl["between_ms"] == pytest.approx(0.7)
    top = tl["top_holes"]
    assert top[0] == {"us": 3.0, "after": "b", "before": "c"} and top[2]["us"] == 1.0
    assert tl["wall_ms"] == pytest.approx(1.1)
    text = ps.format_timeline(tl)
    assert "idle inside it" in text and "after b" in text and "0.70" in text
    one = ps.timeline(ev[:5], steps=1)
    assert one["between_ms"] is None and one["graph_ms"] == pytest.approx(0.3)
    with pytest.raises(ValueError):
        ps.timeline(ev, steps=0)


def test_kernel_switches_are_bench_step_s(monkeypatch):
    # profile_step takes bench_step's kernel-module flags and sets the same constants before the model is built
    from bench.bench_step import set_kernel_switches
    from llmpy.kernels import layernorm, matmul
    for name in ("QKV_QUERY_SUMS_FROM_ATTENTION", "QKV_BIAS_FROM_IDENTITIES", "BIAS_GRAD_IN_PRODUCT"):
        monkeypatch.setattr(matmul, name, getattr(matmul, name))
    monkeypatch.setattr(layernorm, "LN_BACKWARD_PROJ_CHUNKS", layernorm.LN_BACKWARD_PROJ_CHUNKS)
    before = (matmul.QKV_QUERY_SUMS_FROM_ATTENTION, matmul.QKV_BIAS_FROM_IDENTITIES, layernorm.LN_BACKWARD_PROJ_CHUNKS)
    set_kernel_switches(ps.parse_args([]))
    assert (matmul.QKV_QUERY_SUMS_FROM_ATTENTION, matmul.QKV_BIAS_FROM_IDENTITIES,
            layernorm.LN_BACKWARD_PROJ_CHUNKS) == before  # no flag, no change
    set_kernel_switches(ps.parse_args(["--q-sums-from-attention", "off", "--ln-proj-chunks", "7"]))
    assert matmul.QKV_QUERY_SUMS_FROM_ATTENTION is False and layernorm.LN_BACKWARD_PROJ_CHUNKS == 7
    set_kernel_switches(ps.parse_args(["--q-sums-from-attention", "on"]))
    assert matmul.QKV_QUERY_SUMS_FROM_ATTENTION is True
    with pytest.raises(SystemExit):
        ps.parse_args(["--ln-proj-chunks", "0"])


def test_every_kernel_of_llmpy_falls_in_a_group():
    """Each kernel the model launches (a jitted function named *_kernel in src/llmpy/kernels) is in one of the
    groups: a kernel in 'other' is left out of the figure its group is compared against."""
    import re
    from pathlib import Path
    src = Path(ps.REPO) / "src" / "llmpy" / "kernels"
    names = set()
    for path in src.glob("*.py"):
        names |= set(re.findall(r"@(?:triton|gluon)\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", path.read_text()))
    assert len(names) > 30 and "_matmul_kernel" in names and "adamw_kernel" in names
    assert {n: ps.classify(n) for n in sorted(names) if ps.classify(n) == "other"} == {}


@pytest.mark.parametrize("argv,message", [
    (["--warmup", "-1"], "--warmup must be at least 0"),  # a profiled step would be AdamW's step 0
    (["--graph-steps", "0"], "--graph-steps must be at least 1"),  # the graph's median would be its warm-up's
    (["--graph-profile-steps", "-2"], "--graph-profile-steps must be at least 0"),
    (["--top", "-3"], "--top must be at least 0"),
    (["--model", "d13"], f"--model d13: {config_error('d13')}"),
    (["--T", "2048"], "--T 2048 is longer than the model's context 1024"),
])
def test_parse_args_refuses_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        ps.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(message)


def test_output_folders_are_made_before_the_run(tmp_path):
    """--json, --md, --trace and --graph-trace in folders that do not exist yet: made when the arguments are read,
    not found missing after minutes of profiling."""
    paths = {flag: tmp_path / flag.strip("-") / "sub" / "out.json" for flag in ("--json", "--md", "--trace",
                                                                               "--graph-trace")}
    ps.parse_args([x for flag, path in paths.items() for x in (flag, str(path))])
    assert all(path.parent.is_dir() for path in paths.values())
