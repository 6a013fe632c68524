"""Correctness of every configuration that ``bench --sweep`` times (block size x head dim x GQA ratio x dtype x
rotary), on small jagged batches: 16-bit forward and backward within 2x PyTorch's own error of the float64
reference, fp8 forward by its SNR bound against the reference on the dequantised inputs. On a GPU all of them,
through the public op as the sweep calls it (the dispatcher's choice of kernel); on the CPU, in Triton's
interpreter (whose bf16 products are wrong), the fp16 and fp8 ones at the smaller sizes."""

import pytest
import torch
from conftest import (
    HAS_GPU,
    KERNEL_DEVICE,
    assert_within_2x_pytorch,
    odd_lengths,
    random_angles,
    random_inputs,
    run_kernels,
)

import blockattn
from blockattn.bench import sweep
from blockattn.block_table import build_block_table
from blockattn.ops import block_attention as triton_ops
from blockattn.ops import fp8
from blockattn.ops.in_block import PLAIN
from blockattn.ops.tiles import ROTATE_ALL
from blockattn.reference import block_attention_reference, quantised_fp8, rotary_reference, snr_db

CONFIGS = (sweep.grid() if HAS_GPU else
           sweep.grid(block_sizes=(16, 32), head_dims=(32,), dtypes=("float16", sweep.FP8)))
# fp8 inputs, bf16 output: the output's own rounding dominates (tests/test_fp8.py).
FP8_MIN_SNR_DB = 45.0


def _angles(config: sweep.Config, num_tokens: int) -> torch.Tensor | None:
    """The sweep's angles: none, float32, or in the inputs' dtype (bf16 for fp8, quantised from bf16)."""
    if config.angle_dtype is None:
        return None
    return random_angles(num_tokens, config.head_dim, config.angle_dtype, KERNEL_DEVICE)


def _sixteen_bit(config: sweep.Config, lengths: list[int]) -> None:
    dtype = getattr(torch, config.dtype)
    q, k, v, do, offsets = random_inputs(lengths, sweep.NUM_HEADS, config.kv_heads, config.head_dim, dtype,
                                         KERNEL_DEVICE)
    sinu_pos = _angles(config, q.shape[0])
    if HAS_GPU:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*leaves, offsets, block_size=config.block_size, sinu_pos=sinu_pos)
        results = [out, *torch.autograd.grad(out, leaves, do)]
    else:
        results = run_kernels(q, k, v, do, offsets, config.block_size, sinu_pos, ROTATE_ALL)
    assert_within_2x_pytorch(results, q, k, v, do, offsets, config.block_size, sinu_pos=sinu_pos,
                             rotate=ROTATE_ALL if sinu_pos is not None else 0)


def _fp8(config: sweep.Config, lengths: list[int]) -> None:
    q, k, v, _, offsets = random_inputs(lengths, sweep.NUM_HEADS, config.kv_heads, config.head_dim, torch.float32,
                                        KERNEL_DEVICE)
    (q8, qs), (k8, ks), (v8, vs) = (quantised_fp8(t) for t in (q, k, v))
    sinu_pos = _angles(config, q.shape[0])
    scale = config.head_dim**-0.5
    if HAS_GPU:
        out = blockattn.block_attention(q8, k8, v8, offsets, block_size=config.block_size, sinu_pos=sinu_pos,
                                        q_descale=qs, k_descale=ks, v_descale=vs)
    else:
        table = build_block_table(offsets, q.shape[0], config.block_size)
        out = triton_ops.block_attention_fwd_triton(
            q8, k8, v8, offsets, table, config.block_size, scale, sinu_pos,
            ROTATE_ALL if sinu_pos is not None else 0, PLAIN, fp8.Fp8Scales(qs, ks, vs, torch.bfloat16))
    assert out.dtype == torch.bfloat16 and not out.float().isnan().any()
    exact = [fp8.dequantized(t, s, torch.float64) for t, s in ((q8, qs), (k8, ks), (v8, vs))]
    if sinu_pos is not None:
        exact = [rotary_reference(t, sinu_pos.double()) for t in exact]
    ref = block_attention_reference(*exact, offsets, block_size=config.block_size, scale=scale)
    assert snr_db(out.double(), ref) > FP8_MIN_SNR_DB


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_sweep_configuration(config, poisoned_outputs):
    lengths = odd_lengths(config.block_size)
    (_fp8 if config.dtype == sweep.FP8 else _sixteen_bit)(config, lengths)

