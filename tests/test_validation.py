"""Bad input is refused with a TypeError/ValueError that names the argument, before any kernel runs."""

import numpy as np
import pytest
import torch
from conftest import make_offsets

import blockattn
from blockattn.nn import BlockSelfAttention


def good():
    q = torch.randn(10, 4, 32)
    k = torch.randn(10, 2, 32)
    return q, k, k.clone(), make_offsets([4, 6])


CASES = [
    ("q 2-D", lambda q, k, v, o: (q[:, 0], k, v, o), {}, ValueError, "q must be 3-D"),
    ("k 4-D", lambda q, k, v, o: (q, k[None], v, o), {}, ValueError, "k must be 3-D"),
    ("int q", lambda q, k, v, o: (q.long(), k, v, o), {}, TypeError, "q must be float16"),
    ("mixed dtypes", lambda q, k, v, o: (q, k.double(), v, o), {}, TypeError, "share a dtype"),
    ("int k", lambda q, k, v, o: (q, k.int(), v, o), {}, TypeError, "k must be float16"),
    ("k/v dtype", lambda q, k, v, o: (q.half(), k.half(), v.bfloat16(), o), {}, TypeError, "share a dtype"),
    ("N mismatch", lambda q, k, v, o: (q, k[:9], v[:9], o), {}, ValueError, "number of tokens"),
    ("D mismatch", lambda q, k, v, o: (q, k[..., :16], v[..., :16], o), {}, ValueError, "head_dim"),
    ("k/v shape", lambda q, k, v, o: (q, k, v[:, :1], o), {}, ValueError, "k and v must have the same shape"),
    ("GQA", lambda q, k, v, o: (q[:, :3], k, v, o), {}, ValueError, "multiple of k/v heads"),
    ("head dim 12", lambda q, k, v, o: (q[..., :12], k[..., :12], v[..., :12], o), {}, ValueError, "head_dim"),
    ("head dim 36", lambda q, k, v, o: (q[..., :20], k[..., :20], v[..., :20], o), {}, ValueError, "head_dim"),
    ("offsets 2-D", lambda q, k, v, o: (q, k, v, o[None]), {}, ValueError, "offsets must be 1-D"),
    ("offsets empty", lambda q, k, v, o: (q, k, v, o[:0]), {}, ValueError, "offsets must be 1-D"),
    ("offsets float", lambda q, k, v, o: (q, k, v, o.float()), {}, TypeError, "offsets must be int32"),
    ("offsets start", lambda q, k, v, o: (q, k, v, o + 1), {}, ValueError, "offsets\\[0\\] must be 0"),
    ("offsets decrease", lambda q, k, v, o: (q, k, v, torch.tensor([0, 7, 3, 10])), {}, ValueError,
     "non-decreasing"),
    ("offsets end", lambda q, k, v, o: (q, k, v, torch.tensor([0, 4, 9])), {}, ValueError, "offsets\\[-1\\]"),
    ("no sequence, N > 0", lambda q, k, v, o: (q, k, v, o[:1]), {}, ValueError, "no sequence \\(B = 0\\)"),
    ("block size", lambda *a: a, {"block_size": 48}, ValueError, "block_size must be one of"),
    ("block size bool", lambda *a: a, {"block_size": True}, TypeError, "block_size must be one of"),
    ("block size str", lambda *a: a, {"block_size": "64"}, TypeError, "block_size must be one of .* of type str"),
    ("scale", lambda *a: a, {"scale": -1.0}, ValueError, "scale must be a finite positive"),
    ("scale inf", lambda *a: a, {"scale": float("inf")}, ValueError, "scale must be a finite positive"),
    ("scale nan", lambda *a: a, {"scale": float("nan")}, ValueError, "scale must be a finite positive"),
    ("scale past float", lambda *a: a, {"scale": 2**1100}, ValueError, "scale must be a finite positive"),
    ("scale str", lambda *a: a, {"scale": "0.5"}, TypeError, "scale must be .* or None, got '0.5' of type str"),
    ("scale tensor", lambda *a: a, {"scale": torch.tensor(0.5)}, TypeError, "scale must be a finite positive"),
    ("sparse q", lambda q, k, v, o: (q.to_sparse(), k, v, o), {}, TypeError,
     "q must be a dense \\(strided\\) tensor, got layout=torch.sparse_coo"),
    ("sparse offsets", lambda q, k, v, o: (q, k, v, o.to_sparse()), {}, TypeError, "offsets must be a dense"),
    ("q not tensor", lambda q, k, v, o: (q.tolist(), k, v, o), {}, TypeError, "q must be a torch.Tensor"),
    # The in-block options (q has 4 heads, 10 tokens; 64-token blocks by default).
    ("causal int", lambda *a: a, {"causal": 1}, TypeError, "causal must be a bool"),
    ("causal numpy", lambda *a: a, {"causal": np.bool_(True)}, TypeError,
     "causal must be a bool \\(True or False\\), got .*True.* of type numpy.bool"),
    ("pos_bias width", lambda *a: a, {"pos_bias": torch.zeros(4, 63)}, ValueError,
     "pos_bias must be \\[num_heads, 2 \\* block_size - 1 relative positions\\] = \\[4, 127\\]"),
    ("pos_bias heads", lambda *a: a, {"pos_bias": torch.zeros(2, 127)}, ValueError, "pos_bias must be"),
    ("pos_bias dtype", lambda *a: a, {"pos_bias": torch.zeros(4, 127, dtype=torch.float16)}, TypeError,
     "pos_bias must be float32"),
    ("pos_bias list", lambda *a: a, {"pos_bias": [0.0] * 127}, TypeError, "pos_bias must be a torch.Tensor"),
    ("pos_bias sparse", lambda *a: a, {"pos_bias": torch.zeros(4, 127).to_sparse()}, TypeError,
     "pos_bias must be a dense \\(strided\\) tensor"),
    ("time_bias alone", lambda *a: a, {"time_bias": torch.zeros(4, 8)}, ValueError,
     "time_bias was given without timestamps"),
    ("timestamps alone", lambda *a: a, {"timestamps": torch.arange(10)}, ValueError,
     "timestamps was given without time_bias"),
    ("timestamps shape", lambda *a: a, {"timestamps": torch.arange(9), "time_bias": torch.zeros(4, 8)}, ValueError,
     "timestamps must be 1-D \\[N\\] = \\[10\\]"),
    ("timestamps dtype", lambda *a: a, {"timestamps": torch.arange(10).double(), "time_bias": torch.zeros(4, 8)},
     TypeError, "timestamps must be int64, int32 or float32"),
    ("timestamps grad", lambda *a: a, {"timestamps": torch.arange(10.0).requires_grad_(),
                                       "time_bias": torch.zeros(4, 8)}, ValueError, "timestamps requires grad"),
    ("time_bias shape", lambda *a: a, {"timestamps": torch.arange(10), "time_bias": torch.zeros(4, 0)}, ValueError,
     "time_bias must be \\[num_heads, num_buckets\\]"),
    ("bucket width", lambda *a: a, {"timestamps": torch.arange(10), "time_bias": torch.zeros(4, 8),
                                    "time_bucket_width": 0.0}, ValueError, "time_bucket_width must be a finite float"),
    ("dropout 1", lambda *a: a, {"dropout_p": 1.0}, ValueError, "dropout_p must be a float in \\[0, 1\\)"),
    ("dropout negative", lambda *a: a, {"dropout_p": -0.1}, ValueError, "dropout_p must be a float in"),
    ("dropout bool", lambda *a: a, {"dropout_p": True}, TypeError, "dropout_p must be a float in"),
    ("dropout str", lambda *a: a, {"dropout_p": "0.1"}, TypeError, "dropout_p must be a float in"),
]


