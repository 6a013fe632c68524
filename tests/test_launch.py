"""The launch cache (``ops/launch.py``): a cached launch must run the kernel Triton would have picked."""

import ctypes
import weakref

import pytest
import torch
import triton
import triton.language as tl
from conftest import requires_gpu
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from blockattn.ops import launch


@pytest.fixture
def key():
    """The key of one argument, by the function ``launch`` generates for an argument of its kind."""
    return lambda value, constexpr=False: launch._key_function((value,), (constexpr,))((value,))


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
    # A learnable bias (a Parameter) is a tensor to Triton: the same properties tell its keys apart.
    param = torch.nn.Parameter(x.float())
    assert key(param) != key(torch.nn.Parameter(x.float()[1:]))
    assert key(param) != key(torch.nn.Parameter(x))
    assert key(param) == key(x.float())


@pytest.mark.parametrize(("made_for", "other"), [
    (1, True), (1, 1.0), (1, torch.zeros(1)), (1, None),
    (torch.zeros(1), 1), (torch.zeros(1), None), (torch.zeros(1), torch.zeros(1, dtype=torch.int32)),
    (None, torch.zeros(1)),
])
def test_a_key_function_tells_apart_arguments_of_another_kind(made_for, other, key):
    """A launcher may pass another kind of argument than the first launch did (None for an optional pointer, which
    Triton takes as a constexpr): the key function written for the first kind gives it a key of its own, the one
    :func:`_key_of` gives it, never the first argument's."""
    made = launch._key_function((made_for,), (False,))
    assert made((other,)) != made((made_for,))
    assert made((other,)) == (launch._key_of(other, False),)
    with pytest.raises(launch._Uncached):
        made(([1, 2],))


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


