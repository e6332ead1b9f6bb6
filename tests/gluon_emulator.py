"""Gluon kernels run on the CPU: the kernel's own Python body, one program at a time, with `gl`, `mbarrier`,
`tma` and `warpgroup_mma` replaced by torch operations (Gluon has no interpreter; Triton's covers tl only).

What it checks that a float64 stand-in for a kernel cannot: the kernel's tile coordinates, masks, ring-slot and
barrier-phase arithmetic and epilogue, on small shapes against float64. Pointer loads and stores outside their
tensor raise; shared memory starts as NaN; a barrier waited on in a phase that never completes raises.

The asynchronous parts keep their hazards visible:
- an asynchronous wgmma runs only when a warpgroup_mma_wait retires it (oldest first), reading its shared-memory
  operands then, so a ring slot refilled before the product that reads it was waited for gives a wrong result;
- TMA loads land either when issued (`tma_loads="at-issue"`: catches a slot refilled too early) or only when
  their barrier is waited on (`"at-wait"`: catches a slot read before its wait); run the tests in both;
- TMA stores leave shared memory only at tma.store_wait (or the program's end), so a buffer overwritten before
  its store drained shows.

Reported as errors rather than wrong numbers: a product, a TMA load or store, or a read or write of shared
memory touching a buffer whose TMA load is still queued (at-wait); a TMA load or a store into shared memory that
a product or TMA store in flight still reads; a product's result stored before it was retired.

Not modelled: the CTA's threads and warps (a program is one sequential body), layouts (ignored), fp32
summation order inside a product or reduction (torch's), separate allocations sharing shared memory (the
compiler may give a later one an earlier one's bytes), register and shared-memory budgets (the sm_90a compile
tests see those), Gluon's API itself (test_gluon_compile compiles the kernels).

Usage: `monkeypatch.setattr(module, "_kernel", emulate(module._kernel, tma_loads=...))`, then call the module's
host function with CPU tensors.
"""
from __future__ import annotations

import inspect
import math
import types

import torch

from triton.experimental.gluon import language as _real_gl
from triton.experimental.gluon.language.nvidia import hopper as _real_hopper
from triton.runtime.jit import ConstexprFunction, JITFunction

from llmpy.kernels import gluon_compat as _compat

TMA_MODES = ("at-issue", "at-wait")


class EmulationError(AssertionError):
    """A kernel did something that would be wrong on the GPU (out of bounds, a deadlock, a dtype mismatch)."""


class _Program:
    """The state of the program being run: its ids, in-flight products and TMA stores, barriers."""

    def __init__(self, pid, grid, tma_loads, where):
        self.pid, self.grid, self.tma_loads, self.where = pid, grid, tma_loads, where
        self.mmas: list[_MmaToken] = []
        self.stores: list = []
        self.barriers: dict = {}


_current: _Program | None = None


def _prog() -> _Program:
    if _current is None:
        raise EmulationError("a Gluon operation outside an emulated kernel")
    return _current


def _fail(message):
    p = _current
    raise EmulationError(f"{p.where} program {p.pid}: {message}" if p else message)


# ---------------------------------------------------------------------------------------------------
# memory: pointers, shared memory, descriptors

def _flat(t: torch.Tensor) -> torch.Tensor:
    """The memory a pointer to t addresses: t itself when contiguous, else its storage from t's first element."""
    if t.is_contiguous():
        return t.view(-1)
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((n,), (1,), t.storage_offset())


class Pointer:
    """A kernel's pointer argument plus offsets (a tensor of them after arithmetic)."""

    def __init__(self, flat: torch.Tensor, offsets=0, name="pointer"):
        self.flat, self.offsets, self.name = flat, offsets, name

    def __add__(self, other):
        if isinstance(other, Pointer):
            _fail(f"{self.name}: adding two pointers")
        return Pointer(self.flat, self.offsets + other, self.name)

    __radd__ = __add__

    def __sub__(self, other):
        return Pointer(self.flat, self.offsets - other, self.name)

    @property
    def dtype(self):
        return types.SimpleNamespace(element_ty=self.flat.dtype)

    def _index(self, mask):
        offs = torch.as_tensor(self.offsets).to(torch.int64)
        if mask is not None:
            offs, mask = torch.broadcast_tensors(offs, torch.as_tensor(mask))
        live = offs if mask is None else offs[mask]
        if live.numel() and (live.min() < 0 or live.max() >= self.flat.numel()):
            _fail(f"{self.name}: offsets {int(live.min())}..{int(live.max())} outside its {self.flat.numel()} "
                  "elements")
        return offs, mask


