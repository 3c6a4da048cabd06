"""The Gluon builtins the FP8 block kernels call whose names changed between Triton releases, resolved
once from the running Triton, so that the kernels build on Triton 3.6 (the version torch 2.11 pins) and
on later releases (:func:`resolve`):

- a barrier of the calling partition's warps: ``gl.thread_barrier`` (3.6), ``gl.barrier`` (3.7 on);
- the TMA copies: ``tma.async_copy_global_to_shared`` / ``async_copy_shared_to_global`` (3.6-3.8),
  ``tma.async_load`` / ``async_store`` (3.9, where the old names raise). Same arguments.

Checked: sm_90a builds of the warp-specialised kernels under Triton 3.6, 3.7 and 3.9 (offline), and the
Gluon GPU tests on an H100 under 3.9 (run 29).
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma


def resolve(language, tma_module):
    """(partition barrier, TMA load, TMA store) of the Gluon modules given: the newer name where the
    module has it, else the Triton 3.6 one."""
    barrier = getattr(language, "barrier", None) or language.thread_barrier
    load = getattr(tma_module, "async_load", None) or tma_module.async_copy_global_to_shared
    store = getattr(tma_module, "async_store", None) or tma_module.async_copy_shared_to_global
    return barrier, load, store


thread_barrier, tma_load, tma_store = resolve(gl, tma)
