"""bench/kernels/bench_cublaslt.py without a GPU: the suggested TUNED_ALGOS table is built from the
slowest of the passes, keyed as kernels.matmul looks products up, and only where a rank wins by the margin."""
from bench.kernels import bench_cublaslt
from llmpy.kernels import matmul


def _row(name, calls, torch_ms, lt, **fused):
    return dict(name=name, calls=calls, torch=torch_ms, lt=dict(enumerate(lt)), **fused)


def _result(scale=1.0):
    s = scale
    return dict(rows=[
        _row("lm_head fwd", 8, 1.0 * s, [1.1 * s, 0.9 * s, None, 0.85 * s]),
        _row("attproj dinp", 12, 0.15 * s, [0.151 * s, 0.149 * s]),  # 0.7 % faster: under the margin
        _row("qkv dweight", 12, 0.47 * s, [0.40 * s, 0.36 * s]),
        _row("fc fwd", 12, 0.5 * s, [0.3 * s], gelu_aux_bias={0: 0.6 * s, 1: 0.55 * s}),
        _row("fcproj dinp", 12, 0.5 * s, [0.3 * s], dgelu={0: 0.57 * s, 1: 0.58 * s}),
    ])


def test_slowest_takes_the_worse_pass():
    fast, slow = _result(1.0), _result(2.0)
    slow["rows"][0]["lt"][3] = 0.1  # the rank that wins in one pass only
    worst = bench_cublaslt._slowest([fast, slow])
    lm = worst["rows"][0]
    assert lm["torch"] == 2.0 and lm["lt"][1] == 1.8 and lm["lt"][3] == 0.85 and lm["lt"][2] is None
    assert worst["rows"][3]["gelu_aux_bias"] == {0: 1.2, 1: 1.1}
    assert [r["name"] for r in worst["rows"]] == [r["name"] for r in fast["rows"]]


def test_tuned_table_keys_and_margin():
    table = {tuple(t["key"]): t["rank"] for t in bench_cublaslt.tuned_table(_result(), margin=0.03)}
    # the keys of the products matmul.TUNED_ALGOS already holds (found by hand in run L) come out the same
    held = {key[:4] for key in matmul.TUNED_ALGOS}
    assert ("fwd", 8192, 768, 50304) in held and table[("fwd", 8192, 768, 50304)] == 3
    assert ("dweight", 65536, 2304, 768) in held and table[("dweight", 65536, 2304, 768)] == 1
    assert ("gelu_aux_bias", 65536, 768, 3072) in held and table[("gelu_aux_bias", 65536, 768, 3072)] == 1
    # under the margin, or rank 0 already the fastest of a fused epilogue: no entry
    assert ("dinp", 65536, 768, 768) not in table and ("dinp_dgelu", 65536, 768, 3072) not in table
    assert len(table) == 3