def _load(ptr: Pointer, mask=None, other=None, **_):
    offs, mask = ptr._index(mask)
    if mask is None:
        return ptr.flat[offs]
    fill = other if other is not None else (math.nan if ptr.flat.dtype.is_floating_point else 0)
    out = torch.full(offs.shape, fill, dtype=ptr.flat.dtype)
    out[mask] = ptr.flat[offs[mask]]
    return out


def _store(ptr: Pointer, value, mask=None, **_):
    if isinstance(value, _MmaToken):
        _fail(f"{ptr.name}: storing the result of an asynchronous warpgroup_mma that was never retired")
    offs, mask = ptr._index(mask)
    value = torch.as_tensor(value)
    if value.dtype != ptr.flat.dtype:  # Gluon stores a value of the pointer's element type only
        _fail(f"{ptr.name}: storing {value.dtype} through a pointer to {ptr.flat.dtype}")
    value = value.expand(offs.shape)
    if mask is None:
        ptr.flat[offs] = value
    else:
        ptr.flat[offs[mask]] = value[mask]


class SharedMemory:
    """An allocation (or a view of one: index, permute); new allocations hold NaN, so a read before a write
    shows."""

    def __init__(self, data: torch.Tensor, root=None):
        self.data, self.root = data, root if root is not None else self

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def shape(self):
        return list(self.data.shape)

    def index(self, i):
        return SharedMemory(self.data[int(i)], self.root)

    def permute(self, order):
        return SharedMemory(self.data.permute(*order), self.root)

    def load(self, layout=None):
        _check_not_loading(self, "a shared-memory read")
        return self.data.clone()

    def store(self, value):
        if list(value.shape) != self.shape or value.dtype != self.dtype:
            _fail(f"shared-memory store of {value.dtype}{list(value.shape)} into {self.dtype}{self.shape}")
        _check_not_loading(self, "a shared-memory store")
        _check_not_read(self, "a shared-memory store")
        self.data.copy_(value)

    def _key(self):
        return id(self.root), self.data.storage_offset()

    def overlaps(self, other) -> bool:
        if not isinstance(other, SharedMemory) or other.root is not self.root:
            return False
        lo, hi = _extent(self.data)
        olo, ohi = _extent(other.data)
        return lo < ohi and olo < hi


