"""llmpy's Gluon kernels compile for sm_90a with the installed triton, on a machine without a GPU.

Gluon has no CPU interpreter: the kernels' code runs on the CPU in tests/gluon_emulator.py, which replaces
Gluon's operations and so cannot see an API change, and compiled on the GPU against the triton of the device
(test_fused_classifier.py, test_flash_backward_wgmma.py). Gluon's API still moves between triton releases (3.8
renamed `gl.thread_barrier` to `gl.barrier`, which broke the TMA classifier on a GPU with 3.8 while every CPU test
passed; 3.9 removed the TMA copies' old names, which this test caught; kernels/gluon_compat.py serves both). Here
each launcher runs on CPU tensors with its kernel's launch replaced by an ahead-of-time compile for an H100/H200
(triton.compile with an sm_90 target and the launch's alignment specialization: the frontend, the Gluon and LLVM
passes and ptxas), so an API change fails in CI, whose triton is the newest.

The compiles run in a child process without TRITON_INTERPRET: under the interpreter, the reductions Gluon
borrows from triton.language (gl.max, gl.sum) are interpreter objects that the compiler refuses.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from gluon_guard import require_gluon
from llmpy.kernels import flash_attention as fa
from llmpy.kernels import flash_backward_wgmma as fw
from llmpy.kernels import fused_classifier_tma as fct

require_gluon(fct.GLUON and fw.GLUON, module_level=True)

SM90_SHARED_BYTES = 232448  # the most shared memory a CTA may have on sm_90


class CompileForSm90:
    """Stands in for `kernel[grid]`: the launch compiles the kernel for sm_90a instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = []

    def __getitem__(self, grid):
        return self._compile

    def _compile(self, *args, **kwargs):
        from triton import compile as triton_compile
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
        from triton.runtime.jit import mangle_type
        fn = self.kernel
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_ctas", "maxnreg") if k in kwargs}
        values = dict(zip(fn.arg_names, args), **kwargs)
        if "num_warps" in fn.arg_names:  # a kernel that takes num_warps gets the launch's
            values["num_warps"] = options.get("num_warps", 4)
        constexprs = {(i,): values[n] for i, n in enumerate(fn.arg_names) if fn.params[i].is_constexpr}
        signature = {n: "constexpr" if fn.params[i].is_constexpr else mangle_type(values[n])
                     for i, n in enumerate(fn.arg_names)}
        # the launch's specialization, as the JIT makes it: 16-byte aligned pointers and integers divisible by
        # 16 (without it the classifier's row writes compile to 2-byte stores, not the device's 16-byte ones)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if not fn.params[i].is_constexpr and _divisible_by_16(values[n])}
        self.compiled.append(triton_compile(GluonASTSource(fn, signature, constexprs, attrs),
                                            target=GPUTarget("cuda", 90, 32), options=options))


def _divisible_by_16(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _compile_launch(module, name: str, launcher):
    """Run launcher() with module.<name> (a kernel) compiled instead of launched; the one compile."""
    kernel = CompileForSm90(getattr(module, name))
    setattr(module, name, kernel)
    try:
        launcher()
    finally:
        setattr(module, name, kernel.kernel)
    (compiled,) = kernel.compiled
    return compiled


def _compile_classifier(buffers: int):
    rows, V = 64, 50257
    Vp = fct.BOX_COLS * -(-V // fct.BOX_COLS)
    logits = torch.empty(rows, Vp, dtype=torch.bfloat16)
    losses = torch.empty(rows, dtype=torch.float32)
    targets = torch.zeros(rows, dtype=torch.int32)
    compiled = _compile_launch(fct, "_fc_tma_kernel", lambda: fct.fused_classifier_tma(
        logits, losses, targets, 1.0 / rows, V, True, sm_count=132, buffers=buffers))
    return compiled, fct.boxes_per_row(Vp)


def _compile_flash_backward(q_sums: bool, a_regs: int = 0, maxnreg: int | None = None):
    B, T, NH, hs = 1, 256, 2, 64
    qkv = torch.empty(B, T, 3 * NH * hs, dtype=torch.bfloat16)
    dout = torch.empty(B, T, NH * hs, dtype=torch.bfloat16)
    lse, delta = torch.empty(B, NH, T), torch.empty(B, NH, T)
    sums = torch.empty(B * T // fw.BLOCK_KEYS, NH * hs) if q_sums else None
    return _compile_launch(fw, "_flash_bwd_wgmma_kernel", lambda: fw.flash_backward_wgmma(
        torch.empty_like(qkv), dout, qkv, lse, delta, NH, hs ** -0.5, hs ** -0.5 * 1.4427, q_sums=sums,
        a_regs=a_regs, maxnreg=maxnreg))


def _summary(compiled) -> dict:
    return {"shared": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"]),
            "sm90a": ".target sm_90a" in compiled.asm["ptx"], "wgmma": "wgmma.mma_async" in compiled.asm["ptx"],
            "tma_loads": compiled.asm["ptx"].count("cp.async.bulk.tensor"),
            "stores": {width: compiled.asm["ptx"].count(f"st.global.{width}") for width in ("b16", "v4.b32")}}


def _compile_all() -> dict:
    """Each kernel's summary, or the last lines of its compile error (one failure does not hide the others)."""
    def attempt(make):
        try:
            return make()
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            return {"error": " | ".join(line.strip() for line in str(e).strip().splitlines()[-4:])}

    def classifier(buffers):
        compiled, boxes = _compile_classifier(buffers)
        return dict(_summary(compiled), boxes=boxes)

    out = {f"classifier{b}": attempt(lambda: classifier(b)) for b in (1, 2)}
    for q_sums in (False, True):
        out[f"flash_backward{'_q_sums' * q_sums}"] = attempt(lambda: _summary(_compile_flash_backward(q_sums)))
    # the model's configuration at hs 64 (flash_attention's table: k from registers, a register cap)
    model = fa._CONFIGS_16[64]
    out["flash_backward_k_in_registers"] = attempt(lambda: _summary(_compile_flash_backward(
        True, model["wgmma_a_regs"], model["wgmma_maxnreg"])))
    return out


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("buffers", [1, 2])
def test_tma_classifier_compiles(compiled, buffers):
    c = compiled[f"classifier{buffers}"]
    assert "error" not in c, c.get("error")
    assert c["sm90a"] and c["cubin_bytes"] > 0 and c["tma_loads"] > 0
    # a program holds `buffers` rows of 8 kB boxes, and an SM two rows: one program of two or two of one
    assert buffers * c["boxes"] * fct.BOX_ROWS * fct.BOX_COLS * 2 <= c["shared"]
    assert c["shared"] * (2 // buffers) <= SM90_SHARED_BYTES
    # the gradient leaves in 16-byte vectors (8 logits a thread a box), never element by element
    assert c["stores"]["v4.b32"] > 0 and c["stores"]["b16"] == 0, c["stores"]


@pytest.mark.parametrize("variant", ["flash_backward", "flash_backward_q_sums", "flash_backward_k_in_registers"])
def test_wgmma_flash_backward_compiles(compiled, variant):
    c = compiled[variant]
    assert "error" not in c, c.get("error")
    assert c["sm90a"] and c["wgmma"] and c["cubin_bytes"] > 0 and c["tma_loads"] > 0
    # three programs an SM: the balance run W measured (bench/RESULTS.md)
    assert 3 * c["shared"] <= SM90_SHARED_BYTES


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
