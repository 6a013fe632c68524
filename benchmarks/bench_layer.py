"""Time ``blockattn.nn.BlockSelfAttention`` forward + backward on a GPU against the sum of its parts and against the
same layer built from ``nn.Linear`` + a PyTorch rotary + FlashAttention-2 varlen.

    python benchmarks/bench_layer.py --out bench-out/layer.json                 # the `ads` preset, bf16
    python benchmarks/bench_layer.py --preset ads-rotary --out bench-out/layer-ads-rotary.json

Every row is one forward + backward to the gradients of the input and of every weight and bias
(``torch.autograd.grad``), timed by ``triton.testing.do_bench`` (median). Rows:

- ``layer``: the module with bf16 parameters; ``layer (fp32 params, autocast)``: fp32 parameters under bf16
  autocast (how the example trains: the casts of the weights count).
- the parts, each alone: the angles (``rotary_sinu_pos``), the qkv projection GEMM ``x @ w_qkv + b``,
  ``block_attention`` with the fused rotary on separate ``q, k, v``, and the output projection GEMM. Their sum is
  what the layer would cost if it were nothing but its parts; the layer reads q, k, v out of the packed projection
  and writes dqkv into one buffer, so it may come under it.
- ``Linear + torch rotary + FA2 varlen``: the unfused layer a user would otherwise write: ``nn.Linear``, q and k
  turned by the interleaved-pair rotary in PyTorch ops, ``torch.ops.aten._flash_attention_forward`` (autograd runs
  its backward) with one ``cu_seqlens`` boundary per block, which is exactly block-diagonal, and ``nn.Linear``.
  Its output is checked against the layer's (same weights) before it is timed.

Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch
import triton
import triton.testing
from torch import nn

import blockattn
from blockattn.bench.presets import PRESETS
from blockattn.block_table import block_rows, build_block_table
from blockattn.nn import BlockSelfAttention, rotary_sinu_pos
from blockattn.reference import rotary_reference, snr_db


def block_boundaries(offsets: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """``cu_seqlens`` with one boundary per block (int32 ``[num_blocks + 1]``): every block its own sequence."""
    table = build_block_table(offsets, num_tokens, block_size)
    _rows, valid = block_rows(offsets, table, block_size)
    lengths = valid[valid[:, 0]].sum(1, dtype=torch.int32)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])


class UnfusedLayer(nn.Module):
    """``nn.Linear`` -> split heads -> PyTorch rotary on q, k -> FlashAttention-2 varlen per block -> ``nn.Linear``;
    it holds the layer's own ``qkv`` and ``out`` (the same weights)."""

    def __init__(self, layer: BlockSelfAttention, cu_blocks: torch.Tensor):
        super().__init__()
        self.qkv, self.out = layer.qkv, layer.out  # the same weights
        self.layer, self.cu_blocks = layer, cu_blocks

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        layer, bs = self.layer, self.layer.block_size
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        sinu_pos = rotary_sinu_pos(offsets, x.shape[0], d, layer.rotary_base)
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=1)
        q, k, v = q.unflatten(1, (hq, d)), k.unflatten(1, (hkv, d)), v.unflatten(1, (hkv, d))
        # The plain PyTorch rotary in the inputs' dtype (blockattn.bench's "torch rotary").
        q, k = (rotary_reference(t, sinu_pos, compute_dtype=t.dtype) for t in (q, k))
        out = torch.ops.aten._flash_attention_forward(q, k, v, self.cu_blocks, self.cu_blocks, bs, bs, 0.0, False,
                                                      False, scale=1 / math.sqrt(d))[0]
        return self.out(out.flatten(1))


