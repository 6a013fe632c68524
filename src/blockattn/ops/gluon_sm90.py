"""What the Hopper Gluon kernels share: the register layouts they all use, and what they import whose name moved
between triton releases (3.6 on, the oldest with Gluon's Hopper API that the kernels need)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .tiles import OFFSETS_CHUNK

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


@gluon.constexpr_function
def mma_layout(rows, cols, warps, operand_dtype):
    """The wgmma accumulator layout of a ``[rows, cols]`` tile over ``warps`` warps, for products of
    ``operand_dtype`` operands (an instruction reduces 32 bytes: 16 deep at 16 bits, 32 at fp8): warps down the rows,
    16 each, and where a warpgroup has more rows than it needs (8 warps on 64 rows), the warpgroups side by side
    along the columns, so that each holds half the accumulator."""
    row_warps = min(warps, rows // 16)
    col_warps = warps // row_warps
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[row_warps, col_warps],
                                     instr_shape=[16, cols // col_warps, 256 // operand_dtype.primitive_bitwidth])


@gluon.constexpr_function
def rows_layout(width, warps):
    """``[rows, width]`` tiles with 8 consecutive elements a thread (one 16-byte access at 16 bits, two at fp32),
    the rest of a warp and the ``warps`` warps over the rows: where the kernels store whole rows, and where the
    rotary turns a tile."""
    return gl.BlockedLayout([1, 8], [32 * 8 // width, width // 8], [warps, 1], [1, 0])


@gluon.jit
def offsets_chunk():
    """``arange(tiles.OFFSETS_CHUNK)`` in a layout: what a Gluon kernel passes ``tiles.tile_bounds`` as ``seqs``
    (its search of the offsets, where it runs without a block table, reads them in vectors, which need one)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.arange(0, OFFSETS_CHUNK, layout=layout)


__all__ = ["barrier", "mma_layout", "offsets_chunk", "reinterpret", "rows_layout", "tma_load"]
