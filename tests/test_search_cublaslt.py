"""bench/kernels/search_cublaslt.py without a GPU: the order its quick screen times candidates in, the
table it suggests (what the model holds now, with the suggestions in), and that bench_step --tuned-from
reads that table back into kernels.matmul.TUNED_ALGOS entries, AlgoConfigs included."""
import json

import pytest

from bench import bench_step
from bench.kernels import search_cublaslt as search
from llmpy.kernels import matmul
from llmpy.kernels.cublaslt import AlgoConfig
from llmpy.model import FC_BIAS_COLUMNS


def _found(algo_id, n):
    return [(AlgoConfig(algo_id, tile=t, stages=35), 0) for t in range(n)]


def test_screen_reaches_every_algorithm_early():
    found = _found(21, 5) + _found(39, 2) + _found(66, 4)
    order = [c.algo_id for c, _ in search.screening_order(found, preferred_ids=[66])]
    assert sorted(order) == sorted(c.algo_id for c, _ in found), "every candidate exactly once"
    assert order[:4] == [66] * 4, "the heuristic's algorithms first"
    assert order[4:7] == [21, 39, 21] and order[-1] == 21, "then the others taking turns"
    tiles_21 = [c.tile for c, _ in search.screening_order(found, []) if c.algo_id == 21]
    assert tiles_21 == list(range(5)), "each algorithm's own order kept"


def test_every_product_keyed_as_the_model_looks_it_up():
    kinds = {"fwd", "fwd_bias", "fwd_bias_residual", "gelu_aux_bias", "dinp", "dinp_dgelu", "dweight", "dweight_wide"}
    assert search.CW == search.C + FC_BIAS_COLUMNS, "fc's weight gradient with the model's bias columns"
    for name, (fn_name, shapes, key) in search.PRODUCTS.items():
        assert key[0] in kinds, name
        out = next(iter(shapes))
        rows = shapes["dout"][0] if fn_name == "linear_weight_grad" else shapes[out][0]
        assert key[1] == rows, name
    held = {key[:4] for key in matmul.TUNED_ALGOS}
    assert {search.PRODUCTS[p][2] for p in ("qkv_fwd", "qkv_dinp", "lm_head_fwd")} <= held
    at_32 = search.products(32, 1024)
    assert {at_32[p][2] for p in ("qkv_fwd", "attproj_fwd", "fc_gelu", "attproj_dinp")} <= held


def test_products_at_other_batch_sizes():
    # B=16: the layers' products over 16384 rows; lm_head's over one classifier chunk, 8192 rows as at B=64
    for B, rows, chunk in ((64, 65536, 8192), (32, 32768, 8192), (16, 16384, 8192), (4, 4096, 4096)):
        table = search.products(B, 1024)
        assert set(table) == set(search.PRODUCTS)
        for name, (fn_name, shapes, key) in table.items():
            want = chunk if name.startswith("lm_head") else rows
            assert key[1] == want, (B, name)
            rows_of = shapes["dout"] if fn_name == "linear_weight_grad" else next(iter(shapes.values()))
            assert rows_of[0] == want, (B, name)
    assert search.products(64, 1024) == search.PRODUCTS