@pytest.mark.parametrize("make,kwargs,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejects_bad_input(make, kwargs, error, message):
    with pytest.raises(error, match=message):
        blockattn.block_attention(*make(*good()), **kwargs)


def test_offsets_required():
    q, k, v, _ = good()
    with pytest.raises(TypeError, match="offsets is required"):
        blockattn.block_attention(q, k, v)


def test_devices_must_match():
    q, k, v, o = good()
    with pytest.raises(ValueError, match="one device"):
        blockattn.block_attention(q, k, v.to("meta"), o)


def test_nested_rejects_offsets_and_mixed_structure():
    q, k, v, o = good()
    nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, o.long()) for t in (q, k, v))
    with pytest.raises(ValueError, match="offsets must be None"):
        blockattn.block_attention(nq, nk, nv, o)
    with pytest.raises(TypeError, match="k must be a nested tensor"):
        blockattn.block_attention(nq, k, nv)
    other = torch.nested.nested_tensor_from_jagged(k, torch.tensor([0, 5, 10]))
    with pytest.raises(ValueError, match="same jagged structure"):
        blockattn.block_attention(nq, other, nv)
    strided = [torch.nested.nested_tensor([t[:4], t[4:]]) for t in (q, k, v)]  # the default layout: not jagged
    with pytest.raises(TypeError, match="q must be a nested tensor of layout=torch.jagged, got layout=torch.strided"):
        blockattn.block_attention(*strided)
    # Flash attention takes dense [B, S, H, D] tensors; jagged sequences go to its varlen form.
    dense = [torch.nested.nested_tensor_from_jagged(t[:, None], o.long()) for t in (q, k, v)]
    with pytest.raises(TypeError, match="q must be a dense tensor .* flash_attention_varlen"):
        blockattn.flash_attention(*dense)


