"""Gluon operations under one name whichever triton runs them; the Gluon kernels call these names.

- `tma_load`, `tma_store`: triton 3.6 (the device's image) has only `tma.async_copy_global_to_shared` and
  `tma.async_copy_shared_to_global`; 3.9 removed those for `tma.async_load` and `tma.async_store`; 3.8 (CI's) has both.
- `cta_barrier`: a barrier of the CTA's threads, `gl.thread_barrier` up to 3.6, `gl.barrier` from 3.8 on.

Importing this module fails where triton has no Gluon; its importers then fall back to their Triton kernels.
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# same arguments under both names: (descriptor, coordinates, barrier, destination) and (descriptor, coordinates, source)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
