"""Bad input is refused with a TypeError/ValueError that names the argument, before any kernel runs."""

import pytest
import torch
from conftest import make_offsets

import blockattn


def good():
    q = torch.randn(10, 4, 32)
    k = torch.randn(10, 2, 32)
    return q, k, k.clone(), make_offsets([4, 6])


CASES = [
    ("q 2-D", lambda q, k, v, o: (q[:, 0], k, v, o), {}, ValueError, "q must be 3-D"),
    ("k 4-D", lambda q, k, v, o: (q, k[None], v, o), {}, ValueError, "k must be 3-D"),
    ("int q", lambda q, k, v, o: (q.long(), k, v, o), {}, TypeError, "q must be float16"),
    ("mixed dtypes", lambda q, k, v, o: (q, k.double(), v, o), {}, TypeError, "k must be float16"),
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
    ("block size bool", lambda *a: a, {"block_size": True}, ValueError, "block_size must be one of"),
    ("scale", lambda *a: a, {"scale": -1.0}, ValueError, "scale must be a positive"),
    ("q not tensor", lambda q, k, v, o: (q.tolist(), k, v, o), {}, TypeError, "q must be a torch.Tensor"),
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