def test_a_sparse_tensor_is_refused_after_a_dense_one_of_its_shape_passed():
    """The checks' signature holds each tensor's layout: a sparse q is not a dense q that passed before."""
    q, k, v, o = good()
    blockattn.block_attention(q, k, v, o)
    with pytest.raises(TypeError, match="q must be a dense \\(strided\\) tensor"):
        blockattn.block_attention(q.to_sparse(), k, v, o)


def test_nested_with_holes_is_refused():
    """A jagged nested tensor with holes (lengths(), as torch.nested.narrow makes) has values that are not its
    sequences' tokens."""
    padded = torch.randn(2, 8, 4, 32)
    holes = torch.nested.narrow(padded, 1, torch.tensor([0, 0]), torch.tensor([3, 8]), layout=torch.jagged)
    with pytest.raises(ValueError, match="q is a jagged nested tensor with holes .* pass q.contiguous\\(\\)"):
        blockattn.block_attention(holes, holes, holes)
    angles = torch.nested.narrow(torch.randn(2, 6, 32), 1, torch.tensor([0, 0]), torch.tensor([4, 6]),
                                 layout=torch.jagged)  # offsets [0, 6, 12], lengths [4, 6]
    nq = torch.nested.nested_tensor_from_jagged(torch.randn(12, 4, 32), angles.offsets())
    with pytest.raises(ValueError, match="sinu_pos is a jagged nested tensor with holes"):
        blockattn.block_attention(nq, nq, nq, sinu_pos=angles)
    layer = BlockSelfAttention(32, 2)
    x = torch.nested.narrow(torch.randn(2, 8, 32), 1, torch.tensor([0, 0]), torch.tensor([3, 8]),
                            layout=torch.jagged)
    with pytest.raises(ValueError, match="x is a jagged nested tensor with holes"):
        layer(x)
    contiguous = holes.contiguous()
    assert contiguous.lengths() is None
    torch.testing.assert_close(blockattn.block_attention(contiguous, contiguous, contiguous).values(),
                               blockattn.block_attention(*(contiguous.values(),) * 3, contiguous.offsets()))


