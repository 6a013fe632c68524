"""What the forward's bytes alone cost: a Triton kernel that moves exactly the bytes of the block-attention forward
(per 64-row tile and kv head, k and v loaded once; for each query head of the group, q loaded and ``o = q + k + v``
stored; optionally the fp32 angles ``[N, D]`` read once a kv head) on the sweep's workloads (``python -m blockattn bench
--sweep``: 8 query heads, sequences of 800-2000 tokens), as a multiple of the sweep's memory floor in the same
process. It bounds what an attention kernel of the same loads can reach: where it runs at the floor, the attention
kernel's excess over it is its own (its products, softmax and stores), not the access pattern's.

    python benchmarks/memory_only.py
"""

import functools

import torch
import triton
import triton.language as tl

from blockattn.bench import harness, sweep

CASES = [(128, 8, sweep.FP8, False), (128, 2, sweep.FP8, False), (128, 8, "bfloat16", False),
         (128, 2, "bfloat16", False), (64, 8, sweep.FP8, False), (128, 8, "bfloat16", True),
         (128, 2, "bfloat16", True), (32, 8, "bfloat16", False)]


@triton.jit
def _move(q_ptr, k_ptr, v_ptr, o_ptr, a_ptr, n, stride_qn, stride_kn, stride_on, ANGLES: tl.constexpr,
          KV_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = pid % KV_HEADS
    rows = (pid // KV_HEADS) * TILE + tl.arange(0, TILE)
    cols = tl.arange(0, D)
    row_ok = (rows < n)[:, None]
    rows = rows.to(tl.int64)[:, None]
    k = tl.load(k_ptr + rows * stride_kn + kv_head * D + cols[None, :], mask=row_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + rows * stride_kn + kv_head * D + cols[None, :], mask=row_ok, other=0.0).to(tl.float32)
    kv = k + v
    if ANGLES:
        kv += tl.load(a_ptr + rows * D + cols[None, :], mask=row_ok, other=0.0)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q = tl.load(q_ptr + rows * stride_qn + head * D + cols[None, :], mask=row_ok, other=0.0).to(tl.float32)
        tl.store(o_ptr + rows * stride_on + head * D + cols[None, :], (q + kv).to(o_ptr.dtype.element_ty),
                 mask=row_ok)


def main() -> None:
    tbps = harness.copy_bandwidth_tbps(10)
    print(f"copy bandwidth {tbps:.3f} TB/s")
    for head_dim, kv_heads, dtype, angles in CASES:
        w = sweep.Config(64, head_dim, kv_heads, dtype, "none").workload(sweep.QUERY_ELEMENTS)
        n = int(w.offsets(0, device="cuda")[-1])
        inputs = torch.float8_e4m3fn if dtype == sweep.FP8 else torch.bfloat16
        q, k, v = (torch.randn(n, h, head_dim, device="cuda", dtype=torch.bfloat16).to(inputs)
                   for h in (sweep.NUM_HEADS, kv_heads, kv_heads))
        o = torch.empty(n, sweep.NUM_HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
        sinu_pos = torch.randn(n, head_dim, device="cuda") if angles else None
        floor_bytes = harness.fp8_forward_floor_bytes(w, n) if dtype == sweep.FP8 else harness.floor_bytes(w, n)["fwd"]
        floor_ms = (floor_bytes + (0 if sinu_pos is None else sinu_pos.numel() * 4)) / (tbps * 1e12) * 1e3
        for warps in (4, 8):
            move = functools.partial(
                _move[(triton.cdiv(n, 64) * kv_heads,)], q, k, v, o, q if sinu_pos is None else sinu_pos, n,
                q.stride(0), k.stride(0), o.stride(0), sinu_pos is not None, kv_heads, sweep.NUM_HEADS // kv_heads,
                head_dim, 64, num_warps=warps)
            ms = harness.time_ms(harness.graphed(move), 10)["p50"]
            print(f"D {head_dim}, {sweep.NUM_HEADS}:{kv_heads}, {dtype}{' + fp32 angles' if angles else ''}, "
                  f"{warps} warps: {ms / floor_ms:.3f}x the floor ({ms:.4f} ms)", flush=True)


if __name__ == "__main__":
    main()