@triton.jit
def _copy_maybe_scaled(x_ptr, y_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if factor_ptr is not None:
        x = x * tl.load(factor_ptr)
    tl.store(y_ptr + offs, x, mask=offs < n)


@requires_gpu
def test_an_optional_pointer_left_out_is_cached_too(monkeypatch):
    """A pointer passed as a tensor, then as None (Triton compiles another kernel: a constexpr None), then as a
    tensor again: each kind gets its compiled kernel in the cache, and every launch after the first of its kind
    skips Triton's runner."""
    through_triton = []
    run = launch._through_triton
    monkeypatch.setattr(launch, "_through_triton", lambda *args: through_triton.append(args) or run(*args))
    x = torch.randn(300, device="cuda")
    factor = torch.full((1,), 3.0, device="cuda")
    for round_ in range(3):
        for scale in (factor, None):
            y = torch.zeros_like(x)
            launch.launch(_copy_maybe_scaled, (3,), x_ptr=x, y_ptr=y, factor_ptr=scale, n=300, BLOCK=128)
            torch.testing.assert_close(y, x * 3 if scale is not None else x, rtol=0, atol=0)
        assert len(through_triton) == 2 and launch.cached_keys(_copy_maybe_scaled) == 2, f"round {round_}"


def test_a_refused_key_is_refused_again_without_triton(monkeypatch):
    """A kernel the GPU refuses (Triton's ``OutOfResources`` at its first launch: more shared memory than a program
    may take) raises again at once at every launch of its key, without Triton; the error kept holds no traceback,
    whose frames would keep every refused call's tensors alive. Triton's refusal is stood in for (no GPU)."""
    refusals = []

    def refuse(kernel, grid, kwargs, device):
        refusals.append(grid)
        raise OutOfResources(160 * 1024, 99 * 1024, "shared memory")

    monkeypatch.setattr(launch, "_through_triton", refuse)
    monkeypatch.setattr(launch, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = JITFunction(getattr(_copy_maybe_scaled, "fn", _copy_maybe_scaled))  # as on a GPU, not interpreted
    x = torch.zeros(300)
    alive = weakref.ref(x)
    for _ in range(3):
        with pytest.raises(OutOfResources, match="shared memory"):
            launch.launch(kernel, (3,), x_ptr=x, y_ptr=torch.zeros(300), factor_ptr=None, n=300, BLOCK=128)
    assert len(refusals) == 1
    assert [error.__traceback__ for error in launch._KERNELS[kernel].unfit.values()] == [None]
    del x
    assert alive() is None


def test_launch_fitting_runs_the_first_configuration_the_gpu_takes():
    """The rule's configuration, else the first leaner one (other than the rule) that is not refused; where every
    one is refused, the last one's error, and where there is none (no fallback, or only the rule), the rule's."""

    def refusing(*refused):
        ran = []

        def run(cfg):
            ran.append(cfg)
            if cfg in refused:
                raise OutOfResources(2, 1, f"shared memory of {cfg}")

        return run, ran

    run, ran = refusing("rule", "a")
    launch.launch_fitting(run, "rule", lambda: ["rule", "a", "b", "c"])
    assert ran == ["rule", "a", "b"]
    run, ran = refusing("rule", "a", "b")
    with pytest.raises(OutOfResources, match="of b"):
        launch.launch_fitting(run, "rule", lambda: ["a", "b"])
    assert ran == ["rule", "a", "b"]
    for leaner in (None, lambda: ["rule"]):
        run, ran = refusing("rule")
        with pytest.raises(OutOfResources, match="of rule"):
            launch.launch_fitting(run, "rule", leaner)
        assert ran == ["rule"]
    run, ran = refusing()
    launch.launch_fitting(run, "rule", None)
    assert ran == ["rule"]


@requires_gpu
def test_a_missing_argument_falls_back_to_triton():
    x = torch.randn(256, device="cuda")
    y = torch.zeros_like(x)
    with pytest.raises(TypeError):
        launch.launch(_scaled_copy, (2,), x_ptr=x, y_ptr=y, n=256, stride=1, BLOCK=128)  # no factor: Triton says so


@requires_gpu
def test_a_thread_without_a_current_context_launches_a_kernel_with_descriptors():
    """A kernel with host-built tensor descriptors, compiled on this thread, launched again on a new thread (as the
    autograd engine's worker thread does in the backward): that thread has no current CUDA context yet."""
    import threading

    from blockattn import custom_ops
    from blockattn.block_table import build_block_table

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward (host tensor descriptors) runs on compute capability 9.x")
    n = 200
    q, k, v, do = (torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    offsets = torch.tensor([0, 70, n], device="cuda")
    table = build_block_table(offsets, n, 64)
    args = (do, q, k, v, offsets, None, *table, 64, 128**-0.5, 0)
    want = custom_ops._block_attention_bwd(*args)
    results = []
    thread = threading.Thread(target=lambda: results.append(custom_ops._block_attention_bwd(*args)))
    thread.start()
    thread.join()
    assert results, "the launch on the new thread raised"
    for got, expected in zip(results[0][:3], want[:3]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_descriptor_keys_tell_apart_their_settings_and_alignment(key):
    descriptor_type = launch.TensorDescriptor
    if descriptor_type == ():
        pytest.skip("this triton has no Gluon Hopper descriptors")
    from triton.experimental.gluon import language as gl

    x = torch.zeros(256, 64, dtype=torch.float16)

    def descriptor(t, rows=64):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 64], gl.float16)
        return descriptor_type(t, list(t.shape), list(t.stride()), [rows, 64], layout)

    assert key(descriptor(x)) == key(descriptor(x[64:]))  # another tile of the same kind
    assert key(descriptor(x)) != key(descriptor(x, rows=32))  # block shape
    assert key(descriptor(x)) != key(descriptor(x.view(-1)[8:8 + 255 * 64].view(255, 64)))  # 16-byte alignment
    made = launch._key_function((descriptor(x),), (False,))
    assert made((x,)) == (launch._key_of(x, False),) != made((descriptor(x),))  # a tensor in its place


# --- direct launches (a call plan's replays) ---------------------------------------------------------------------


class _Compiled:
    """Stands in for a compiled kernel: what ``DirectLaunch.of`` reads of one."""

    def __init__(self, signature: dict, **metadata):
        self.src = type("Source", (), {"signature": signature})()
        self.metadata = type("Metadata", (), {"num_warps": 4, "shared": 1024, "num_ctas": 1, **metadata})()
        self.function = 0


_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "big": "i64", "factor": "fp32", "flag": "i1",
              "BLOCK": "constexpr", "z_ptr": "*fp32"}


def _direct(monkeypatch, sizes, signature=_SIGNATURE, values=None, **metadata):
    monkeypatch.setattr(launch, "_param_sizes", lambda function: sizes)
    slot = type("Slot", (int,), {})
    values = values or (slot(2), slot(0), 500, 2**40, 0.5, True, 128, slot(2))
    return launch.DirectLaunch.of(_Compiled(signature, **metadata), (3, 1, 1), values,
                                  lambda v: type(v) is slot, device=0)


def test_a_direct_launch_passes_each_tensor_address_where_its_parameters_are(monkeypatch):
    """The buffer holds the recorded scalars in their kernel types, skips constexprs, and at each launch the
    addresses of the tensors of the given slots, one tensor read once for all its parameters."""
    direct = _direct(monkeypatch, [8, 8, 4, 8, 4, 1, 8, 8, 8])  # two scratch pointers after the arguments
    assert direct is not None and len(direct.params) == 9
    scalars = [v for v in direct.values if v is not None]
    assert [type(v) for v in scalars] == [ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_int8,
                                          ctypes.c_uint64, ctypes.c_uint64]
    assert [v.value for v in scalars[:4]] == [500, 2**40, 0.5, 1] and direct.slots == [0, 2]
    launched = []

    def cu_launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        read = lambda kind, i: kind.from_address(params[i]).value
        launched.append(([read(ctypes.c_uint64, i) for i in (0, 1, 6, 7, 8)], read(ctypes.c_int64, 3),
                         (gx.value, bx.value, shared.value), stream))
        return 0

    monkeypatch.setattr(launch, "_cu_launch_kernel", lambda: cu_launch_kernel)
    monkeypatch.setattr(launch, "_launch_hooks", lambda: False)
    monkeypatch.setattr(launch, "ensure_context", lambda device: None)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 77)
    a, b = torch.zeros(4), torch.zeros(4)
    direct([b, None, a], fallback=None)
    direct([a, None, b], fallback=None)
    assert launched == [([a.data_ptr(), b.data_ptr(), a.data_ptr(), 0, 0], 2**40, (3, 128, 1024), 77),
                        ([b.data_ptr(), a.data_ptr(), b.data_ptr(), 0, 0], 2**40, (3, 128, 1024), 77)]
    monkeypatch.setattr(launch, "_launch_hooks", lambda: True)  # a hook installed: through Triton
    direct([a, None, b], fallback=lambda: launched.append("through triton"))
    assert launched[-1] == "through triton"


