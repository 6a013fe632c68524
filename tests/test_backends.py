"""The dispatcher: which backend each call goes to, for the forward and the backward alike."""

import pytest
import torch

from blockattn import backends, devices
from blockattn.backends import BACKENDS, FLASH_BACKENDS, AttentionCall, FlashCall, select
from blockattn.ops.in_block import InBlock


def call(pass_name="bwd", device="cuda", dtype=torch.bfloat16, heads=(4, 4), head_dim=128, block_size=64, rotate=0,
         in_block=0, tma_rows=True, angles_dtype=None):
    return AttentionCall(pass_name, torch.device(device), dtype, *heads, head_dim, block_size, rotate=rotate,
                         in_block=in_block, tma_rows=tma_rows, angles_dtype=angles_dtype)


@pytest.fixture
def gpu_capability(monkeypatch):
    """Pretend the GPU has a given compute capability (no GPU needed: only metadata is read)."""

    def set_capability(capability):
        monkeypatch.setattr(devices, "capability", lambda device: capability)
        monkeypatch.setattr(torch.version, "hip", None)

    return set_capability


def test_cpu_calls_take_the_pytorch_path():
    for pass_name in ("fwd", "bwd"):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            assert select(call(pass_name, "cpu", dtype)).name == "torch"
    assert not devices.kernels_run_on(torch.device("cpu"))


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9), (10, 0), (12, 0)])
def test_gpus_from_ampere_take_the_kernels(capability, gpu_capability):
    gpu_capability(capability)
    hopper = capability[0] == 9
    assert select(call("fwd")).name == "triton"
    assert select(call("bwd")).name == ("sm90-gluon" if hopper and backends.sm90_ops is not None else "triton")
    gqa = select(call("fwd", heads=(8, 2))).name
    assert gqa == ("sm90-gluon" if hopper and backends.sm90_fwd_ops is not None else "triton")
    assert devices.kernels_run_on(torch.device("cuda"))


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_gpus_before_ampere_fall_back_to_pytorch(capability, gpu_capability):
    """The kernels are never sent to a GPU they were not built for: the PyTorch path runs there."""
    gpu_capability(capability)
    for pass_name in ("fwd", "bwd"):
        assert select(call(pass_name)).name == "torch"
    assert "Ampere" in BACKENDS["triton"].takes(call())
    assert not devices.kernels_run_on(torch.device("cuda"))


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)])
def test_fp8_block_attention_needs_fp8_gpus(capability, gpu_capability):
    """float8 inputs (forward only) go to the kernels from Ada on; on an Ampere GPU they are refused with the
    reason, never sent to Triton (which lacks the type there) nor run slowly by the PyTorch path. Off the GPU, and
    on GPUs the kernels do not serve at all, the PyTorch path dequantises, as it runs everything there."""
    gpu_capability(capability)
    fp8 = call("fwd", dtype=torch.float8_e4m3fn)
    if capability >= devices.FP8_CAPABILITY:
        # On Hopper the warp-specialised forward takes D = 128 where it measured faster (2 to 4 query heads a kv
        # head, 1 at 64-token blocks) and D = 64 with 2 at 64-token blocks, the Triton forward the rest.
        hopper = "sm90-gluon" if capability[0] == 9 and backends.sm90_fwd_ops is not None else "triton"
        assert select(fp8).name == hopper
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 2))).name == hopper
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 4), block_size=16)).name == hopper
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 8), block_size=32)).name == "triton"
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 1))).name == "triton"
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 2), head_dim=64)).name == "triton"
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 4), head_dim=64)).name == hopper
        assert select(call("fwd", dtype=torch.float8_e4m3fn, heads=(8, 4), head_dim=64, block_size=32)).name == (
            "triton")
    elif capability < (8, 0):
        assert select(fp8).name == "torch"
    else:
        with pytest.raises(ValueError, match=r"float8_e4m3fn needs a GPU with fp8 tensor cores \(compute capability "
                                             rf"8.9\+\), this GPU has {capability[0]}.{capability[1]}"):
            select(fp8)
    if capability >= (8, 0):
        assert "forward only" in BACKENDS["triton"].takes(call("bwd", dtype=torch.float8_e4m3fn))
    assert select(call("fwd", "cpu", torch.float8_e4m3fn)).name == "torch"


