"""Causal attention through cuDNN's fused flash-attention kernels, described with NVIDIA's cuDNN frontend
(the `nvidia-cudnn-frontend` package, module `cudnn`): llm.c's USE_CUDNN path, from Python.

Why not PyTorch's own cuDNN attention (attention="torch-cudnn", kernels/attention.py): PyTorch builds the
backward without cuDNN's deterministic algorithm, so dq is summed across key blocks with floating-point
atomics and the same step gives different bits from run to run; and its ops allocate their outputs in
q's layout, which then have to be copied into our buffers (36 strided copies a step, bench/RESULTS.md run E).
Here the cuDNN graphs are described on our own layouts, so nothing is copied:

    q, k, v     strided views of qkv (B, T, 3, NH, hs): dims (B, NH, T, hs), strides (3C*T, hs, 3C, 1),
                at element offsets 0, C and 2C
    out, dout   (B, T, NH, hs): dims (B, NH, T, hs), strides (C*T, hs, C, 1)
    lse         (B, NH, T) fp32, the natural-log log-sum-exp of the scaled scores, as (B, NH, T, 1)
    dq, dk, dv  written straight into dqkv, with q's, k's and v's strides

and the backward is built with use_deterministic_algorithm=True: cuDNN then adds the key blocks' shares
of dq in a fixed order (no floating-point atomics), so a training step keeps its bits.

One forward graph and one backward graph per (device, B, T, NH, hs, dtype), built on first use (cuDNN's
heuristics pick the engine) and cached. Their workspace is the caller's (the model allocates
`workspace_bytes` with its other buffers) or else one per device kept here. The kernels run on torch's
current stream, so the calls can be captured in a CUDA graph once a shape has run eagerly.

The forward alone is also the forward of attention="cudnn+flash": cuDNN's forward kernel (0.31 against
0.37 ms a layer for the Triton one at GPT-2 124M's B=64, T=1024 on the H200) with the Triton flash backward,
which reads the same natural-log lse and needs no workspace (cuDNN's deterministic backward, as fast as
the Triton one there, takes 1.5 GiB).
"""
from __future__ import annotations

import functools
import math

import torch

INSTALL_HINT = "pip install nvidia-cudnn-frontend"


@functools.lru_cache(maxsize=None)
def frontend():
    """The cuDNN frontend module, or ImportError with the install hint. Imported only when asked for:
    it loads libcudnn (the one PyTorch's CUDA wheels bring)."""
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - a broken install is reported like a missing one
        raise ImportError(f"cuDNN attention needs the cuDNN frontend ({INSTALL_HINT}): {e}") from None
    return cudnn


_IO_TYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}


class _Device:
    """Per-device state: the cuDNN handle and a workspace shared by every graph on the device."""

    def __init__(self, device: torch.device):
        cudnn = frontend()
        with torch.cuda.device(device):
            self.handle = cudnn.create_handle()
        self.device = device
        self.workspace = torch.empty(0, dtype=torch.uint8, device=device)

    def reserve(self, nbytes: int):
        if nbytes > self.workspace.numel():
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("cuDNN attention: a new graph needs a larger workspace during CUDA graph "
                                   "capture; run the shape once before capturing")
            self.workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def bind(self):
        """Point the handle at torch's current stream (a capture stream while capturing)."""
        frontend().set_stream(self.handle, torch.cuda.current_stream(self.device).cuda_stream)


_DEVICES: dict = {}


def _device_state(device: torch.device) -> _Device:
    if device not in _DEVICES:
        _DEVICES[device] = _Device(device)
    return _DEVICES[device]


def _strides(B, T, C, NH, hs, width):
    """dims and strides of a (B, NH, T, hs) view into a (B, T, width*C) tensor."""
    return [B, NH, T, hs], [width * C * T, hs, width * C, 1]


class _Graph:
    """One built cuDNN graph and the uids of its tensors."""

    def __init__(self, graph, tensors: dict, workspace_bytes: int):
        self.graph, self.tensors, self.workspace_bytes = graph, tensors, workspace_bytes

    def run(self, state: _Device, pointers: dict, workspace: torch.Tensor | None):
        if workspace is None:
            workspace = state.workspace
        elif workspace.numel() * workspace.element_size() < self.workspace_bytes:
            raise ValueError(f"cuDNN attention: the workspace has {workspace.numel() * workspace.element_size()} "
                             f"bytes, the graph needs {self.workspace_bytes}")
        state.bind()
        self.graph.execute({self.tensors[name]: ptr for name, ptr in pointers.items()}, workspace.data_ptr(),
                           handle=state.handle)


def _new_graph(state: _Device, dtype: torch.dtype, name: str):
    cudnn = frontend()
    io = getattr(cudnn.data_type, _IO_TYPES[dtype])
    return cudnn.pygraph(name=name, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=state.handle)


def _finish(g, tensors: dict) -> _Graph:
    cudnn = frontend()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    nbytes = g.get_workspace_size()
    return _Graph(g, tensors, nbytes)


def _begin(device: torch.device, B: int, T: int, NH: int, hs: int, dtype: torch.dtype, name: str):
    """A new graph on device's handle, with q, k, v described as views of qkv; also the (dims, strides)
    of those views (dq, dk, dv have them too), of out's view and of lse."""
    cudnn = frontend()
    C = NH * hs
    g = _new_graph(_device_state(device), dtype, name)
    qkv_layout = _strides(B, T, C, NH, hs, 3)
    q, k, v = (g.tensor(*qkv_layout, name=n) for n in ("q", "k", "v"))
    lse_layout = ([B, NH, T, 1], [NH * T, T, 1, 1])
    return cudnn, g, (q, k, v), qkv_layout, _strides(B, T, C, NH, hs, 1), lse_layout