def _extent(t: torch.Tensor):
    """The storage elements a view spans (first, one past the last)."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset(), last + 1


def _check_not_loading(smem: SharedMemory, what: str):
    """Nothing may read or write shared memory a TMA load is still bringing in (at-wait mode: before its wait)."""
    for state in _prog().barriers.values():
        if any(dest.overlaps(smem) for _, _, dest in state.loads):
            _fail(f"{what} of shared memory whose TMA load has not been waited for")


def _check_not_read(smem: SharedMemory, what: str):
    """Nothing may overwrite shared memory an asynchronous product or TMA store still in flight reads."""
    if any(smem.overlaps(src) for _, _, src in _prog().stores):
        _fail(f"{what} into shared memory a TMA store has not read yet (tma.store_wait first)")
    for token in _prog().mmas:
        if smem.overlaps(token.a) or smem.overlaps(token.b):
            _fail(f"{what} into shared memory that an asynchronous warpgroup_mma still in flight reads "
                  "(retire it with warpgroup_mma_wait first)")


def _allocate_shared_memory(dtype, shape, layout=None, value=None):
    shape = [int(s) for s in shape]
    if value is not None:
        return SharedMemory(value.clone())
    if dtype.is_floating_point:
        return SharedMemory(torch.full(shape, math.nan, dtype=dtype))
    return SharedMemory(torch.zeros(shape, dtype=dtype))


class Descriptor:
    """A TMA descriptor: the global tensor and the box."""

    def __init__(self, real):
        self.base, self.block_shape = real.base, [int(b) for b in real.block_shape]
        self.layout = getattr(real, "layout", None)
        if list(real.shape) != list(self.base.shape):
            raise EmulationError(f"descriptor shape {list(real.shape)} is not its tensor's {list(self.base.shape)}")

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def block_type(self):
        nbytes = math.prod(self.block_shape) * self.base.element_size()
        return types.SimpleNamespace(shape=list(self.block_shape), nbytes=nbytes)

    def _window(self, coords):
        """The slices of base the box at coords covers, and the same within the box (TMA: zeros outside)."""
        coords = [int(c) for c in coords]
        outer, inner = [], []
        for c, b, n in zip(coords, self.block_shape, self.base.shape):
            lo, hi = max(c, 0), min(c + b, n)
            if hi <= lo:
                return None, None
            outer.append(slice(lo, hi))
            inner.append(slice(lo - c, hi - c))
        return tuple(outer), tuple(inner)

    def read_box(self, coords):
        box = torch.zeros(self.block_shape, dtype=self.base.dtype)
        outer, inner = self._window(coords)
        if outer is not None:
            box[inner] = self.base[outer]
        return box

    def write_box(self, coords, box):
        outer, inner = self._window(coords)
        if outer is not None:
            self.base[outer] = box[inner]


# ---------------------------------------------------------------------------------------------------
# barriers and TMA

class _Barrier:
    def __init__(self):
        self.completed = 0   # phases completed; the barrier is in phase `completed`
        self.pending_tx = 0  # bytes expected and not yet landed in this phase
        self.armed = False   # an expect (arrive with transaction bytes) in this phase
        self.loads: list = []

    def _maybe_complete(self):
        if self.armed and self.pending_tx == 0:
            self.completed += 1
            self.armed = False


def _barrier(bar: SharedMemory) -> _Barrier:
    state = _prog().barriers.get(bar._key())
    if state is None:
        _fail("a barrier used before mbarrier.init")
    return state


def _mbarrier_init(bar, count=1):
    if count != 1:
        _fail(f"mbarrier.init count={count}: only single-arrival barriers are emulated")
    _prog().barriers[bar._key()] = _Barrier()


def _mbarrier_expect(bar, nbytes, pred=True):
    if not pred:
        return
    state = _barrier(bar)
    if state.armed:
        _fail("mbarrier.expect twice in one phase")
    state.armed = True
    state.pending_tx += int(nbytes)
    state._maybe_complete()


def _land(state: _Barrier, load):
    desc, coords, dest = load
    _check_not_read(dest, "a TMA load")
    dest.data.copy_(desc.read_box(coords))
    state.pending_tx -= desc.block_type.nbytes
    if state.pending_tx < 0:
        _fail("a TMA load landed more bytes than its barrier's expect")
    state._maybe_complete()


def _mbarrier_wait(bar, phase, deps=(), pred=True):
    if not pred:
        return
    state = _barrier(bar)
    while state.loads and state.completed % 2 == int(phase):  # at-wait: the loads land now, oldest first
        _land(state, state.loads.pop(0))
    if state.completed % 2 == int(phase):  # try_wait.parity: done once a phase of this parity completed
        _fail(f"mbarrier.wait(phase={int(phase)}) would never return: {state.completed} phase(s) completed, "
              f"{state.pending_tx} bytes outstanding, expect {'made' if state.armed else 'not made'}")


def _mbarrier_invalidate(bar):
    state = _barrier(bar)
    if state.loads or state.armed:
        _fail("mbarrier.invalidate with loads still in flight")
    del _prog().barriers[bar._key()]


def _async_copy_global_to_shared(desc, coords, bar, dest, pred=True):
    if not pred:
        return
    if not isinstance(desc, Descriptor):
        _fail("async_copy_global_to_shared: not a TMA descriptor")
    if list(dest.shape) != desc.block_shape or dest.dtype != desc.dtype:
        _fail(f"TMA box {desc.block_shape} {desc.dtype} into shared memory {dest.shape} {dest.dtype}")
    state = _barrier(bar)
    load = (desc, [int(c) for c in coords], dest)
    _check_not_loading(dest, "a TMA load")
    if _prog().tma_loads == "at-issue":
        _land(state, load)
    else:
        state.loads.append(load)


def _async_copy_shared_to_global(desc, coords, src):
    _check_not_loading(src, "a TMA store")
    _prog().stores.append((desc, [int(c) for c in coords], src))


def _store_wait(pendings=0):
    stores = _prog().stores
    while len(stores) > int(pendings):
        desc, coords, src = stores.pop(0)
        desc.write_box(coords, src.data)


# ---------------------------------------------------------------------------------------------------
# warpgroup MMA

class _MmaToken:
    """An asynchronous product not yet retired; its value exists once a warpgroup_mma_wait retired it."""

    def __init__(self, a, b, acc, use_acc):
        self.a, self.b, self.acc, self.use_acc, self.value = a, b, acc, use_acc, None

    def run(self):
        a = self.a.data if isinstance(self.a, SharedMemory) else self.a  # shared memory is read now
        if not isinstance(self.b, SharedMemory):
            _fail("warpgroup_mma: the B operand must be in shared memory")
        b = self.b.data
        if a.dtype != b.dtype:
            _fail(f"warpgroup_mma: A is {a.dtype}, B is {b.dtype}")
        acc = self.acc.value if isinstance(self.acc, _MmaToken) else self.acc
        if acc is None:
            _fail("warpgroup_mma: an accumulator whose product was not retired first")
        out = a.float() @ b.float()  # bf16 products are exact in fp32; the sum order is torch's
        if list(out.shape) != list(acc.shape):
            _fail(f"warpgroup_mma: [{list(a.shape)}] @ [{list(b.shape)}] into an accumulator {list(acc.shape)}")
        self.value = out + acc if self.use_acc else out

    def __getattr__(self, name):
        _fail(f"the result of an asynchronous warpgroup_mma used ({name}) before warpgroup_mma_wait retired it")


def _warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    for operand in (a, b):
        if isinstance(operand, SharedMemory):
            _check_not_loading(operand, "a warpgroup_mma")
    token = _MmaToken(a, b, acc, bool(use_acc))
    p = _prog()
    if not is_async:
        _retire(0)
        token.run()
        return token.value
    p.mmas.append(token)
    return token


def _retire(num_outstanding):
    mmas = _prog().mmas
    while len(mmas) > int(num_outstanding):
        mmas.pop(0).run()


def _warpgroup_mma_wait(num_outstanding=0, deps=None):
    if deps is None:
        _fail("warpgroup_mma_wait deps must be given")
    _retire(num_outstanding)
    # a product still allowed in flight stays a token: the accumulator of the next product, or waited for later
    out = [d.value if isinstance(d, _MmaToken) and d.value is not None else d for d in deps]
    return out[0] if len(out) == 1 else tuple(out)


# ---------------------------------------------------------------------------------------------------
# the gl namespace

class _Layout:
    def __init__(self, *args, **kwargs):
        pass

    @staticmethod
    def get_default_for(*args, **kwargs):
        return None


def _static_assert(cond, msg=""):
    if not cond:
        _fail(f"static_assert: {msg}")


def _reduce(fn):
    def reduce(x, axis=None, keep_dims=False, **_):
        x = torch.as_tensor(x)
        return fn(x) if axis is None else fn(x, dim=int(axis), keepdim=keep_dims)
    return reduce


def _where(cond, x, y):
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    dtype = x.dtype if x.dim() or not y.dim() else y.dtype  # a Python scalar takes the tensor's type
    return torch.where(torch.as_tensor(cond), x.to(dtype), y.to(dtype))


def _make_gl():
    gl = types.SimpleNamespace()
    for name in ("float32", "bfloat16", "float16", "float64", "int8", "int16", "int32", "int64"):
        setattr(gl, name, getattr(torch, name))
    gl.int1 = torch.bool
    gl.constexpr = lambda x=None: x
    for name in ("SliceLayout", "DotOperandLayout", "NVMMADistributedLayout", "BlockedLayout",
                 "NVMMASharedLayout", "SwizzledSharedLayout", "AutoLayout"):
        setattr(gl, name, _Layout)
    gl.program_id = lambda axis: torch.tensor(_prog().pid[axis], dtype=torch.int32)
    gl.num_programs = lambda axis: torch.tensor(_prog().grid[axis], dtype=torch.int32)
    gl.arange = lambda start, end, layout=None: torch.arange(int(start), int(end), dtype=torch.int32)
    gl.zeros = lambda shape, dtype, layout=None: torch.zeros([int(s) for s in shape], dtype=dtype)
    gl.full = lambda shape, value, dtype, layout=None: torch.full([int(s) for s in shape], float(value), dtype=dtype)
    gl.static_range = lambda *args: range(*(int(a) for a in args))
    gl.static_assert = _static_assert
    gl.load, gl.store = _load, _store
    gl.allocate_shared_memory = _allocate_shared_memory
    gl.expand_dims = lambda x, axis: torch.as_tensor(x).unsqueeze(int(axis))
    gl.convert_layout = lambda x, layout, assert_trivial=False: x
    gl.where = _where
    gl.exp2, gl.exp, gl.log2, gl.log = torch.exp2, torch.exp, torch.log2, torch.log
    gl.sqrt, gl.abs, gl.maximum, gl.minimum = torch.sqrt, torch.abs, torch.maximum, torch.minimum
    gl.sum = _reduce(torch.sum)
    gl.max, gl.min = _reduce(torch.amax), _reduce(torch.amin)
    gl.barrier = gl.thread_barrier = lambda: None
    return gl


_GL = _make_gl()
_MBARRIER = types.SimpleNamespace(init=_mbarrier_init, expect=_mbarrier_expect, wait=_mbarrier_wait,
                                  invalidate=_mbarrier_invalidate, MBarrierLayout=_Layout)
_TMA = types.SimpleNamespace(async_copy_global_to_shared=_async_copy_global_to_shared,
                             async_copy_shared_to_global=_async_copy_shared_to_global, store_wait=_store_wait)
# the real objects a kernel module may hold under any name, and what stands in for them
_STAND_INS = {id(_real_gl): _GL, id(_real_hopper.mbarrier): _MBARRIER, id(_real_hopper.tma): _TMA,
              id(_compat.tma_load): _async_copy_global_to_shared, id(_compat.tma_store): _async_copy_shared_to_global,
              id(_real_hopper.warpgroup_mma): _warpgroup_mma, id(_real_hopper.warpgroup_mma_wait): _warpgroup_mma_wait,
              id(_real_hopper.warpgroup_mma_init): lambda x: x,
              id(_real_hopper.fence_async_shared): lambda *a, **k: None}
for _name in ("barrier", "thread_barrier"):
    if hasattr(_real_gl, _name):
        _STAND_INS[id(getattr(_real_gl, _name))] = lambda: None


def _python_body(fn_obj, overrides, done):
    """The kernel's (or helper's) Python function with its globals pointing at the stand-ins."""
    fn = fn_obj.fn if isinstance(fn_obj, (JITFunction, ConstexprFunction)) else fn_obj
    if id(fn) in done:
        return done[id(fn)]
    g = dict(fn.__globals__)
    body = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    done[id(fn)] = body
    for name in fn.__code__.co_names:
        if name in overrides:
            g[name] = overrides[name]
        elif name in g:
            v = g[name]
            if id(v) in _STAND_INS:
                g[name] = _STAND_INS[id(v)]
            elif isinstance(v, (JITFunction, ConstexprFunction)):
                g[name] = _python_body(v, overrides, done)
    return body


class _Emulated:
    def __init__(self, kernel, tma_loads, overrides):
        if tma_loads not in TMA_MODES:
            raise ValueError(f"tma_loads {tma_loads!r} not in {TMA_MODES}")
        self.kernel, self.tma_loads = kernel, tma_loads
        self.body = _python_body(kernel, overrides or {}, {})
        self.signature = inspect.signature(self.body)
        self.launches = 0

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        global _current
        kwargs = {k: v for k, v in kwargs.items() if k in self.signature.parameters}  # launch options go
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for name, v in bound.arguments.items():
            if "constexpr" in str(self.signature.parameters[name].annotation):
                continue
            if isinstance(v, torch.Tensor):
                bound.arguments[name] = Pointer(_flat(v), 0, name)
            elif type(v).__name__ == "TensorDescriptor":
                bound.arguments[name] = Descriptor(v)
            elif isinstance(v, bool):
                bound.arguments[name] = torch.tensor(v)
            elif isinstance(v, int):  # as Triton passes them: int32, int64 when it does not fit
                bound.arguments[name] = torch.tensor(v, dtype=torch.int32 if -2**31 <= v < 2**31 else torch.int64)
            elif isinstance(v, float):  # fp32
                bound.arguments[name] = torch.tensor(v, dtype=torch.float32)
        if callable(grid):
            grid = grid(dict(bound.arguments))
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        where = self.kernel.fn.__name__
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    _current = _Program((x, y, z), grid, self.tma_loads, where)
                    try:
                        self.body(*bound.args, **bound.kwargs)
                        if _current.mmas:
                            _fail(f"{len(_current.mmas)} asynchronous product(s) never retired")
                        _store_wait(0)
                        if any(b.loads for b in _current.barriers.values()):
                            _fail("TMA loads issued and never waited for")
                    finally:
                        _current = None
        self.launches += 1


def emulate(kernel, tma_loads: str = "at-issue", overrides: dict | None = None):
    """A stand-in for a @gluon.jit kernel, launched as the kernel is (`kernel[grid](...)`), that runs its body
    on the CPU. overrides: replacements for names in the kernel's globals (e.g. a helper built on inline PTX)."""
    return _Emulated(kernel, tma_loads, overrides)
