"""What the Hopper Gluon kernels import whose name moved between triton releases (3.6 on, the oldest with Gluon's
Hopper API that the kernels need)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from triton.experimental.gluon.language.nvidia.hopper.tma import async_load as tma_load
except ImportError:  # triton 3.6 names it async_copy_global_to_shared (removed later)
    from triton.experimental.gluon.language.nvidia.hopper.tma import async_copy_global_to_shared as tma_load

try:
    barrier = gl.barrier
except AttributeError:  # triton 3.6 names it thread_barrier
    barrier = gl.thread_barrier

if hasattr(gl.shared_memory_descriptor, "reinterpret"):
    @gluon.jit
    def reinterpret(memory, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """``memory`` (shared) seen as ``shape`` of ``dtype`` in ``layout``."""
        return memory.reinterpret(dtype, shape, layout)
else:  # triton 3.6 names it _reinterpret
    @gluon.jit
    def reinterpret(memory, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """``memory`` (shared) seen as ``shape`` of ``dtype`` in ``layout``."""
        return memory._reinterpret(dtype, shape, layout)

__all__ = ["barrier", "reinterpret", "tma_load"]