ANGLES = torch.randn(10, 32)
ROTARY_CASES = [
    ("sinu_pos shape", {"sinu_pos": ANGLES[:, :16]}, ValueError, "sinu_pos must be \\[N, head_dim\\] = \\[10, 32\\]"),
    ("sinu_pos rows", {"sinu_pos": ANGLES[:9]}, ValueError, "sinu_pos must be \\[N, head_dim\\]"),
    ("sinu_pos int", {"sinu_pos": ANGLES.long()}, TypeError, "sinu_pos must be float16"),
    ("sinu_pos list", {"sinu_pos": ANGLES.tolist()}, TypeError, "sinu_pos must be a torch.Tensor"),
    ("sinu_pos device", {"sinu_pos": ANGLES.to("meta")}, ValueError, "sinu_pos must be on the device"),
    ("sinu_pos grad", {"sinu_pos": ANGLES.clone().requires_grad_()}, ValueError, "sinu_pos requires grad"),
    ("rotate str", {"sinu_pos": ANGLES, "rotate": "qk"}, TypeError, "rotate must be a tuple \\(or list, set\\)"),
    ("rotate name", {"sinu_pos": ANGLES, "rotate": ("q", "o")}, ValueError, "unknown \\['o'\\]"),
    ("rotate twice", {"sinu_pos": ANGLES, "rotate": ["q", "q"]}, ValueError,
     "rotate names an operand more than once: \\('q', 'q'\\)"),
    ("rotate name, no angles", {"rotate": ("x",)}, ValueError, "unknown \\['x'\\]"),
    ("rotate nested list", {"sinu_pos": ANGLES, "rotate": [["q"]]}, ValueError, "unknown \\[\\['q'\\]\\]"),
    ("sinu_pos sparse", {"sinu_pos": ANGLES.to_sparse()}, TypeError, "sinu_pos must be a dense"),
]


@pytest.mark.parametrize("kwargs,error,message", [c[1:] for c in ROTARY_CASES], ids=[c[0] for c in ROTARY_CASES])
def test_rejects_bad_rotary_arguments(kwargs, error, message):
    q, k, v, o = good()
    with pytest.raises(error, match=message):
        blockattn.block_attention(q, k, v, o, **kwargs)
    x, w = torch.randn(10, 8), torch.randn(8, 8 * 32)
    with pytest.raises(error, match=message):
        blockattn.qkv_block_attention(x, w, o, num_heads=4, num_kv_heads=2, **kwargs)
    if "sinu_pos" in kwargs and "rotate" not in kwargs:
        with pytest.raises(error, match=message):
            blockattn.apply_rotary(q, kwargs["sinu_pos"])


APPLY_ROTARY_CASES = [
    ("no angles", torch.randn(10, 2, 32), None, TypeError, "sinu_pos must be a torch.Tensor, got NoneType"),
    ("x 2-D", torch.randn(10, 32), ANGLES, ValueError, "x must be 3-D"),
    ("x int", torch.ones(10, 2, 32, dtype=torch.long), ANGLES, TypeError, "x must be float16"),
    ("odd head dim", torch.randn(10, 2, 7), torch.randn(10, 7), ValueError, "head_dim must be even"),
    ("head dim 1024", torch.randn(10, 1, 1024), torch.randn(10, 1024), ValueError, "in \\[2, 512\\]"),
]


@pytest.mark.parametrize("x,sinu_pos,error,message", [c[1:] for c in APPLY_ROTARY_CASES],
                         ids=[c[0] for c in APPLY_ROTARY_CASES])
def test_apply_rotary_rejects_bad_input(x, sinu_pos, error, message):
    with pytest.raises(error, match=message):
        blockattn.apply_rotary(x, sinu_pos)


def projection(d_model=8, hq=4, hkv=2, d=32):
    return torch.randn(10, d_model), torch.randn(d_model, (hq + 2 * hkv) * d), torch.randn((hq + 2 * hkv) * d)