@pytest.mark.parametrize(("sizes", "metadata", "why"), [
    ([8, 8, 4, 8, 4, 1, 8], {"global_scratch_size": 64}, "scratch memory"),
    ([8, 8, 4, 8, 4, 1, 8], {"num_ctas": 2}, "a cluster"),
    ([8, 8, 4, 4, 4, 1, 8], {}, "a parameter of another size than its type's"),
    ([8, 8, 4, 8, 4, 1], {}, "fewer parameters than arguments"),
    ([8, 8, 4, 8, 4, 1, 8, 8, 8, 8], {}, "more than two parameters after them"),
    (None, {}, "a driver without cuFuncGetParamInfo"),
])
def test_what_a_direct_launch_cannot_take_keeps_tritons_runner(monkeypatch, sizes, metadata, why):
    assert _direct(monkeypatch, sizes, **metadata) is None, why


def test_a_direct_launch_takes_only_tensors_for_pointers(monkeypatch):
    sizes = [8, 8, 4, 8, 4, 1, 8]
    assert _direct(monkeypatch, sizes, values=(1234, 0, 500, 2**40, 0.5, True, 128, 0)) is None  # an address
    assert _direct(monkeypatch, sizes, signature={**_SIGNATURE, "n": "bf16"}) is None  # a type it does not pack
    # a tensor descriptor the recorder did not name (a tensor of unknown origin, say)
    assert _direct(monkeypatch, sizes, signature={**_SIGNATURE, "x_ptr": "tensordesc<fp32[64, 64]>"}) is None


@requires_gpu
def test_gpu_a_direct_launch_runs_the_kernel_on_new_tensors():
    """The direct launch of a compiled kernel, built from one launch's arguments, computes on other tensors what
    Triton's launch computes; an empty grid launches nothing."""
    x = torch.randn(1000, device="cuda")
    y = torch.zeros_like(x)
    compiled = _scaled_copy[(8,)](x, y, 1000, 1, 2.0, BLOCK=128)
    slot = type("Slot", (int,), {})
    direct = launch.DirectLaunch.of(compiled, (8, 1, 1), (slot(0), slot(1), 1000, 1, 2.0, 128),
                                    lambda v: type(v) is slot, device=torch.cuda.current_device())
    assert direct is not None
    a = torch.randn(1000, device="cuda")
    b = torch.full_like(a, float("nan"))
    direct([a, b], fallback=None)
    torch.testing.assert_close(b, a * 2, rtol=0, atol=0)
    empty = launch.DirectLaunch.of(compiled, (0, 1, 1), (slot(0), slot(1), 1000, 1, 2.0, 128),
                                   lambda v: type(v) is slot, device=torch.cuda.current_device())
    c = torch.full_like(a, float("nan"))
    empty([a, c], fallback=None)
    assert c.isnan().all()
