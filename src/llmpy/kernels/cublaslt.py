"""cuBLASLt's matrix products with the epilogues llm.c uses, called directly (ctypes) in the library
PyTorch already loaded.

Why not torch: torch.addmm reaches cuBLASLt's BIAS epilogue, but no torch op asks cuBLASLt for GELU_AUX_BIAS
(write the pre-activation AND its GELU) or DGELU (apply GELU's derivative in the epilogue of the
input-gradient product). Those are what llm.c's matmul_cublaslt does on sm_90 (-ge 1, 2), and they take
a pass over a (B*T, 4C) tensor out of the step each. BGRADB sums the output gradient's columns (a bias
gradient) while the weight-gradient product reads it anyway; its sums have the product's dtype (on an
H200 with cuBLAS 13 there is no algorithm for fp32 sums of bf16 products). DGELU_BGRAD is not here: with
bf16 sums it took 1.7 ms where the product and our fused dGELU + bias pass take 0.8 (bench/RESULTS.md,
run L).

The binding is small: one handle and one workspace per device (and per stream that asks for one), and
per distinct problem (shapes, layouts, epilogue, pointer alignments, rank, SM target) a cached plan -
the operation descriptor, four matrix layouts and the algorithm of that rank in cuBLASLt's heuristic
list (0, the first, unless kernels.matmul.TUNED_ALGOS names another rank or a whole configuration, an
AlgoConfig, that cuBLASLt's AlgoCheck accepts). The ranking is a pure function of the problem and a
configuration names one kernel, so the same run gives the same kernels and the same bits every time
(no timing-based choice); tests/test_cublaslt.py checks results against torch and repeats bitwise.
Everything is enqueued on torch's current stream, so it is captured by CUDA graphs like any other kernel.

Row-major tensors, as everywhere in llmpy: a row-major (R, C) matrix is cuBLAS's column-major (C, R), so
out = inp @ weight.T is computed as out^T = weight^T' @ inp^T in cuBLAS's terms (the helpers below do
the bookkeeping; `linear_*` are the three products of a linear layer).

GELU here is cuBLASLt's, the tanh form of GPT-2 (not bitwise kernels/gelu.py's: the GELU-fused path is
tested against the reference within bf16 tolerance, like every other kernel).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import os

import torch

from ..errors import LlmpyError

# cudaDataType_t, cublasComputeType_t, cublasOperation_t
_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DTYPES = {torch.float32: _CUDA_R_32F, torch.bfloat16: _CUDA_R_16BF}

# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_DESC_SM_COUNT_TARGET = 15
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D bytes
# cublasLtMatmulAlgoConfigAttributes_t, with each attribute's C type
_CONFIG_ATTRS = {"algo_id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "splitk": (2, ctypes.c_int32),
                 "reduction": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32), "custom": (5, ctypes.c_uint32),
                 "stages": (6, ctypes.c_uint32), "inner_shape": (7, ctypes.c_uint16),
                 "cluster": (8, ctypes.c_uint16)}

# cublasLtEpilogue_t
EPILOGUE_DEFAULT = 1
EPILOGUE_BIAS = 4
EPILOGUE_GELU_AUX = 160
EPILOGUE_GELU_AUX_BIAS = 164
EPILOGUE_DGELU = 192
EPILOGUE_BGRADB = 512
_WITH_BIAS = (EPILOGUE_BIAS, EPILOGUE_GELU_AUX_BIAS, EPILOGUE_BGRADB)
_WITH_AUX = (EPILOGUE_GELU_AUX, EPILOGUE_GELU_AUX_BIAS, EPILOGUE_DGELU)

# llm.c's cuBLASLt workspace on sm_90 (32 MiB)
WORKSPACE_BYTES = 32 << 20
_HEURISTIC_RESULT_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo (64) + workspace size, state, waves, 4 reserved


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """One cuBLASLt algorithm named in full (cublasLtMatmulAlgoInit's id and the configuration attributes,
    as the cublasLt.h enums number them), instead of a rank in the heuristic's list: the heuristic offers a
    few configurations, an algorithm may run many more (bench/kernels/search_cublaslt.py finds them).
    splitk > 1 splits the inner dimension in that many parts, summed by the reduction scheme
    (cublasLtReductionScheme_t: 1 in place in the output's type, 2 in fp32 in the workspace, 4 in the output's
    type in the workspace); a fixed configuration sums its parts in a fixed order, so its bits repeat, but
    another split gives other bits."""
    algo_id: int
    tile: int
    stages: int
    swizzle: int = 0
    custom: int = 0
    cluster: int = 0
    inner_shape: int = 0
    splitk: int = 1
    reduction: int = 0


class CublasLtError(LlmpyError):
    """cuBLASLt refused a problem (no algorithm, a bad status): the caller may fall back to torch."""


def _find_library() -> str | None:
    """The libcublasLt torch loaded (it is in this process after torch's first CUDA product), else the one
    in the pip packages of NVIDIA's CUDA libraries next to torch."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    for pattern in ("nvidia/cu*/lib/libcublasLt.so*", "nvidia/cublas/lib/libcublasLt.so*"):
        hits = sorted(glob.glob(os.path.join(site, pattern)))
        if hits:
            return hits[-1]
    return None


@functools.lru_cache(maxsize=None)
def _lib():
    if not torch.cuda.is_available():
        raise CublasLtError("cuBLASLt: no CUDA device")
    # make torch load its cuBLAS(Lt) first, so that we bind to the very same library
    a = torch.ones(8, 8, device="cuda", dtype=torch.float32)
    torch.mm(a, a)
    torch.cuda.synchronize()
    path = _find_library()
    if path is None:
        raise CublasLtError("cuBLASLt: libcublasLt not found next to torch")
    lib = ctypes.CDLL(path)
    vp, sz, i32, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int64
    pvp = ctypes.POINTER(vp)
    sigs = {
        "cublasLtCreate": [pvp],
        "cublasLtMatmulDescCreate": [pvp, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [pvp, i32, ctypes.c_uint64, ctypes.c_uint64, i64],
        "cublasLtMatmulPreferenceCreate": [pvp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, ctypes.POINTER(i32)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        "cublasLtMatmulAlgoGetIds": [vp, i32, i32, i32, i32, i32, i32, i32, vp, ctypes.POINTER(i32)],
        "cublasLtMatmulAlgoInit": [vp, i32, i32, i32, i32, i32, i32, i32, vp],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, vp, vp],
        "cublasLtMatmulAlgoCapGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, ctypes.POINTER(sz)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _check(status: int, what: str):
    if status != 0:
        raise CublasLtError(f"cuBLASLt: {what} returned status {status}")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the binding can run here (a CUDA device and torch's libcublasLt); asked once a process."""
    try:
        _lib()
        return True
    except (CublasLtError, OSError, AttributeError, RuntimeError):
        return False


class _Device:
    """One handle and one workspace per device, and one more per stream registered by
    reserve_workspace (products on two streams at once must not share a workspace)."""

    def __init__(self, device: torch.device):
        lib = _lib()
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.stream_workspaces: dict = {}  # cudaStream_t -> workspace


_devices: dict = {}
_plans: dict = {}


def _device_state(device: torch.device) -> _Device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _devices:
        _devices[index] = _Device(torch.device("cuda", index))
    return _devices[index]


def set_workspace_bytes(nbytes: int):
    """The workspace each device (and each reserved stream) gets, in bytes (llm.c's 32 MiB by default): before the
    first product, since a device's workspace is allocated with it and its plans chosen to fit it. Split-K
    configurations keep their fp32 partial sums there (bench/kernels/search_cublaslt.py --workspace-mib)."""
    global WORKSPACE_BYTES
    if nbytes < 1:
        raise LlmpyError(f"cuBLASLt workspace: {nbytes} bytes; give at least 1")
    if _devices and nbytes != WORKSPACE_BYTES:
        raise LlmpyError("cuBLASLt workspace: set its size before the first product (a workspace is allocated)")
    WORKSPACE_BYTES = int(nbytes)


def reserve_workspace(stream: torch.cuda.Stream):
    """Give the products issued on stream a workspace of their own (allocated now, not inside a CUDA
    graph's capture). Every other stream shares the device's workspace."""
    state = _device_state(stream.device)
    if stream.cuda_stream not in state.stream_workspaces:
        state.stream_workspaces[stream.cuda_stream] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                  device=stream.device)


# Products planned while this is non-zero ask cuBLASLt for kernels that use that many SMs (its
# SM_COUNT_TARGET), leaving the rest to a kernel on another stream. See sm_count_target.
_sm_count_target = 0


@contextlib.contextmanager
def sm_count_target(n: int):
    """The products issued inside this context are planned for n SMs (0: all of them), so that a
    memory-bound kernel on another stream finds SMs free while they run."""
    global _sm_count_target
    saved, _sm_count_target = _sm_count_target, int(n)
    try:
        yield
    finally:
        _sm_count_target = saved


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 dividing ptr (a plan is only valid for pointers this aligned)."""
    return min(256, ptr & -ptr) if ptr else 256


def _set(setter, obj, attr: int, value, ctype):
    v = ctype(value)
    _check(setter(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), f"set attribute {attr}")


class _Plan:
    """Descriptor, layouts and the algorithm of one problem (the key _gemm makes): the heuristic's rank
    algo_index, or the AlgoConfig algo_index names."""

    def __init__(self, state: _Device, key, bias_ptr: int, aux_ptr: int):
        (_, m, n, k, transa, transb, lda, ldb, ldc, ldd, dtype, epilogue, aux_ld, aligns, algo_index, sms,
         in_dtype) = key
        lib = _lib()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        dset = lib.cublasLtMatmulDescSetAttribute
        _set(dset, self.desc, _DESC_TRANSA, _OP_T if transa else _OP_N, ctypes.c_int32)
        _set(dset, self.desc, _DESC_TRANSB, _OP_T if transb else _OP_N, ctypes.c_int32)
        _set(dset, self.desc, _DESC_EPILOGUE, epilogue, ctypes.c_uint32)
        if sms:
            _set(dset, self.desc, _DESC_SM_COUNT_TARGET, sms, ctypes.c_int32)
        self.layouts = []
        t, t_in = _DTYPES[dtype], _DTYPES[in_dtype]
        self.types = (t_in, t_in, t, t)  # A, B, C, D: bf16 products may sum into fp32 (linear_weight_grad)
        a_rows, a_cols = (k, m) if transa else (m, k)
        b_rows, b_cols = (n, k) if transb else (k, n)
        for (rows, cols, ld), layout_type in zip(((a_rows, a_cols, lda), (b_rows, b_cols, ldb), (m, n, ldc),
                                                  (m, n, ldd)), self.types):
            layout = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), layout_type, rows, cols, ld),
                   "MatrixLayoutCreate")
            self.layouts.append(layout)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        pset = lib.cublasLtMatmulPreferenceSetAttribute
        _set(pset, pref, _PREF_MAX_WORKSPACE_BYTES, WORKSPACE_BYTES, ctypes.c_uint64)
        for attr, align in zip(_PREF_MIN_ALIGNMENT, aligns[:4]):
            _set(pset, pref, attr, align, ctypes.c_uint32)
        # the heuristic reads the epilogue pointers' alignment from the descriptor
        self.set_pointers(bias_ptr, aux_ptr, aux_ld)
        if isinstance(algo_index, AlgoConfig):
            self.algo, self.workspace_bytes = self.configured(state, algo_index)
            return
        wanted = algo_index + 1
        results = ctypes.create_string_buffer(_HEURISTIC_RESULT_BYTES * wanted)
        count = ctypes.c_int32(0)
        a, b, c, d = self.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(state.handle, self.desc, a, b, c, d, pref, wanted, results,
                                                    ctypes.byref(count))
        if status != 0 or count.value < wanted:
            raise CublasLtError(f"cuBLASLt: no algorithm {algo_index} for m={m} n={n} k={k} epilogue={epilogue} "
                                f"(status {status}, {count.value} found)")
        mine = results.raw[_HEURISTIC_RESULT_BYTES * algo_index:_HEURISTIC_RESULT_BYTES * wanted]
        self.algo = ctypes.create_string_buffer(mine[:64], 64)
        self.workspace_bytes = int.from_bytes(mine[64:72], "little")
        if self.workspace_bytes > WORKSPACE_BYTES:
            raise CublasLtError(f"cuBLASLt: algorithm wants {self.workspace_bytes} bytes of workspace")

    def configured(self, state: _Device, config: AlgoConfig):
        """(algo buffer, workspace bytes) of `config` for this problem, or CublasLtError when cuBLASLt's
        AlgoCheck refuses it here (another GPU, other alignments) or it wants more than our workspace."""
        lib = _lib()
        algo = ctypes.create_string_buffer(64)
        _check(lib.cublasLtMatmulAlgoInit(state.handle, _COMPUTE_32F, _CUDA_R_32F, *self.types, config.algo_id,
                                          algo), f"AlgoInit {config.algo_id}")
        for name, (attr, ctype) in _CONFIG_ATTRS.items():
            if name == "algo_id" or (name in ("splitk", "reduction") and config.splitk == 1):
                continue  # read-only; without split-K, cuBLASLt's defaults (1, none)
            _set(lib.cublasLtMatmulAlgoConfigSetAttribute, algo, attr, getattr(config, name), ctype)
        result = ctypes.create_string_buffer(_HEURISTIC_RESULT_BYTES)
        a, b, c, d = self.layouts
        status = lib.cublasLtMatmulAlgoCheck(state.handle, self.desc, a, b, c, d, algo, result)
        if status != 0:
            raise CublasLtError(f"cuBLASLt: AlgoCheck refused {config} (status {status})")
        workspace = int.from_bytes(result.raw[64:72], "little")
        if workspace > WORKSPACE_BYTES:
            raise CublasLtError(f"cuBLASLt: {config} wants {workspace} bytes of workspace")
        return algo, workspace

    def set_pointers(self, bias_ptr: int, aux_ptr: int, aux_ld: int):
        dset = _lib().cublasLtMatmulDescSetAttribute
        if bias_ptr:
            _set(dset, self.desc, _DESC_BIAS_POINTER, bias_ptr, ctypes.c_void_p)
        if aux_ptr:
            _set(dset, self.desc, _DESC_AUX_POINTER, aux_ptr, ctypes.c_void_p)
            _set(dset, self.desc, _DESC_AUX_LD, aux_ld, ctypes.c_int64)


def config_of(algo) -> AlgoConfig:
    """The AlgoConfig of an algorithm buffer (a plan's, or one the heuristic returned): what it runs."""
    lib = _lib()
    values = {}
    for name, (attr, ctype) in _CONFIG_ATTRS.items():
        v, written = ctype(0), ctypes.c_size_t(0)
        _check(lib.cublasLtMatmulAlgoConfigGetAttribute(algo, attr, ctypes.byref(v), ctypes.sizeof(v),
                                                        ctypes.byref(written)), f"get config attribute {attr}")
        values[name] = int(v.value)
    if values["splitk"] <= 1:
        values["splitk"], values["reduction"] = 1, 0
    return AlgoConfig(**values)


def _gemm(d, a, b, m, n, k, transa, transb, lda, ldb, ldd, *, epilogue=EPILOGUE_DEFAULT, bias=None, aux=None,
          aux_ld=0, accumulate=False, c=None, ldc=0, algo_index=0):
    """cuBLAS column-major D (m, n) = op(A) @ op(B) (+ D when accumulate; + C, leading dimension ldc, when c
    is given), with an epilogue. a, b, c, d, bias, aux are tensors whose data pointers are used as they
    are. algo_index: which of the heuristic's ranked algorithms (0, the first), or an AlgoConfig."""
    if accumulate and c is not None:
        raise ValueError("cuBLASLt: accumulate adds D itself; c is another matrix to add")
    beta = 1.0 if accumulate or c is not None else 0.0
    if c is None:
        c, ldc = d, ldd  # accumulate: C is D; beta = 0: C is not read
    if (epilogue in _WITH_BIAS) != (bias is not None) or (epilogue in _WITH_AUX) != (aux is not None):
        raise ValueError(f"cuBLASLt epilogue {epilogue}: bias/aux given {bias is not None}/{aux is not None}")
    state = _device_state(d.device)
    bias_ptr = bias.data_ptr() if bias is not None else 0
    aux_ptr = aux.data_ptr() if aux is not None else 0
    ptrs = (a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), bias_ptr, aux_ptr)
    aligns = tuple(_alignment(p) for p in ptrs)
    key = (d.device.index, m, n, k, bool(transa), bool(transb), lda, ldb, ldc, ldd, d.dtype, epilogue, aux_ld,
           aligns, algo_index, _sm_count_target, a.dtype)
    plan = _plans.get(key)
    if isinstance(plan, CublasLtError):  # refused before: refuse again without asking the heuristic
        raise plan
    if plan is None:
        try:
            plan = _plans[key] = _Plan(state, key, bias_ptr, aux_ptr)
        except CublasLtError as e:
            _plans[key] = e
            raise
    else:
        plan.set_pointers(bias_ptr, aux_ptr, aux_ld)
    lib = _lib()
    alpha = ctypes.c_float(1.0)
    beta = ctypes.c_float(beta)
    la, lb, lc, ld_ = plan.layouts
    stream = torch.cuda.current_stream(d.device).cuda_stream
    workspace = state.stream_workspaces.get(stream, state.workspace)
    _check(lib.cublasLtMatmul(state.handle, plan.desc, ctypes.byref(alpha), ptrs[0], la, ptrs[1], lb,
                              ctypes.byref(beta), ptrs[2], lc, ptrs[3], ld_, plan.algo,
                              workspace.data_ptr(), workspace.numel(), stream), "cublasLtMatmul")


def _check_operands(shapes: dict, fp32_out: str | None = None, **tensors):
    """Every given tensor a row-major 2-D matrix (rows may be strided views) or a contiguous vector of the
    expected shape, all of one dtype: cuBLASLt reads raw pointers, so a mismatch must stop here. fp32_out:
    the name of an output that may be fp32 whatever the rest are (bf16 products summed into fp32)."""
    dtypes = set()
    for name, t in tensors.items():
        if t is None:
            continue
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"cuBLASLt: {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
        if t.stride(-1) != 1 or (t.dim() == 2 and t.stride(0) < t.shape[1]) or t.dim() not in (1, 2):
            raise ValueError(f"cuBLASLt: {name} must be a row-major matrix or a contiguous vector, got "
                             f"strides {t.stride()}")
        if name != fp32_out or t.dtype != torch.float32:  # an fp32 output is outside the one-dtype rule
            dtypes.add(t.dtype)
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise ValueError(f"cuBLASLt: operands of one dtype, fp32 or bf16, expected: got {sorted(map(str, dtypes))}")


def linear_forward(out, inp, weight, bias=None, pre_gelu=None, residual=None, algo_index=0):
    """out (M, OC) = inp (M, C) @ weight (OC, C).T + bias. With pre_gelu: pre_gelu = inp @ weight.T + bias
    and out = gelu(pre_gelu), in the epilogue (GELU_AUX_BIAS). With residual (M, OC): out = residual +
    inp @ weight.T + bias, summed in fp32 and rounded once (beta = 1 with C = residual). residual may be out
    itself, but then, in bf16, cuBLASLt rounds the product before adding it (two roundings, measured on the
    H200 with cuBLAS 13), so the model always writes into another buffer. Rows may be strided (views)."""
    M, C = inp.shape
    OC = weight.shape[0]
    if residual is not None and pre_gelu is not None:
        raise ValueError("cuBLASLt: a residual is added after the product, not before a GELU")
    _check_operands(dict(out=(M, OC), inp=(M, C), weight=(OC, C), bias=(OC,), pre_gelu=(M, OC), residual=(M, OC)),
                    out=out, inp=inp, weight=weight, bias=bias, pre_gelu=pre_gelu, residual=residual)
    if pre_gelu is not None:
        epilogue = EPILOGUE_GELU_AUX_BIAS if bias is not None else EPILOGUE_GELU_AUX
    else:
        epilogue = EPILOGUE_BIAS if bias is not None else EPILOGUE_DEFAULT
    _gemm(out, weight, inp, OC, M, C, True, False, weight.stride(0), inp.stride(0), out.stride(0),
          epilogue=epilogue, bias=bias, aux=pre_gelu, aux_ld=pre_gelu.stride(0) if pre_gelu is not None else 0,
          c=residual, ldc=residual.stride(0) if residual is not None else 0, algo_index=algo_index)
    return out


def linear_input_grad(dinp, dout, weight, pre_gelu=None, algo_index=0):
    """dinp (M, C) = dout (M, OC) @ weight (OC, C), overwritten. With pre_gelu (this layer's input was
    gelu(pre_gelu)): times gelu'(pre_gelu) in the epilogue (DGELU)."""
    M, OC = dout.shape
    C = weight.shape[1]
    _check_operands(dict(dinp=(M, C), dout=(M, OC), weight=(OC, C), pre_gelu=(M, C)),
                    dinp=dinp, dout=dout, weight=weight, pre_gelu=pre_gelu)
    _gemm(dinp, weight, dout, C, M, OC, False, False, weight.stride(0), dout.stride(0), dinp.stride(0),
          epilogue=EPILOGUE_DGELU if pre_gelu is not None else EPILOGUE_DEFAULT, aux=pre_gelu,
          aux_ld=pre_gelu.stride(0) if pre_gelu is not None else 0, algo_index=algo_index)
    return dinp


def linear_weight_grad(dweight, dout, inp, accumulate: bool = True, dbias_sums=None, algo_index=0):
    """dweight (OC, C) += dout (M, OC).T @ inp (M, C) (accumulate=False: =). dweight may be fp32 where dout
    and inp are bf16: the fp32 sums unrounded (matmul.weight_grad_bias_column's wide product). dbias_sums
    (OC), dout's dtype: OVERWRITTEN with the column sums of dout, summed in the same product (BGRADB)."""
    M, OC = dout.shape
    C = inp.shape[1]
    _check_operands(dict(dweight=(OC, C), dout=(M, OC), inp=(M, C), dbias_sums=(OC,)), fp32_out="dweight",
                    dweight=dweight, dout=dout, inp=inp, dbias_sums=dbias_sums)
    if dbias_sums is not None and dweight.dtype != dout.dtype:
        raise ValueError("cuBLASLt: the bias sums in the product (BGRADB) only with dweight in dout's dtype")
    _gemm(dweight, inp, dout, C, OC, M, False, True, inp.stride(0), dout.stride(0), dweight.stride(0),
          epilogue=EPILOGUE_BGRADB if dbias_sums is not None else EPILOGUE_DEFAULT, bias=dbias_sums,
          accumulate=accumulate, algo_index=algo_index)
    return dweight