def test_suggested_table_round_trip(tmp_path):
    capability = (9, 0)
    tuned = {("fwd", 8192, 768, 50304, capability): 5,
             ("fwd_bias", 65536, 768, 2304, capability): AlgoConfig(66, 29, 35, custom=1, cluster=3),
             ("dinp", 65536, 768, 768, (8, 0)): 2}  # another GPU's: not in this table
    new = AlgoConfig(66, 32, 35, custom=7, cluster=2)
    results = [{"suggested": {"key": ["dinp", 8192, 50304, 768], "config": new.__dict__, "cap_ms": 0.92}},
               {"suggested": None},
               {"suggested": {"key": ["fwd", 8192, 768, 50304], "config": new.__dict__}}]  # replaces rank 5
    table = {"capability": list(capability), "tuned": search.suggested_table(results, tuned, capability)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    entries = bench_step.tuned_entries(json.loads(path.read_text()))
    assert entries == {("fwd", 8192, 768, 50304, capability): new,
                       ("fwd_bias", 65536, 768, 2304, capability): AlgoConfig(66, 29, 35, custom=1, cluster=3),
                       ("dinp", 8192, 50304, 768, capability): new}


def test_tile_shapes_read_from_the_header(tmp_path):
    header = tmp_path / "cublasLt.h"
    header.write_text("typedef enum {\n  CUBLASLT_MATMUL_TILE_UNDEFINED = 0,\n  CUBLASLT_MATMUL_TILE_8x8 = 1,\n"
                      "  CUBLASLT_MATMUL_TILE_128x160 = 29,\n  CUBLASLT_MATMUL_TILE_END\n} cublasLtMatmulTile_t;\n")
    assert search.tile_shapes(str(header)) == {1: (8, 8), 29: (128, 160)}
    assert search.tile_shapes(str(tmp_path / "missing.h")) == {}


def test_split_fills_waves():
    # qkv's weight gradient: m = 768, n = 2304, k = 65536 on 132 SMs; 128 x 128 tiles: 6 x 18 = 108 of them
    fills = search.split_fills_waves
    assert not fills(768, 2304, 65536, (128, 128), 1, 132), "108 CTAs: less than one wave"
    assert not fills(768, 2304, 65536, (128, 128), 5, 132), "540 CTAs: 4.09 waves of 5, 82 %"
    assert fills(768, 2304, 65536, (128, 128), 6, 132), "648 CTAs: 4.91 waves of 5, 98 %"
    assert fills(768, 2304, 65536, (128, 256), 7, 132), "54 tiles x 7: 2.86 waves of 3"
    assert not fills(768, 2304, 65536, (128, 256), 5, 132), "54 tiles x 5: 2.05 waves of 3"
    assert not fills(768, 2304, 65536, (128, 128), 2, 132), "216 CTAs: 1.64 waves of 2"
    assert not fills(768, 2304, 65536, (128, 128), 64, 132), "parts of 1024: too shallow"
    assert not fills(768, 2304, 65536, (64, 128), 6, 132), "tiles under 128 x 128"
    assert not fills(768, 50304, 65536, (128, 128), 2, 132), "2358 tiles: eight waves without a split"
    assert fills(2304, 768, 65536, (256, 128), 6, 132) == fills(2304, 768, 65536, (128, 256), 6, 132)


def test_main_searches_every_product_at_the_asked_shape(tmp_path, monkeypatch):
    import torch
    calls = []

    def fake_search(name, *args):
        shape_products, graph_calls = args[-2:]
        calls.append((name, shape_products[name][2], graph_calls))
        return {"product": name, "suggested": {"key": list(shape_products[name][2]), "rank": 1}}

    monkeypatch.setattr(search, "search", fake_search)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    out = tmp_path / "s.json"
    assert search.main(["--products", "qkv_fwd", "fc_dinp", "lm_head_fwd", "--B", "16", "--graph-calls", "20",
                        "--json", str(out)]) == 0
    assert calls == [("qkv_fwd", ("fwd_bias", 16384, 768, 2304), 20), ("fc_dinp", ("dinp", 16384, 3072, 768), 20),
                     ("lm_head_fwd", ("fwd", 8192, 768, 50304), 20)]
    keys = [tuple(e["key"]) for e in json.loads(out.read_text())["tuned"]]
    assert ("dinp", 16384, 3072, 768) in keys and ("fwd_bias", 65536, 768, 2304) in keys


def test_only_deep_products_are_split():
    splits = (2, 3, 4)
    assert search.splits_for(65536, splits) == splits, "a weight gradient at B=64"
    assert search.splits_for(16384, splits) == splits, "a weight gradient at B=16"
    assert search.splits_for(50304, splits) == splits, "lm_head's input gradient"
    assert search.splits_for(3072, splits) == (), "fc's input gradient: parts of 1536"
    assert search.splits_for(768, splits) == (), "a forward product"
    assert search.splits_for(65536, ()) == ()


def test_quick_screen_times_a_millisecond_of_calls():
    assert search.quick_calls(0.35) == 5, "B=64's products: five calls, as before"
    assert search.quick_calls(0.04) == 25, "B=16's projections: 25 calls, 1 ms"
    assert search.quick_calls(0.0) == 100 and search.quick_calls(5.0) == 5


def _row(config, cap_ms, diff=0.0):
    import statistics
    return {"config": config, "cap_ms": cap_ms, "cap_ms_median": statistics.median(cap_ms), "diff": diff}


def test_suggestion_takes_the_fastest_finalist_by_the_margin_in_every_round():
    key = ("dweight", 16384, 768, 768)
    config = AlgoConfig(66, 20, 35, custom=1, cluster=2, splitk=7, reduction=2).__dict__
    torch_now = _row("current: torch", [0.0413, 0.0408])
    # call 1 of run AP: the heuristic's first (0.0392) beat every configuration and torch's call
    rows = [_row("heuristic 0", [0.0389, 0.0395]), _row(config, [0.0394, 0.0398], diff=3e-3), torch_now]
    assert search.suggestion(rows, key, 0.02) == {"key": list(key), "rank": 0, "cap_ms": 0.0392,
                                                  "current_cap_ms": 0.04105}
    rows[0] = _row("heuristic 0", [0.0399, 0.0401])
    got = search.suggestion(rows, key, 0.02)
    assert got["config"] == config and "rank" not in got
    assert search.suggestion(rows, key, 0.05) is None, "not 5 % faster in every round"
    rows[1] = _row(config, [0.0394, 0.0398], diff=0.5)
    assert search.suggestion(rows, key, 0.02) is None, "a different result is never suggested"
    # where the model runs the heuristic's first now, only a configuration can be suggested
    rows = [_row("current: heuristic 0", [0.0399, 0.0401]), _row(config, [0.0420, 0.0430])]
    assert search.suggestion(rows, key, 0.02) is None


def test_graph_calls_are_checked(capsys):
    with pytest.raises(SystemExit):
        search.main(["--products", "qkv_fwd", "--graph-calls", "-1"])
    assert "--graph-calls" in capsys.readouterr().err


@pytest.mark.gpu
def test_graphed_replays_the_calls_it_captured():
    import torch

    from bench.timing import graphed
    from llmpy.kernels import cublaslt
    torch.manual_seed(0)
    x = torch.randn(257, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(40, 96, device="cuda", dtype=torch.bfloat16)
    out = torch.full((257, 40), float("nan"), device="cuda", dtype=torch.bfloat16)
    counter = torch.zeros(1, device="cuda")

    def call():
        cublaslt.linear_forward(out=out, inp=x, weight=w)
        counter.add_(1)

    replay = graphed(call, 3)
    assert counter.item() == 1, "one call outside the capture, none while capturing"
    out.fill_(float("nan"))
    replay()
    replay()
    torch.cuda.synchronize()
    assert counter.item() == 7, "each replay makes the 3 captured calls"
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)