PROJECTION_CASES = [
    ("x 3-D", lambda x, w, b: (x[None], w, b), {}, ValueError, "x must be 2-D"),
    ("x int", lambda x, w, b: (x.long(), w, b), {}, TypeError, "x must be float16"),
    ("w rows", lambda x, w, b: (x, w[:7], b), {}, ValueError, "w must be \\[d_model, \\(num_heads"),
    ("w columns", lambda x, w, b: (x, w[:, :100], b), {}, ValueError, "w must be \\[d_model"),
    ("w head dim", lambda x, w, b: (x, torch.randn(x.shape[1], 8 * 33), None), {}, ValueError,
     "head_dim \\(w's 264 columns over num_heads \\+ 2 \\* num_kv_heads = 8\\) must be a multiple of 8"),
    ("w dtype", lambda x, w, b: (x, w.double(), b), {}, TypeError, "w must have the dtype of x"),
    ("bias shape", lambda x, w, b: (x, w, b[:-1]), {}, ValueError, "bias must be 1-D \\[256\\]"),
    ("bias dtype", lambda x, w, b: (x, w, b.half()), {}, TypeError, "bias must have the dtype of x"),
    ("bias list", lambda x, w, b: (x, w, b.tolist()), {}, TypeError, "bias must be a torch.Tensor"),
    ("heads float", lambda *a: a, {"num_heads": 4.0}, TypeError, "num_heads must be a positive int, got 4.0 of type"),
    ("kv heads 0", lambda *a: a, {"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int"),
    ("GQA", lambda *a: a, {"num_heads": 3, "num_kv_heads": 2}, ValueError, "w must be|multiple of k/v heads"),
    ("block size", lambda *a: a, {"block_size": 48}, ValueError, "block_size must be one of"),
]


@pytest.mark.parametrize("make,kwargs,error,message", [c[1:] for c in PROJECTION_CASES],
                         ids=[c[0] for c in PROJECTION_CASES])
def test_qkv_block_attention_rejects_bad_input(make, kwargs, error, message):
    x, w, bias = make(*projection())
    heads = {"num_heads": 4, "num_kv_heads": 2, **kwargs}
    with pytest.raises(error, match=message):
        blockattn.qkv_block_attention(x, w, make_offsets([4, 6]), bias=bias, **heads)


def test_qkv_block_attention_checks_heads_before_the_projection():
    """Head-dim and offsets errors come from shapes, before the projection's matmul runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    refused = projection(hq=3, hkv=3, d=12)  # 9 heads of 12 columns: head_dim 12 is refused
    for (x, w, _bias), offsets, message in (
            (refused, make_offsets([4, 6]), "head_dim .* must be a multiple of 8"),
            (projection(hq=3, hkv=3, d=16), make_offsets([4, 6]).float(), "offsets must be int32")):
        with RecordOps() as recorded, pytest.raises((TypeError, ValueError), match=message):
            blockattn.qkv_block_attention(x, w, offsets, num_heads=3, num_kv_heads=3)
        assert not {torch.ops.aten.mm.default, torch.ops.aten.addmm.default} & set(recorded.ops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_in_block_tensors_on_another_device():
    q, k, v, o = good()
    with pytest.raises(ValueError, match="pos_bias must be on the device of q"):
        blockattn.block_attention(q, k, v, o, pos_bias=torch.zeros(4, 127, device="cuda"))
    with pytest.raises(ValueError, match="timestamps must be on the device of q"):
        blockattn.block_attention(q, k, v, o, timestamps=torch.arange(10, device="cuda"), time_bias=torch.zeros(4, 8))


def test_checks_run_once_per_signature(monkeypatch):
    """A call whose arguments' metadata passed the checks before skips them; other shapes, dtypes, requires_grad
    or grad mode are checked anew, and so are arguments without a signature (an unhashable value)."""
    from blockattn import checks

    ran = []
    check = checks.attention
    monkeypatch.setattr(checks, "attention", lambda *args: ran.append(1) or check(*args))
    q, k, v, o = good()
    for _ in range(3):
        blockattn.block_attention(q, k, v, o)
        blockattn.block_attention(q.clone(), k.clone(), v.clone(), o.clone())  # other tensors, same metadata
    assert len(ran) == 1
    blockattn.block_attention(q[:, :2], k[:, :1], v[:, :1], o)  # other shapes
    assert len(ran) == 2
    blockattn.block_attention(q.requires_grad_(), k, v, o)
    assert len(ran) == 3
    with torch.no_grad():
        blockattn.block_attention(q, k, v, o)
    assert len(ran) == 4
    for _ in range(2):
        blockattn.block_attention(q, k, v, o, sinu_pos=ANGLES, rotate=["q", "k"])  # a list: no signature
    assert len(ran) == 6


def test_a_refused_signature_is_refused_every_time():
    """Only arguments that passed are remembered: the same bad call raises again, and a good call does not make
    one with other metadata pass."""
    q, k, v, o = good()
    blockattn.block_attention(q, k, v, o, scale=0.5)
    for _ in range(2):
        with pytest.raises(ValueError, match="scale must be a finite positive"):
            blockattn.block_attention(q, k, v, o, scale=-0.5)
        with pytest.raises(TypeError, match="offsets must be int32"):
            blockattn.block_attention(q, k, v, o.float(), scale=0.5)
        with pytest.raises(ValueError, match="sinu_pos requires grad"):
            blockattn.block_attention(q, k, v, o, sinu_pos=ANGLES.clone().requires_grad_())
    blockattn.block_attention(q, k, v, o, sinu_pos=ANGLES)
    with pytest.raises(ValueError, match="sinu_pos requires grad"):  # same shapes, now requiring grad
        blockattn.block_attention(q, k, v, o, sinu_pos=ANGLES.clone().requires_grad_())


def test_float8_inference_check_follows_grad_mode_and_requires_grad():
    """The float8 forward refuses inputs that require grad while autograd records, after the same call passed
    without them, or under no_grad."""
    from blockattn.reference import quantised_fp8

    q, k, v, o = good()
    (q8, qs), (k8, ks), (v8, vs) = quantised_fp8(q), quantised_fp8(k), quantised_fp8(v)
    scales = {"q_descale": qs, "k_descale": ks, "v_descale": vs}
    blockattn.block_attention(q8, k8, v8, o, **scales)
    with pytest.raises(ValueError, match="q_descale must not require grad"):
        blockattn.block_attention(q8, k8, v8, o, **{**scales, "q_descale": qs.clone().requires_grad_()})
    descale = qs.clone().requires_grad_()
    with torch.no_grad():
        blockattn.block_attention(q8, k8, v8, o, **{**scales, "q_descale": descale})
    with pytest.raises(ValueError, match="q_descale must not require grad"):
        blockattn.block_attention(q8, k8, v8, o, **{**scales, "q_descale": descale})


def test_flash_checks_follow_requires_grad():
    q, k, v = (torch.randn(1, 16, 2, 32) for _ in range(3))
    blockattn.flash_attention(q, k, v)
    for _ in range(2):
        with pytest.raises(ValueError, match="flash attention is forward only"):
            blockattn.flash_attention(q.clone().requires_grad_(), k, v)
    with pytest.raises(ValueError, match="causal_alignment must be one of"):
        blockattn.flash_attention(q, k, v, causal_alignment="center")


def test_the_oldest_passed_signature_is_checked_again(monkeypatch):
    from blockattn import checks

    ran = []
    check = checks.attention
    monkeypatch.setattr(checks, "attention", lambda *args: ran.append(1) or check(*args))
    monkeypatch.setattr(checks, "MAX_PASSED", 2)
    q, k, v, o = good()
    shapes = [(q, k, v), (q[:, :2], k[:, :1], v[:, :1]), (q[..., :16], k[..., :16], v[..., :16])]
    for tensors in shapes:
        blockattn.block_attention(*tensors, o)
    for tensors in shapes[1:]:
        blockattn.block_attention(*tensors, o)
    assert len(ran) == 3
    blockattn.block_attention(*shapes[0], o)
    assert len(ran) == 4


def test_numpy_numbers_are_taken_as_python_numbers():
    """Sizes, counts and scales read from a numpy array or config (np.int64, np.float32) are taken as the Python
    numbers they equal: the same result; a numpy bool is no size, an inf scale no scale."""
    q, k, v, o = good()
    x = torch.randn(10, 32)
    w = torch.randn(32, 4 * 16)
    timestamps = torch.arange(10, dtype=torch.int64)
    time_bias = torch.randn(4, 5)
    plain = blockattn.block_attention(q, k, v, o, block_size=16, scale=0.25, dropout_p=0.0)
    numpy = blockattn.block_attention(q, k, v, o, block_size=np.int64(16), scale=np.float32(0.25),
                                      dropout_p=np.float32(0.0))
    torch.testing.assert_close(numpy, plain, rtol=0, atol=0)
    layout = blockattn.block_layout(o, np.int64(10), np.int32(16), timestamps=timestamps,
                                    num_time_buckets=np.int64(5), time_bucket_width=np.float32(0.5))
    assert type(layout.num_tokens) is int and type(layout.block_size) is int
    assert type(layout.num_time_buckets) is int and type(layout.time_bucket_width) is float
    torch.testing.assert_close(blockattn.block_attention(q, k, v, layout, time_bias=time_bias),
                               blockattn.block_attention(q, k, v, o, block_size=16, timestamps=timestamps,
                                                         time_bias=time_bias, time_bucket_width=0.5), rtol=0, atol=0)
    torch.testing.assert_close(
        blockattn.qkv_block_attention(x, w, o, num_heads=np.int64(2), num_kv_heads=np.int32(1),
                                      block_size=np.int64(16)),
        blockattn.qkv_block_attention(x, w, o, num_heads=2, num_kv_heads=1, block_size=16), rtol=0, atol=0)
    layer = BlockSelfAttention(np.int64(64), np.int64(4), num_kv_heads=np.int64(2), block_size=np.int64(32),
                               rotary_base=np.float32(100.0), dropout=np.float64(0.0))
    assert (type(layer.d_model), type(layer.num_heads), type(layer.block_size)) == (int, int, int)
    assert repr(layer) == repr(BlockSelfAttention(64, 4, num_kv_heads=2, block_size=32, rotary_base=100.0))
    cu = make_offsets([4, 6]).int()
    torch.testing.assert_close(
        blockattn.flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=np.int64(6), max_seqlen_k=np.int64(6)),
        blockattn.flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=6, max_seqlen_k=6), rtol=0, atol=0)
    with pytest.raises(TypeError, match="block_size must be one of .* of type numpy.bool"):
        blockattn.block_attention(q, k, v, o, block_size=np.bool_(True))
    with pytest.raises(ValueError, match="scale must be a finite positive float or None, got .*inf"):
        blockattn.block_attention(q, k, v, o, scale=np.float32("inf"))
    with pytest.raises(TypeError, match="num_heads must be a positive int, got .* of type numpy.float64"):
        blockattn.qkv_block_attention(x, w, o, num_heads=np.float64(2), num_kv_heads=1)


def test_block_layout_of_no_sequence_with_tokens():
    with pytest.raises(ValueError, match="offsets describes no sequence \\(B = 0\\) but num_tokens = 5; expected"):
        blockattn.block_layout(torch.zeros(1, dtype=torch.int64), 5)
    assert blockattn.block_layout(torch.zeros(1, dtype=torch.int64), 0).num_tokens == 0


def test_strided_nested_tensors_are_refused_by_name():
    """Nested tensors of the default strided layout (``torch.nested.nested_tensor`` without ``layout=torch.jagged``)
    are refused naming the argument, wherever they are passed (their sizes raised deep in PyTorch)."""
    q, k, v, o = good()
    strided = torch.nested.nested_tensor([q[:4], q[4:]])
    with pytest.raises(TypeError, match="k is a nested tensor of layout=torch.strided"):
        blockattn.block_attention(q, strided, v, o)
    with pytest.raises(TypeError, match="pos_bias is a nested tensor of layout=torch.strided"):
        blockattn.block_attention(q, k, v, o, pos_bias=torch.nested.nested_tensor([torch.zeros(2, 127)] * 2))
    with pytest.raises(TypeError, match="x is a nested tensor of layout=torch.strided"):
        blockattn.apply_rotary(strided, torch.zeros(10, 32))
    with pytest.raises(TypeError, match="x is a nested tensor of layout=torch.strided"):
        blockattn.qkv_block_attention(torch.nested.nested_tensor([torch.zeros(4, 32), torch.zeros(6, 32)]),
                                      torch.zeros(32, 64), o, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="x, when nested, must be a torch.jagged tensor .* got layout torch.strided"):
        BlockSelfAttention(64, 4)(torch.nested.nested_tensor([torch.zeros(4, 64), torch.zeros(6, 64)]))


def test_ints_past_int64_are_refused():
    _, _, _, o = good()
    with pytest.raises(ValueError, match="num_tokens must be .* within int64, got 1180591620717411303424"):
        blockattn.block_layout(o, 2**70)
    with pytest.raises(ValueError, match="num_time_buckets must be a positive int within int64"):
        blockattn.block_layout(o, 10, timestamps=torch.arange(10), num_time_buckets=2**63)


def test_a_hand_built_layout_is_checked_field_by_field():
    """A BlockLayout is a NamedTuple: one assembled by hand gets a TypeError/ValueError naming the bad field."""
    from blockattn.block_table import BlockTable
    q, k, v, o = good()
    layout = blockattn.block_layout(o, 10, 16)
    for bad, error, message in [
        (layout._replace(table=None), TypeError, "the BlockLayout's table must be a BlockTable of two int32 tensors"),
        (layout._replace(table=BlockTable(*(t.long() for t in layout.table))), TypeError, "BlockLayout's table"),
        (layout._replace(table=BlockTable(*(t.to("meta") for t in layout.table))), TypeError, "BlockLayout's table"),
        (layout._replace(offsets=[0, 4, 10]), TypeError, "the BlockLayout's offsets must be a torch.Tensor"),
        (layout._replace(num_tokens="10"), TypeError, "the BlockLayout's num_tokens must be a non-negative int"),
        (layout._replace(block_size=48), ValueError, "the BlockLayout's block_size must be one of"),
        (layout._replace(timestamps=torch.arange(10), num_time_buckets=None), TypeError,
         "the BlockLayout's num_time_buckets must be a positive int"),
    ]:
        with pytest.raises(error, match=message):
            blockattn.block_attention(q, k, v, bad)


def test_torch_func_derivatives_are_refused_and_vmap_runs():
    """torch.func's differentiation transforms would return zero tangents (jvp) or fail deep in PyTorch (grad):
    a NotImplementedError naming the function instead; vmap runs (PyTorch loops over the batch)."""
    q, k, v, o = good()
    q = q[:, :2]
    sinu_pos = torch.randn(10, 32)
    with pytest.raises(NotImplementedError, match="blockattn.block_attention does not support torch.func's deriv"):
        torch.func.jvp(lambda q: blockattn.block_attention(q, k, v, o), (q,), (torch.ones_like(q),))
    with pytest.raises(NotImplementedError, match="blockattn.block_attention does not support"):
        torch.func.grad(lambda q: blockattn.block_attention(q, k, v, o).sum())(q)
    with pytest.raises(NotImplementedError, match="blockattn.apply_rotary does not support"):
        torch.func.jacrev(lambda x: blockattn.apply_rotary(x, sinu_pos))(q)
    with pytest.raises(NotImplementedError, match="blockattn.flash_attention does not support"):
        torch.func.vjp(lambda q: blockattn.flash_attention(q[None], q[None], q[None]), q)
    x, w = torch.randn(10, 32), torch.randn(32, 64)
    with pytest.raises(NotImplementedError, match="blockattn.qkv_block_attention does not support"):
        torch.func.jvp(lambda x: blockattn.qkv_block_attention(x, w, o, num_heads=2, num_kv_heads=1), (x,), (x,))
    batched = torch.func.vmap(lambda q: blockattn.block_attention(q, k, v, o))(torch.stack([q, 2 * q]))
    torch.testing.assert_close(batched[1], blockattn.block_attention(2 * q, k, v, o))
    # A frozen attention inside a gradient taken through something else is no derivative of it: it runs.
    weight = torch.tensor(2.0)
    frozen = torch.func.grad(lambda w: (blockattn.block_attention(q, k, v, o) * w).sum())(weight)
    torch.testing.assert_close(frozen, blockattn.block_attention(q, k, v, o).sum())
    with pytest.raises(NotImplementedError, match="blockattn.block_attention does not support"):
        torch.func.vmap(torch.func.grad(lambda q: blockattn.block_attention(q, k, v, o).sum()))(torch.stack([q, q]))
