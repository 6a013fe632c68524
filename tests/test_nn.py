"""blockattn.nn.BlockSelfAttention against a composition of nn.Linear, the rotary and the float64 reference."""

import math

import numpy as np
import pytest
import torch
from conftest import make_offsets, odd_lengths, requires_gpu
from torch import nn

import blockattn
from blockattn.nn import BlockSelfAttention, positions_in_sequence, rotary_sinu_pos, sequence_ids
from blockattn.reference import block_attention_reference, rotary_reference, snr_db


class Composition(nn.Module):
    """What BlockSelfAttention's state dict loads into: two plain Linears."""

    def __init__(self, d_model, num_heads, num_kv_heads, head_dim, bias=True):
        super().__init__()
        self.qkv = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
        self.out = nn.Linear(num_heads * head_dim, d_model, bias=bias)


def python_positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(0, dtype=torch.int64)])


def angles(lengths, head_dim, base, dtype=torch.float64) -> torch.Tensor:
    """``[sin | cos]`` of ``pos * base ** (-2i / D)``, positions counted in Python."""
    pos = python_positions(lengths).to(dtype)
    theta = pos[:, None] * base ** (-2 * torch.arange(head_dim // 2, dtype=dtype) / head_dim)
    return torch.cat([theta.sin(), theta.cos()], dim=1)


def composed(layer: BlockSelfAttention, x, offsets, sinu_pos, rotate_fn, attention_fn):
    """qkv Linear, split into heads, rotary on the operands the layer names, attention, out Linear."""
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    qkv = layer.qkv(x)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    heads = {"q": q.unflatten(1, (hq, d)), "k": k.unflatten(1, (hkv, d)), "v": v.unflatten(1, (hkv, d))}
    if layer.rotary:
        heads = {name: rotate_fn(t, sinu_pos) if name in layer.rotate else t for name, t in heads.items()}
    return layer.out(attention_fn(heads["q"], heads["k"], heads["v"]).flatten(1))


def float64_reference(layer, x, offsets, lengths):
    """The layer's output computed in float64 from its weights by the reference functions."""
    ref = BlockSelfAttention(layer.d_model, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.block_size,
                             layer.rotary, layer.rotate, layer.rotary_base, bias=layer.qkv.bias is not None,
                             dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    sinu_pos = angles(lengths, layer.head_dim, layer.rotary_base)
    x = x.detach().double().requires_grad_()
    out = composed(ref, x, offsets, sinu_pos, rotary_reference,
                   lambda q, k, v: block_attention_reference(q, k, v, offsets, block_size=layer.block_size))
    return ref, x, out


def grads_of(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize(
    "options",
    [
        {"num_heads": 2, "head_dim": 16, "block_size": 16},
        {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": 32, "rotate": ("q", "k", "v")},
        {"num_heads": 2, "num_kv_heads": 1, "head_dim": 24, "block_size": 16, "bias": False, "rotary_base": 500.0},
        {"num_heads": 2, "block_size": 16, "rotary": False},  # head_dim = d_model // num_heads = 16
    ],
    ids=["rope", "gqa-rotate-qkv", "mqa-nobias-base", "norotary"],
)
def test_matches_float64_reference(options):
    """Forward and backward (x, both Linears' weights and biases) against the float64 reference of the same
    composition, with length-0 sequences, partial blocks and sequences of several blocks."""
    d_model = 32
    layer = BlockSelfAttention(d_model, **options)
    lengths = odd_lengths(layer.block_size)[:5] + [3 * layer.block_size + 2]
    offsets = make_offsets(lengths)
    x = torch.randn(sum(lengths), d_model, requires_grad=True)
    out = layer(x, offsets)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, x64, ref_out = float64_reference(layer, x, offsets, lengths)
    ref_out.backward(dout.double())
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-4)
    for got, want in zip(grads_of(layer, x), grads_of(ref, x64)):
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)


def test_matches_linear_apply_rotary_block_attention():
    """The same as nn.Linear + blockattn.apply_rotary + blockattn.block_attention, with angles from Python
    positions: the fused path and the layer's on-device angles change nothing but rounding."""
    layer = BlockSelfAttention(48, 3, head_dim=16, block_size=16, rotate=("q", "k", "v"))
    lengths = [40, 0, 7, 16, 33]
    offsets = make_offsets(lengths, dtype=torch.int64)
    x = torch.randn(sum(lengths), 48)
    sinu_pos = angles(lengths, 16, layer.rotary_base, torch.float32)
    want = composed(layer, x, offsets, sinu_pos, blockattn.apply_rotary,
                    lambda q, k, v: blockattn.block_attention(q, k, v, offsets, block_size=16))
    torch.testing.assert_close(layer(x, offsets), want, atol=2e-5, rtol=1e-4)


def test_rotary_angles():
    """Positions restart at every sequence (length-0 ones included); angles p * base ** (-2i / D) of pair i."""
    lengths = [3, 0, 0, 70, 1, 0]
    offsets = make_offsets(lengths)
    n = sum(lengths)
    assert torch.equal(positions_in_sequence(offsets, n), python_positions(lengths))
    assert torch.equal(sequence_ids(offsets, n), torch.tensor([0] * 3 + [3] * 70 + [4]))
    sinu_pos = rotary_sinu_pos(offsets, n, 32, 10000.0)
    assert sinu_pos.dtype == torch.float32 and sinu_pos.shape == (n, 32)
    torch.testing.assert_close(sinu_pos.double(), angles(lengths, 32, 10000.0), atol=2e-5, rtol=0)
    assert rotary_sinu_pos(make_offsets([]), 0, 16).shape == (0, 16)


def test_state_dict_round_trip():
    """The state dict is that of two nn.Linears, both ways."""
    layer = BlockSelfAttention(32, 4, num_kv_heads=2, head_dim=16, block_size=16)
    plain = Composition(32, 4, 2, 16)
    assert set(layer.state_dict()) == set(plain.state_dict()) == {"qkv.weight", "qkv.bias", "out.weight", "out.bias"}
    plain.load_state_dict(layer.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(value, layer.state_dict()[key])
    other = BlockSelfAttention(32, 4, num_kv_heads=2, head_dim=16, block_size=16)
    plain = Composition(32, 4, 2, 16)
    other.load_state_dict(plain.state_dict())
    offsets = make_offsets([20, 5])
    x = torch.randn(25, 32)
    sinu_pos = angles([20, 5], 16, 10000.0, torch.float32)
    want = composed(other, x, offsets, sinu_pos, blockattn.apply_rotary,
                    lambda q, k, v: blockattn.block_attention(q, k, v, offsets, block_size=16))
    torch.testing.assert_close(other(x, offsets), want, atol=2e-5, rtol=1e-4)
    nobias = BlockSelfAttention(32, 2, bias=False)
    assert set(nobias.state_dict()) == {"qkv.weight", "out.weight"}


def test_nested_tensor_input():
    """A jagged nested tensor in, a nested tensor of the same structure out, gradients through it."""
    layer = BlockSelfAttention(32, 2, block_size=16)
    lengths = [5, 0, 40, 17]
    offsets = make_offsets(lengths, dtype=torch.int64)
    values = torch.randn(sum(lengths), 32, requires_grad=True)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets)
    out = layer(nested)
    assert out.is_nested and out.layout == torch.jagged and out.shape[0] == 4 and out.shape[-1] == 32
    assert torch.equal(out.offsets(), offsets)
    packed = values.detach().clone().requires_grad_()
    want = layer(packed, offsets)
    torch.testing.assert_close(out.values(), want)
    dout = torch.randn_like(want)
    out.values().backward(dout)
    want.backward(dout)
    torch.testing.assert_close(values.grad, packed.grad)
    with pytest.raises(ValueError, match="offsets must be None"):
        layer(nested, offsets)


def test_compile_fullgraph_cpu():
    """torch.compile(fullgraph=True): no graph break, the eager result and gradients."""
    layer = BlockSelfAttention(32, 2, num_kv_heads=1, block_size=16)
    offsets = make_offsets([9, 0, 40])
    x = torch.randn(49, 32)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    leaves = [x.clone().requires_grad_() for _ in range(2)]
    outs = [compiled(leaves[0], offsets), layer(leaves[1], offsets)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    grads = []
    for leaf, out in zip(leaves, outs):
        layer.zero_grad()
        out.square().sum().backward()
        grads.append([leaf.grad] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_autocast_cpu_bfloat16():
    """Under autocast the projection and attention run in the autocast dtype; fp32 parameters get fp32 grads."""
    layer = BlockSelfAttention(32, 2, block_size=16)
    offsets = make_offsets([30, 3])
    x = torch.randn(33, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, offsets)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert layer.qkv.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert snr_db(out.float(), layer(x, offsets).detach()) > 30


def test_factory_kwargs_reset_parameters_and_repr():
    layer = BlockSelfAttention(64, 4, num_kv_heads=2, head_dim=32, block_size=128, device="meta")
    assert all(p.is_meta for p in layer.parameters())
    assert layer.qkv.weight.shape == ((4 + 2 * 2) * 32, 64) and layer.out.weight.shape == (64, 4 * 32)
    offsets = torch.tensor([0, 40, 100], device="meta")
    for rotary in (True, False):  # shape inference on meta tensors, the forward included
        meta = BlockSelfAttention(64, 4, num_kv_heads=2, head_dim=32, rotary=rotary, device="meta")
        out = meta(torch.randn(100, 64, device="meta"), offsets)
        assert out.is_meta and out.shape == (100, 64)
    layer.to_empty(device="cpu")  # the meta-device initialisation FSDP uses
    layer.reset_parameters()
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in layer.parameters())
    double = BlockSelfAttention(32, 2, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in double.parameters())
    assert double(torch.randn(20, 32, dtype=torch.float64), make_offsets([20])).dtype == torch.float64
    text = repr(layer)
    for part in ("d_model=64", "num_heads=4", "num_kv_heads=2", "head_dim=32", "block_size=128",
                 "rotate=('q', 'k')", "rotary_base=10000.0"):
        assert part in text
    assert "rotary=False" in repr(BlockSelfAttention(32, 2, rotary=False))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"d_model": 30, "num_heads": 4}, ValueError, "d_model must be divisible by num_heads"),
        ({"d_model": 0, "num_heads": 4}, ValueError, "d_model must be a positive int"),
        ({"d_model": 64, "num_heads": 0}, ValueError, "num_heads must be a positive int"),
        ({"d_model": 64, "num_heads": 4, "num_kv_heads": 3}, ValueError,
         "num_heads must be a multiple of num_kv_heads"),
        ({"d_model": 64, "num_heads": 4, "head_dim": 12}, ValueError, "head_dim must be a multiple of 8"),
        ({"d_model": 64, "num_heads": 8}, ValueError, "head_dim must be a multiple of 8 in \\[16, 256\\], got 8"),
        ({"d_model": 64, "num_heads": 1, "head_dim": 264}, ValueError, "head_dim must be a multiple of 8"),
        ({"d_model": 64, "num_heads": 4, "block_size": 48}, ValueError, "block_size must be one of"),
        ({"d_model": 64, "num_heads": 4, "rotate": ("q", "x")}, ValueError, "rotate"),
        ({"d_model": 64, "num_heads": 4, "rotate": "qk"}, TypeError, "rotate"),
        ({"d_model": 64, "num_heads": 4, "rotary_base": 0.0}, ValueError, "rotary_base"),
        ({"d_model": 64, "num_heads": 4, "rotary_base": math.inf}, ValueError, "rotary_base"),
        ({"d_model": 64, "num_heads": 4, "causal": 1}, TypeError, "causal must be a bool"),
        ({"d_model": 64, "num_heads": 4, "rotary": 0}, TypeError, "rotary must be a bool"),
        ({"d_model": 64, "num_heads": 4, "causal": np.bool_(True)}, TypeError,
         "causal must be a bool \\(True or False\\), got .*True.* of type numpy.bool"),
        ({"d_model": 64, "num_heads": 4, "dropout": 1.5}, ValueError, "dropout must be a float in \\[0, 1\\)"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        BlockSelfAttention(**kwargs)


def test_forward_validation():
    layer = BlockSelfAttention(32, 2)
    offsets = make_offsets([4])
    with pytest.raises(TypeError, match="offsets is required"):
        layer(torch.randn(4, 32))
    with pytest.raises(ValueError, match="x must be \\[N, d_model=32\\]"):
        layer(torch.randn(4, 16), offsets)
    with pytest.raises(ValueError, match="x must be 2-D"):
        layer(torch.randn(1, 4, 32), offsets)
    with pytest.raises(TypeError, match="x must have the dtype of the layer's parameters"):
        layer(torch.randn(4, 32, dtype=torch.float16), offsets)
    with pytest.raises(ValueError, match="offsets"):
        layer(torch.randn(4, 32), make_offsets([3]))
    with pytest.raises(ValueError, match="offsets describes no sequence \\(B = 0\\) but x's N = 4"):
        layer(torch.randn(4, 32), make_offsets([]))
    # Checked before the rotary angles are computed from them.
    for bad, error, match in ((torch.tensor(4), ValueError, "offsets must be 1-D"),
                              (torch.tensor([], dtype=torch.int32), ValueError, "offsets must be 1-D"),
                              (make_offsets([4])[None], ValueError, "offsets must be 1-D"),
                              (make_offsets([4]).float(), TypeError, "offsets must be int32 or int64"),
                              (make_offsets([4]).to("meta"), ValueError, "offsets must be on the device of x")):
        with pytest.raises(error, match=match):
            layer(torch.randn(4, 32), bad)


# --- GPU ----------------------------------------------------------------------------------------------------------


def gpu_case(dtype=torch.float32):
    layer = BlockSelfAttention(256, 2, head_dim=128, block_size=64).cuda()
    lengths = torch.randint(0, 300, (6,)).tolist() + [0, 1, 64, 65]
    offsets = make_offsets(lengths, "cuda")
    x = torch.randn(sum(lengths), 256, device="cuda", dtype=dtype, requires_grad=True)
    return layer, lengths, offsets, x


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gpu_matches_float64_reference(autocast):
    """Forward and backward on the GPU kernels (bf16 under autocast) against the float64 reference."""
    layer, lengths, offsets, x = gpu_case()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x, offsets)
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    dout = torch.randn(out.shape, device="cuda")
    out.float().backward(dout)
    ref, x64, ref_out = float64_reference(layer, x.detach().cpu(), offsets.cpu(), lengths)
    ref_out.backward(dout.double().cpu())
    floor = 30 if autocast else 60  # dB
    assert snr_db(out.float().cpu(), ref_out) > floor
    for got, want in zip(grads_of(layer, x), grads_of(ref, x64)):
        assert snr_db(got.float().cpu(), want) > floor


@requires_gpu
@pytest.mark.gpu
def test_gpu_no_host_sync_and_compile():
    """Forward + backward never synchronise the host (angles, block table, kernels); compiles without a graph
    break to the eager result."""
    layer, _, offsets, x = gpu_case()
    layer(x, offsets).sum().backward()  # compile and cache the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x, offsets)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    compiled = torch.compile(layer, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x, offsets), layer(x, offsets), atol=2e-2, rtol=2e-2)


@requires_gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_training_step():
    """A CUDA graph of forward + backward + a capturable AdamW step of a small model around the layer, replayed on
    new data, follows eager training of a copy step for step."""
    torch.manual_seed(0)

    def make():
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(64, 128), BlockSelfAttention(128, 2, head_dim=64), nn.Linear(128, 1)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    lengths = [200, 0, 65, 300, 1]
    offsets = make_offsets(lengths, "cuda")
    n = sum(lengths)
    batches = [(torch.randn(n, 64, device="cuda"), torch.randn(n, 1, device="cuda")) for _ in range(6)]

    def step(model, optimizer, x, y):
        optimizer.zero_grad(set_to_none=True)
        h = model[0](x)
        loss = (model[2](model[1](h, offsets)) - y).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    graphed, graphed_opt = make()
    eager, eager_opt = make()
    static_x, static_y = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: kernels compile, AdamW creates its state
        for x, y in batches[:3]:
            step(graphed, graphed_opt, x, y)
    torch.cuda.current_stream().wait_stream(side)
    for x, y in batches[:3]:
        step(eager, eager_opt, x, y)
    graph = torch.cuda.CUDAGraph()
    graphed_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(graphed, graphed_opt, static_x, static_y)
    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        want = step(eager, eager_opt, x, y)
        torch.testing.assert_close(static_loss, want, atol=1e-5, rtol=1e-4)
    for a, b in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_layer_causal_and_dropout_in_training_only():
    """``causal`` is the op's in-block mask; ``dropout`` applies in training mode and not in eval mode, where the
    layer equals one built without it."""
    torch.manual_seed(0)
    layer = BlockSelfAttention(32, 2, block_size=16, causal=True, dropout=0.3)
    plain = BlockSelfAttention(32, 2, block_size=16, causal=True)
    plain.load_state_dict(layer.state_dict())
    x, offsets = torch.randn(40, 32), torch.tensor([0, 25, 40])
    layer.eval()
    assert torch.equal(layer(x, offsets), plain(x, offsets))
    layer.train()
    assert not torch.allclose(layer(x, offsets), plain(x, offsets))
    layer.eval()
    changed = x.clone()
    changed[1:] = torch.randn(39, 32)  # causal: the first token sees only itself
    assert torch.allclose(layer(changed, offsets)[0], layer(x, offsets)[0])