@pytest.mark.skipif(backends.sm90_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize(
    "changes,reason",
    [({"block_size": 32, "in_block": 1}, "block sizes (64, 128), and 16 or 32 where they run 64-row tiles"),
     ({"block_size": 16, "rotate": 7}, "block sizes (64, 128), and 16 or 32 where they run 64-row tiles"),
     ({"block_size": 16, "head_dim": 16}, "D in (32, 64, 128, 256) at 16-token blocks"),
     ({"block_size": 128, "head_dim": 256}, "D in (32, 64, 128)"),
     ({"head_dim": 96}, "D in (32, 64, 128, 256)"), ({"dtype": torch.float32}, "float16 and bfloat16"),
     ({"tma_rows": False}, "rows"), ({"pass_name": "fwd"}, "the Triton forward measured faster"),
     ({"heads": (4, 2), "in_block": 6}, "biases together without GQA"),
     ({"block_size": 128, "in_block": 1}, "in-block options at 64-token blocks with D <= 128"),
     ({"head_dim": 256, "in_block": 4}, "in-block options at 64-token blocks with D <= 128")],
)
def test_hopper_backward_takes_only_its_shape(changes, reason, gpu_capability):
    gpu_capability((9, 0))
    for heads in ((4, 4), (4, 2), (8, 1)):
        for block_size, head_dim in [(64, 32), (64, 64), (64, 128), (64, 256), (128, 32), (128, 64), (128, 128),
                                     (16, 32), (16, 256), (32, 64), (32, 128)]:
            for rotate in (0, 7):
                taken = call(heads=heads, head_dim=head_dim, block_size=block_size, rotate=rotate)
                # 16- and 32-token blocks where they run 64-row tiles: all but the rotary without GQA from
                # D = 4 * block_size
                tiles = block_size >= 64 or not rotate or heads[0] != heads[1] or head_dim < 4 * block_size
                assert select(taken).name == ("sm90-gluon" if tiles else "triton")
        for options in (1, 2, 4, 8, 11, 13):  # causal, each bias, dropout, all but one bias
            assert select(call(heads=heads, head_dim=128, in_block=options)).name == "sm90-gluon"
        both_biases = call(heads=heads, head_dim=128, in_block=15)
        assert select(both_biases).name == ("sm90-gluon" if heads[0] == heads[1] else "triton")
    other = call(**changes)
    assert reason in BACKENDS["sm90-gluon"].takes(other)
    assert select(other).name == "triton"


@pytest.mark.skipif(backends.sm90_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("options,rotate,gqa,tile,head_dim,blocks,cap", [
    ({"pos_bias": True, "time_bias": True}, 0, False, 64, 128, 1, 168),  # both biases without GQA
    ({"pos_bias": True, "time_bias": True, "dropout_p": 0.1}, 0, False, 64, 128, 1, None),
    ({"pos_bias": True, "time_bias": True}, 7, False, 64, 128, 1, None),
    ({"time_bias": True}, 0, False, 64, 128, 1, None),
    ({}, 0, True, 64, 64, 1, 168), ({}, 0, True, 64, 64, 4, 168),  # GQA at D = 64, plain
    ({}, 7, True, 64, 64, 1, None),  # a rotary holds its angles in registers
    ({}, 0, True, 64, 32, 4, 128), ({}, 7, True, 64, 32, 2, 128),  # GQA at D = 32 on tiles of small blocks
    ({}, 0, True, 64, 32, 1, None), ({}, 7, True, 64, 32, 1, None), ({}, 0, False, 64, 32, 4, None),
    ({}, 0, True, 128, 64, 1, None),  # two warpgroups at 128-token blocks
    ({"causal": True}, 0, True, 64, 64, 1, None), ({"causal": True}, 0, True, 64, 32, 1, None),
    ({}, 0, True, 64, 128, 1, None), ({}, 0, False, 64, 64, 1, None)])
def test_hopper_backward_register_cap_only_where_it_measured_faster(options, rotate, gqa, tile, head_dim, blocks,
                                                                    cap):
    """The Hopper backward's register caps: 168 (three programs an SM) for both biases together without GQA, a
    rotary or dropout, and for GQA at D = 64 without options or a rotary; 128 (four) for GQA at D = 32 on tiles of
    16- or 32-token blocks. Elsewhere they measured slower or change nothing."""
    tensor = torch.zeros(4, 8)
    opts = InBlock(**{name: tensor if name.endswith("bias") else value
                       for name, value in options.items()})
    expected = {} if cap is None else {"maxnreg": cap}
    assert backends.sm90_ops._backward_register_cap(opts, rotate, gqa, tile, head_dim, blocks) == expected


def test_every_backend_says_what_it_is():
    for backend in BACKENDS.values():
        assert backend.summary and backend.passes and set(backend.passes) <= {"fwd", "bwd"}
    assert BACKENDS["torch"].passes == ("fwd", "bwd") and BACKENDS["triton"].passes == ("fwd", "bwd")


def test_call_reads_the_layout_of_its_tensors():
    q = torch.randn(10, 3, 128, dtype=torch.bfloat16)
    assert AttentionCall.of("bwd", q, q, 64, 0, tensors=(q, q, q, q), grads=(q, q, q)).tma_rows
    padded_heads = torch.randn(10, 3, 136, dtype=torch.bfloat16)[..., :128]
    odd_rows = torch.randn(10, 385, dtype=torch.bfloat16)[:, :384].view(10, 3, 128)
    for tensors, grads in (((padded_heads, q, q, q), (q, q, q)), ((odd_rows, q, q, q), (q, q, q)),
                           ((q, q, q, q), (padded_heads, q, q))):
        assert not AttentionCall.of("bwd", q, q, 64, 0, tensors=tensors, grads=grads).tma_rows
    # The rotary's angles: their dtype where TMA reads them as 16-byte aligned [N, D] rows, else None.
    angles = torch.randn(10, 128)
    assert AttentionCall.of("fwd", q, q, 64, 7, angles=angles).angles_dtype == torch.float32
    assert AttentionCall.of("fwd", q, q, 64, 7, angles=angles.bfloat16()).angles_dtype == torch.bfloat16
    for unreadable in (torch.randn(10, 256)[:, ::2], torch.randn(10, 130)[:, 2:], torch.randn(1282)[2:].view(10, 128)):
        assert AttentionCall.of("fwd", q, q, 64, 7, angles=unreadable).angles_dtype is None


def flash_call(variant="auto", dtype=torch.bfloat16, head_dim=128, tma_ready=True, rows_follow=True):
    return FlashCall("fwd", torch.device("cuda"), dtype, head_dim, variant, tma_ready, True, rows_follow)


@pytest.mark.skipif(backends.flash_sm90_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("changes,chosen", [
    ({}, "warp_specialized-sm90"), ({"variant": "warp_specialized"}, "warp_specialized-sm90"),
    ({"head_dim": 64}, "warp_specialized-sm90"), ({"head_dim": 256, "dtype": torch.float16}, "warp_specialized-sm90"),
    ({"variant": "pipelined"}, "pipelined"), ({"head_dim": 40}, "pipelined"),
    ({"dtype": torch.float8_e4m3fn}, "warp_specialized-sm90"),
    ({"dtype": torch.float8_e4m3fn, "variant": "pipelined"}, "pipelined"),
    ({"dtype": torch.float8_e4m3fn, "head_dim": 40}, "pipelined"), ({"tma_ready": False}, "pipelined"),
    # Batches whose rows do not follow each other: Triton's TMA kernel builds a descriptor per sequence.
    ({"rows_follow": False}, "warp_specialized"),
])
def test_hopper_flash_forward_takes_the_gluon_kernel(changes, chosen, gpu_capability, monkeypatch):
    monkeypatch.setattr(devices, "shared_memory_limit", lambda device: 227 * 1024)
    gpu_capability((9, 0))
    assert select(flash_call(**changes), FLASH_BACKENDS).name == chosen
    gpu_capability((10, 0))  # no wgmma on Blackwell: Triton's kernels
    assert select(flash_call(), FLASH_BACKENDS).name == "warp_specialized"
    monkeypatch.setattr(devices, "shared_memory_limit", lambda device: 40 * 1024)
    gpu_capability((9, 0))  # a GPU whose shared memory holds no 128-row tiles with two slots
    assert "shared memory" in FLASH_BACKENDS["warp_specialized-sm90"].why_not(flash_call())


@pytest.mark.skipif(backends.flash_sm90_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("dtype,head_dim,rows_without_mask", [
    (torch.float8_e4m3fn, 64, 192), (torch.float8_e4m3fn, 128, 192), (torch.float8_e4m3fn, 256, 128),
    (torch.bfloat16, 64, 192), (torch.float16, 64, 192), (torch.bfloat16, 128, 128), (torch.bfloat16, 256, 128),
])
def test_gluon_flash_forward_takes_a_third_consumer_without_a_causal_mask(dtype, head_dim, rows_without_mask,
                                                                          gpu_capability, monkeypatch):
    """192-row tiles (three consumer warpgroups) where they measured faster: no causal mask, fp8 up to D = 128
    and 16-bit at D = 64. The kernel takes what the table gives; the call carries ``causal`` to it."""
    monkeypatch.setattr(devices, "shared_memory_limit", lambda device: 227 * 1024)
    gpu_capability((9, 0))
    q = torch.empty(1, 8, 2, head_dim, dtype=dtype)
    for causal, rows in ((False, rows_without_mask), (True, 128)):
        call = FlashCall.of(q, q, q, "auto", causal=causal)
        assert call.causal is causal
        config = call.with_config("warp_specialized-sm90").config
        assert config.block_m == rows
        assert backends.flash_sm90_ops.config_reason(config) is None
    # Other kernels keep their tables with or without the mask.
    assert FlashCall.of(q, q, q, "auto", causal=False).with_config("pipelined").config.block_m == 128


def test_flash_call_reads_whether_rows_follow():
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    assert FlashCall.of(q, q, q, "auto", causal=False).rows_follow
    assert FlashCall.of(q.flatten(0, 1), q.flatten(0, 1), q.flatten(0, 1), "auto", causal=False).rows_follow
    assert not FlashCall.of(q[:, :100], q, q, "auto", causal=False).rows_follow
    assert FlashCall.of(q[:1, :100], q, q, "auto", causal=False).rows_follow  # one sequence


@pytest.mark.skipif(backends.sm90_fwd_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (6, 2), (8, 2), (8, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
def test_hopper_forward_rule(heads, head_dim, block_size, gpu_capability):
    """The warp-specialised Hopper forward takes plain 16-bit and fp8 calls where it measured faster than the Triton
    forward: in 64-row tiles D = 128 under GQA of 2 to 4 query heads a kv head and D = 64 with 2 (fp8 at D = 64
    only at 64-token blocks), and fp8 at D = 128 without GQA at 64-token blocks; at 128-token blocks every head dim
    it takes but fp8 at D = 32 without GQA; a rotary at D = 128 with 2 query heads a kv head up to 64-token blocks,
    its angles in fp32 or the inputs' dtype (at 16-token blocks fp32 only; never angles TMA cannot read: the call's
    ``angles_dtype`` is then None); never D = 256, an in-block option, fp32 or rows TMA cannot read."""
    gpu_capability((9, 0))
    group = heads[0] // heads[1]
    supported = head_dim in (32, 64, 128)
    if block_size == 128:
        faster = supported
        faster_fp8 = supported and not (head_dim == 32 and group == 1)
    else:
        faster = (head_dim == 128 and 2 <= group <= 4) or (head_dim == 64 and group == 2)
        faster_fp8 = ((head_dim == 128 and (2 <= group <= 4 or (group == 1 and block_size == 64)))
                      or (head_dim == 64 and group == 2 and block_size == 64))
    plain = call("fwd", heads=heads, head_dim=head_dim, block_size=block_size)
    assert select(plain).name == ("sm90-gluon" if faster else "triton")
    fp8_call = call("fwd", heads=heads, head_dim=head_dim, block_size=block_size, dtype=torch.float8_e4m3fn)
    assert select(fp8_call).name == ("sm90-gluon" if faster_fp8 else "triton")
    for angles in (torch.float32, torch.bfloat16):
        rotary = call("fwd", heads=heads, head_dim=head_dim, block_size=block_size, rotate=7, angles_dtype=angles)
        turns = head_dim == 128 and group == 2 and (32 <= block_size <= 64
                                                    or (block_size == 16 and angles == torch.float32))
        assert select(rotary).name == ("sm90-gluon" if turns else "triton")
    for other in ({"rotate": 7}, {"rotate": 7, "angles_dtype": torch.float16}, {"in_block": 1},
                  {"dtype": torch.float32}, {"tma_rows": False}):
        changed = call("fwd", heads=heads, head_dim=head_dim, block_size=block_size, **other)
        assert select(changed).name == "triton"


@pytest.mark.skipif(backends.sm90_fwd_ops is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("head_dim,group,angle_size,slots", [
    (128, 2, 0, (0, 2, 2)),  # no rotary: two k/v slots a consumer, the group's q slots
    (128, 2, 4, (1, 1, 2)),  # fp32 angles at D = 128: one angle tile and one k/v slot a consumer
    (128, 4, 2, (2, 1, 2)),  # 16-bit angles at D = 128: two angle tiles, one k/v slot
    (64, 8, 4, (2, 2, 4)),  # D = 64: two of each, q slots from what is left
    (32, 8, 4, (2, 2, 8)),
])
def test_hopper_forward_rings_fit_their_shared_memory(head_dim, group, angle_size, slots):
    """The 64-row forward's rings (k/v slots, q slots, with a rotary angle tiles, a consumer each) fill at most the
    rings' budget, with at least two q slots a consumer (bf16 inputs)."""
    fwd = backends.sm90_fwd_ops
    angle_slots = fwd._angle_slots(head_dim, 2, angle_size) if angle_size else 0
    angle_bytes = fwd._CONSUMERS * angle_slots * 64 * head_dim * angle_size
    kv_slots = fwd._kv_slots(head_dim, 2, angle_bytes)
    q_slots = fwd._q_slots(head_dim, group, 2, 64, angle_bytes, kv_slots)
    assert (angle_slots, kv_slots, q_slots) == slots
    tile = 64 * head_dim * 2
    assert fwd._CONSUMERS * (2 * kv_slots + q_slots) * tile + angle_bytes <= fwd._RING_BYTES
    assert q_slots >= 2