def fwd_bwd(forward, inputs, grad_out):
    """A closure: ``forward()`` then the gradients of ``inputs`` for ``grad_out``."""

    def run():
        return torch.autograd.grad(forward(), inputs, grad_out)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ads", choices=sorted(PRESETS))
    parser.add_argument("--d-model", type=int, default=None, help="default: heads * head_dim of the preset")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetitions, ms")
    parser.add_argument("--seed", type=int, default=0, help="lengths of the preset's batch")
    parser.add_argument("--out", type=Path, default=Path("bench-out/layer.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer needs a CUDA GPU")
    if not torch.backends.cuda.is_flash_attention_available():
        raise SystemExit("this torch build has no FlashAttention (aten): the baseline cannot run")

    w = PRESETS[args.preset]
    dtype = w.torch_dtype
    d_model = args.d_model or w.heads * w.head_dim
    torch.manual_seed(0)
    offsets = w.offsets(args.seed, "cuda")
    n = int(offsets[-1])
    layer_fp32 = BlockSelfAttention(d_model, w.heads, w.kv_heads, w.head_dim, block_size=w.block_size,
                                    device="cuda")
    layer = BlockSelfAttention(d_model, w.heads, w.kv_heads, w.head_dim, block_size=w.block_size, device="cuda",
                               dtype=dtype)
    layer.load_state_dict(layer_fp32.state_dict())
    hq, hkv, d = w.heads, w.kv_heads, w.head_dim
    x = torch.randn(n, d_model, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(n, d_model, device="cuda", dtype=dtype)
    params = list(layer.parameters())

    # The parts, each with its own inputs of the layer's shapes.
    sinu_pos = rotary_sinu_pos(offsets, n, d, layer.rotary_base)
    w_qkv = layer.qkv.weight.detach().t().contiguous().requires_grad_()  # [d_model, (Hq + 2 Hkv) D]
    b_qkv = layer.qkv.bias.detach().clone().requires_grad_()
    d_qkv = torch.randn(n, w_qkv.shape[1], device="cuda", dtype=dtype)
    q = torch.randn(n, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(n, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(n, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    d_attn = torch.randn(n, hq, d, device="cuda", dtype=dtype)
    attn_in = torch.randn(n, hq * d, device="cuda", dtype=dtype, requires_grad=True)
    w_out = layer.out.weight.detach().t().contiguous().requires_grad_()
    b_out = layer.out.bias.detach().clone().requires_grad_()

    unfused = UnfusedLayer(layer, block_boundaries(offsets, n, w.block_size))
    with torch.no_grad():
        want, got = layer(x, offsets).float(), unfused(x, offsets).float()
    agreement = snr_db(got, want)
    if agreement < 30:
        raise SystemExit(f"the unfused baseline disagrees with the layer: SNR {agreement:.1f} dB")

    parts = {
        "angles (rotary_sinu_pos)": lambda: rotary_sinu_pos(offsets, n, d, layer.rotary_base),
        "qkv GEMM x @ w + b": fwd_bwd(lambda: torch.addmm(b_qkv, x, w_qkv), [x, w_qkv, b_qkv], d_qkv),
        "block_attention + fused rotary": fwd_bwd(
            lambda: blockattn.block_attention(q, k, v, offsets, block_size=w.block_size, sinu_pos=sinu_pos,
                                              rotate=layer.rotate), [q, k, v], d_attn),
        "out GEMM a @ w + b": fwd_bwd(lambda: torch.addmm(b_out, attn_in, w_out), [attn_in, w_out, b_out], dout),
    }
    rows = {
        "layer": fwd_bwd(lambda: layer(x, offsets), [x, *params], dout),
        "layer (fp32 params, autocast)": fwd_bwd(_autocast(lambda: layer_fp32(x, offsets)),
                                                 [x, *layer_fp32.parameters()], dout),
        **parts,
        "Linear + torch rotary + FA2 varlen": fwd_bwd(lambda: unfused(x, offsets), [x, *params], dout),
    }
    times = {}
    for name, fn in rows.items():
        times[name] = float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))
        torch.cuda.empty_cache()
    sum_of_parts = sum(times[name] for name in parts)
    layer_ms = times["layer"]
    baseline_ms = times["Linear + torch rotary + FA2 varlen"]

    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, {args.preset}: N={n} tokens, {w.num_seqs} sequences, d_model={d_model}, Hq={hq}, Hkv={hkv}, "
          f"D={d}, block {w.block_size}, {w.dtype}; forward + backward, median of do_bench")
    print(f"{'':38s} {'ms':>9s} {'/ layer':>8s}")
    for name, ms in times.items():
        print(f"{name:38s} {ms:9.3f} {ms / layer_ms:8.2f}")
    print(f"{'sum of the parts':38s} {sum_of_parts:9.3f} {sum_of_parts / layer_ms:8.2f}")
    print(f"layer vs the sum of its parts: {layer_ms / sum_of_parts:.3f}x the time; "
          f"vs Linear + torch rotary + FA2 varlen: {baseline_ms / layer_ms:.2f}x faster "
          f"(outputs agree to {agreement:.1f} dB SNR)")

    result = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "preset": w.to_dict(), "d_model": d_model, "num_tokens": n, "lengths_seed": args.seed,
        "do_bench": {"warmup_ms": args.warmup, "rep_ms": args.rep, "return_mode": "median"},
        "fwd_bwd_ms": times, "sum_of_parts_ms": sum_of_parts,
        "layer_over_sum_of_parts": layer_ms / sum_of_parts, "speedup_vs_unfused_fa2": baseline_ms / layer_ms,
        "unfused_agreement_snr_db": agreement,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def _autocast(forward):
    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return forward()

    return run


if __name__ == "__main__":
    main()
