"""The launch cache (``ops/launch.py``): a cached launch must run the kernel Triton would have picked."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import requires_gpu

from blockattn.ops import launch


@pytest.fixture
def key(monkeypatch):
    """The key ``launch`` computes for one argument (its inline tensor and int branches, and ``_key_of`` for the
    rest), on any machine: the current device is read first, so it is fixed to 0 here."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return lambda value, constexpr=False: launch._key([value], (constexpr,), ())


@pytest.mark.parametrize(("a", "b"), [
    (1, 2),  # Triton may specialise the value 1
    (16, 17), (32, 40),  # divisibility by 16
    (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16),  # int32 against int64
    (2**63 - 16, 2**63),  # int64 against uint64
    (3, 3.0), (1, True),  # the type
])
def test_keys_tell_apart_what_triton_specialises_on(a, b, key):
    assert key(a) != key(b)


def test_keys_of_the_same_specialisation_are_equal(key):
    assert key(32) == key(4096)
    assert key(0.5) == key(2.0)
    x = torch.zeros(64, dtype=torch.float16)
    assert key(x) == key(x[8:])  # both 16-byte aligned
    assert key(x) != key(x[1:])
    assert key(x) != key(x.bfloat16())
    assert key(64, constexpr=True) != key(128, constexpr=True)  # constexprs by value
    # A tensor subclass (a learnable bias) takes the general branch: the same properties tell its keys apart.
    param = torch.nn.Parameter(x.float())
    assert key(param) != key(torch.nn.Parameter(x.float()[1:]))
    assert key(param) != key(torch.nn.Parameter(x))


def test_unknown_argument_types_are_not_cached(key):
    with pytest.raises(launch._Uncached):
        key([1, 2])


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, stride, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(y_ptr + offs * stride, tl.load(x_ptr + offs * stride, mask=keep) * factor, mask=keep)


@requires_gpu
def test_cached_launches_run_the_right_kernel():
    """Alternating aligned and unaligned pointers, lengths and strides with and without a factor of 16, and two
    dtypes: each launch computes what it should, and each specialisation is compiled and cached once."""
    before = launch.cached_keys(_scaled_copy)
    base = torch.randn(4096, device="cuda")
    cases = []
    for dtype in (torch.float32, torch.float16):
        for start in (0, 1):  # 16-byte aligned, then not
            for n, stride in ((512, 1), (500, 1), (256, 3)):
                cases.append((base.to(dtype)[start:], n, stride))
    for _ in range(2):  # the second round hits the cache
        for x, n, stride in cases:
            y = torch.zeros_like(x)
            launch.launch(_scaled_copy, (triton.cdiv(n, 128),), x_ptr=x, y_ptr=y, n=n, stride=stride, factor=2.0,
                          BLOCK=128)
            want = torch.zeros_like(x)
            want[:n * stride:stride] = x[:n * stride:stride] * 2
            torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert launch.cached_keys(_scaled_copy) - before == len(cases)


@requires_gpu
def test_a_missing_argument_falls_back_to_triton():
    x = torch.randn(256, device="cuda")
    y = torch.zeros_like(x)
    with pytest.raises(TypeError):
        launch.launch(_scaled_copy, (2,), x_ptr=x, y_ptr=y, n=256, stride=1, BLOCK=128)  # no factor: Triton says so