@functools.lru_cache(maxsize=None)
def _forward_graph(device: torch.device, B: int, T: int, NH: int, hs: int, dtype: torch.dtype) -> _Graph:
    cudnn, g, (q, k, v), _, out_layout, lse_layout = _begin(device, B, T, NH, hs, dtype, "llmpy_attention_forward")
    out, lse = g.sdpa(q, k, v, generate_stats=True, attn_scale=1.0 / math.sqrt(hs), use_causal_mask=True,
                      name="sdpa")
    out.set_output(True).set_dim(out_layout[0]).set_stride(out_layout[1])
    lse.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(lse_layout[0]).set_stride(lse_layout[1])
    return _finish(g, {"q": q, "k": k, "v": v, "out": out, "lse": lse})


@functools.lru_cache(maxsize=None)
def _backward_graph(device: torch.device, B: int, T: int, NH: int, hs: int, dtype: torch.dtype) -> _Graph:
    """Built with cuDNN's deterministic algorithm: the key blocks' shares of dq are added in a fixed order."""
    cudnn, g, (q, k, v), qkv_layout, out_layout, lse_layout = _begin(device, B, T, NH, hs, dtype,
                                                                    "llmpy_attention_backward")
    out = g.tensor(*out_layout, name="out")
    dout = g.tensor(*out_layout, name="dout")
    lse = g.tensor(*lse_layout, data_type=cudnn.data_type.FLOAT, name="lse")
    dq, dk, dv = g.sdpa_backward(q, k, v, out, dout, lse, attn_scale=1.0 / math.sqrt(hs), use_causal_mask=True,
                                 use_deterministic_algorithm=True, name="sdpa_backward")
    for t in (dq, dk, dv):
        t.set_output(True).set_dim(qkv_layout[0]).set_stride(qkv_layout[1])
    return _finish(g, {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse,
                       "dq": dq, "dk": dk, "dv": dv})


def _shape(qkv: torch.Tensor, num_heads: int):
    B, T, C3 = qkv.shape
    assert C3 % (3 * num_heads) == 0, (qkv.shape, num_heads)
    C = C3 // 3
    return B, T, C, C // num_heads


def _check(out, lse, qkv, num_heads):
    B, T, C, hs = _shape(qkv, num_heads)
    assert qkv.is_cuda and qkv.dtype in _IO_TYPES and qkv.is_contiguous(), (qkv.device, qkv.dtype)
    assert out.shape == (B, T, C) and out.dtype == qkv.dtype and out.is_contiguous() and out.device == qkv.device
    assert lse.shape == (B, num_heads, T) and lse.dtype == torch.float32 and lse.is_contiguous()
    return B, T, C, hs


def _qkv_pointers(qkv: torch.Tensor, C: int, prefix: str = "") -> dict:
    base, step = qkv.data_ptr(), C * qkv.element_size()
    return {prefix + "q": base, prefix + "k": base + step, prefix + "v": base + 2 * step}


def _cuda_device(device) -> torch.device:
    """A CUDA device with its index (the graphs and handles are per device)."""
    device = torch.device(device)
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _graph_and_state(kind, qkv: torch.Tensor, num_heads: int, workspace: torch.Tensor | None):
    B, T, C, hs = _shape(qkv, num_heads)
    device = _cuda_device(qkv.device)
    graph = kind(device, B, T, num_heads, hs, qkv.dtype)
    state = _device_state(device)
    if workspace is None:
        state.reserve(graph.workspace_bytes)
    return graph, state


def workspace_bytes(B: int, T: int, num_heads: int, head_size: int, dtype: torch.dtype, device,
                    backward: bool = True) -> int:
    """Bytes of workspace the forward (and the backward) graph of this shape need on device: builds the
    graphs (cached). The model allocates this much with its other buffers and passes it in."""
    device = _cuda_device(device)
    n = _forward_graph(device, B, T, num_heads, head_size, dtype).workspace_bytes
    if backward:
        n = max(n, _backward_graph(device, B, T, num_heads, head_size, dtype).workspace_bytes)
    return n


def cudnn_attention_forward(out: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor, num_heads: int,
                            workspace: torch.Tensor | None = None):
    """cuDNN fused causal attention forward: qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T) fp32 (the
    natural-log log-sum-exp of the scaled scores). bf16 / fp16, CUDA only. workspace: at least
    workspace_bytes(...) bytes on the device, else the module's own (grown as needed, not during capture)."""
    B, T, C, hs = _check(out, lse, qkv, num_heads)
    graph, state = _graph_and_state(_forward_graph, qkv, num_heads, workspace)
    graph.run(state, {**_qkv_pointers(qkv, C), "out": out.data_ptr(), "lse": lse.data_ptr()}, workspace)


def cudnn_attention_backward(dqkv: torch.Tensor, dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, num_heads: int, workspace: torch.Tensor | None = None):
    """cuDNN fused causal attention backward, deterministic: dqkv (B, T, 3C) OVERWRITTEN from dout (B, T, C),
    given the forward's qkv, out and lse. workspace as in cudnn_attention_forward (the backward needs
    much more: 1.5 GiB at GPT-2 124M's B=64, T=1024)."""
    B, T, C, hs = _check(out, lse, qkv, num_heads)
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype and dqkv.is_contiguous()
    assert dout.shape == out.shape and dout.dtype == out.dtype and dout.is_contiguous()
    graph, state = _graph_and_state(_backward_graph, qkv, num_heads, workspace)
    pointers = {**_qkv_pointers(qkv, C), **_qkv_pointers(dqkv, C, "d"), "out": out.data_ptr(),
                "dout": dout.data_ptr(), "lse": lse.data_ptr()}
    graph.run(state, pointers, workspace)
