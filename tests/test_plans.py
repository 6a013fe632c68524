"""Call plans (``ops/plans.py``): a replayed call must do what the implementation would have done on its arguments.

On the CPU the recorder is driven directly, with a stand-in for a kernel launch; on a GPU the public functions are
called until their plans replay, and every replay is compared bitwise with the implementation run afresh."""

import dataclasses
import re
import threading
from pathlib import Path

import pytest
import torch
from conftest import capture_cuda_graph, requires_gpu, uniform_batch
from torch.utils._python_dispatch import _disable_current_modes

import blockattn
from blockattn import backends, custom_ops
from blockattn.ops import launch, plans
from blockattn.reference import quantised_fp8, random_angles


def _kernel(out, x, factor):
    """Stands in for a compiled kernel: writes ``x * factor`` into ``out`` without an ATen op the recorder sees."""
    with _disable_current_modes():
        out.copy_(x * factor)


def _launch(runner, *values):
    """What ``launch.launch`` does around a compiled kernel: launch it, then report it to the recorder."""
    runner(*values)
    if (recorder := getattr(launch.RECORDING, "recorder", None)) is not None:
        recorder.launched(runner, values, None)


def _scaled(x, factor):
    """An implementation made of what plans replay: an allocation, a view, a fill, a launch; returns a nested
    result."""
    out = torch.empty(x.shape[0] // 2, 2, dtype=x.dtype)
    flat = out.view(-1)
    spare = torch.empty(3).fill_(7.0)
    _launch(_kernel, flat, x, factor)
    return out, (spare, None, factor)


def test_a_plan_replays_allocations_views_fills_and_launches_on_new_arguments():
    x = torch.arange(8.0)
    result, plan = plans._record(_scaled, (x, 3.0))
    assert isinstance(plan, plans.Plan)
    # empty, view, empty, fill_, the launch: no detached alias of an allocation (the recorder holds none)
    assert len(plan.steps) == 5
    torch.testing.assert_close(result[0], (x * 3).view(4, 2))
    y = torch.randn(8)
    out, (spare, none, factor) = plan((y, 3.0))
    assert torch.equal(out, (y * 3).view(4, 2)) and out.shape == (4, 2)
    assert torch.equal(spare, torch.full((3,), 7.0)) and none is None and factor == 3.0
    assert out.data_ptr() != result[0].data_ptr()  # a new allocation each replay


def _factories_and_views(x):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_strided((2, 3), (1, 2)),
            torch.empty_like(x, dtype=torch.float16), torch.zeros(3, dtype=torch.int32), torch.zeros_like(x),
            torch.full((2,), 3.5), x.new_empty((4,)), x.new_zeros((2, 2)), x.view(4, 6),
            torch._assert_async(x.new_zeros((), dtype=torch.bool).fill_(True), "a message"))


def test_factories_and_views_replay_by_their_public_functions():
    """Plans replay these overloads by ``torch.empty`` & co. (less host time): the same tensors as recorded."""
    recorded, plan = plans._record(_factories_and_views, (torch.arange(24.0),))
    assert isinstance(plan, plans.Plan) and len(plan.steps) == 12  # the assertion: its operand, a fill, itself
    y = torch.randn(24)
    replayed = plan((y,))
    assert replayed[9] is None
    for want, got in zip(recorded[:9], replayed):
        assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)
    assert not replayed[3].any() and not replayed[4].any() and not replayed[7].any()
    assert torch.equal(replayed[5], torch.full((2,), 3.5))
    assert replayed[8].data_ptr() == y.data_ptr() and torch.equal(replayed[8], y.view(4, 6))


@dataclasses.dataclass
class _Descriptor:
    base: object
    shape: list


@dataclasses.dataclass(slots=True)
class _SlottedDescriptor:
    base: object
    shape: list


@pytest.mark.parametrize("cls", [_Descriptor, _SlottedDescriptor])
def test_a_host_descriptor_is_cloned_on_a_new_base(cls):
    recorded = cls(None, [4, 8])
    clone = plans._on_base(recorded, "new base")
    assert type(clone) is cls and clone.base == "new base" and clone.shape == [4, 8] and recorded.base is None


def test_a_plan_passes_an_argument_given_twice_once_per_position():
    def copy_into(dst, src):
        _launch(_kernel, dst, src, 1.0)
        return dst

    x = torch.zeros(4)
    y = torch.arange(4.0)
    _, plan = plans._record(copy_into, (x, y))
    a, b = torch.zeros(4), torch.ones(4)
    assert plan((a, b)) is a and torch.equal(a, b)


@pytest.mark.parametrize(("implementation", "why"), [
    (lambda x: x * 2, "runs aten.mul"),  # an op that computes
    (lambda x: (torch.empty(2), x.sum()), "runs aten.sum"),
    (lambda x: _launch(_kernel, _CONSTANT, x[:4], 1.0), "neither an argument nor made by the call"),
    (lambda x: torch.cat([x, x]), "runs aten.cat"),
])
def test_what_a_plan_cannot_replay_gets_no_plan(implementation, why):
    _, plan = plans._record(implementation, (torch.arange(8.0),))
    assert isinstance(plan, plans.NoPlan) and why in plan


_CONSTANT = torch.zeros(4)


def test_a_result_of_unknown_origin_gets_no_plan():
    _, plan = plans._record(lambda x: _CONSTANT, (torch.zeros(1),))
    assert isinstance(plan, plans.NoPlan) and plan.startswith("returns")


def test_a_launch_in_the_interpreter_gets_no_plan():
    recorder = plans._Recorder(())
    recorder.refuse("launches a kernel in Triton's interpreter")
    recorder.refuse("another reason")
    assert recorder.failure == "launches a kernel in Triton's interpreter"


def test_every_kernel_launch_goes_through_launch():
    """A plan replays the launches ``launch.launch`` reported while recording: a kernel launched as
    ``kernel[grid](...)`` anywhere else would be missing from every replay (its results never written)."""
    direct = re.compile(r"\w*kernel\[[^\]]*\]\(")
    package = Path(blockattn.__file__).parent
    found = [f"{path.relative_to(package)}:{number}: {line.strip()}"
             for path in sorted(package.rglob("*.py")) if path.name != "launch.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if direct.search(line.split("#")[0])]
    assert not found, found
    assert direct.search("    _flash_fwd_kernel[grid](**args)")  # what it looks for


def test_cpu_calls_are_not_planned():
    """Off the GPU the implementations always run (Triton's interpreter or PyTorch): nothing is recorded."""
    q = torch.randn(70, 2, 16)
    offsets = torch.tensor([0, 30, 70])
    for _ in range(3):
        blockattn.block_attention(q, q, q, offsets)
    assert not custom_ops._block_attention_forward.plans


# --------------------------------------------------------------------------------------------------------------------
# GPU: the public functions, replayed against the implementations run afresh.
# --------------------------------------------------------------------------------------------------------------------

def _replays_match(call, make_inputs, planned_fns, expect_plan=True):
    """Calls ``call`` on three fresh input sets of one signature (the third replays a plan where one was made),
    then runs the third set again with no plan: the results must be bitwise equal."""
    plans.forget()
    results = []
    for _ in range(3):
        inputs = make_inputs()
        results.append(call(*inputs))
    made = [p for fn in planned_fns for p in fn.plans.values()]
    assert any(isinstance(p, plans.Plan) for p in made) == expect_plan, made
    plans.forget()
    again = call(*inputs)
    for replayed, fresh in zip(results[-1], again):
        assert replayed.shape == fresh.shape and replayed.dtype == fresh.dtype
        assert torch.equal(replayed.view(torch.uint8), fresh.view(torch.uint8))


def _block_fwd_bwd(layout_or_offsets, **options):
    def call(q, k, v, do, sinu):
        args = [t.detach().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*args, layout_or_offsets, sinu_pos=sinu, **options)
        return (out, *torch.autograd.grad(out, args, do))
    return call


@requires_gpu
@pytest.mark.parametrize("hq, hkv, d, block_size", [(4, 4, 128, 64), (8, 2, 64, 64), (4, 1, 32, 64),
                                                   (4, 2, 256, 128)])  # the last: Triton's backward on Hopper
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("layout", [False, True])
def test_gpu_block_attention_replays(hq, hkv, d, block_size, rotary, layout):
    n, offsets, randn = uniform_batch(3, 150, d)
    structure = blockattn.block_layout(offsets, n, block_size) if layout else offsets
    angles = random_angles(n, d, "cuda") if rotary else None
    options = {} if layout else {"block_size": block_size}
    _replays_match(_block_fwd_bwd(structure, **options),
                   lambda: (randn(hq), randn(hkv), randn(hkv), randn(hq), angles),
                   [custom_ops._block_attention_forward, custom_ops._block_attention_backward])


@requires_gpu
@pytest.mark.parametrize("options", [{"causal": True}, {"dropout_p": 0.2}])
def test_gpu_block_attention_options_replay(options):
    """Dropout: each call draws its seed, so a replay must use the new one (the same seed again for the fresh
    run)."""
    _, offsets, randn = uniform_batch(2, 100, 64)
    call = _block_fwd_bwd(offsets, **options)

    def seeded(*inputs):
        torch.manual_seed(0)
        return call(*inputs)
    _replays_match(seeded, lambda: (randn(4), randn(2), randn(2), randn(4), None),
                   [custom_ops._block_attention_forward, custom_ops._block_attention_backward])


@requires_gpu
def test_gpu_a_replay_with_dropout_draws_a_new_mask():
    _, offsets, randn = uniform_batch(2, 100, 64)
    q = randn(4)
    outs = [blockattn.block_attention(q, q, q, offsets, dropout_p=0.5) for _ in range(4)]
    assert any(isinstance(p, plans.Plan) for p in custom_ops._block_attention_forward.plans.values())
    assert not torch.equal(outs[2], outs[3])


@requires_gpu
def test_gpu_packed_projection_replays():
    n, offsets, _ = uniform_batch(2, 130, 64)
    w = torch.randn(96, (4 + 2 * 2) * 64, device="cuda", dtype=torch.bfloat16) * 0.1

    def call(x, do):
        x = x.detach().requires_grad_()
        out = blockattn.qkv_block_attention(x, w, offsets, num_heads=4, num_kv_heads=2)
        return (out, *torch.autograd.grad(out, x, do))
    _replays_match(call, lambda: (torch.randn(n, 96, device="cuda", dtype=torch.bfloat16),
                                  torch.randn(n, 4, 64, device="cuda", dtype=torch.bfloat16)),
                   [custom_ops._qkv_block_attention_forward, custom_ops._qkv_block_attention_backward])


@requires_gpu
def test_gpu_fp8_block_attention_replays():
    _, offsets, randn = uniform_batch(2, 130, 64)

    def inputs():
        return (*quantised_fp8(randn(4)), *quantised_fp8(randn(2)), *quantised_fp8(randn(2)))

    def call(q, qs, k, ks, v, vs):
        return (blockattn.block_attention(q, k, v, offsets, q_descale=qs, k_descale=ks, v_descale=vs),)
    _replays_match(call, inputs, [custom_ops._block_attention_forward])


@requires_gpu
@pytest.mark.parametrize("variant", ["auto", "pipelined"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_flash_attention_replays(dtype, causal, varlen, variant):
    shape = (300, 4, 128) if varlen else (2, 150, 4, 128)
    cu = torch.tensor([0, 100, 100, 300], device="cuda", dtype=torch.int32)

    def inputs():
        ts = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        if dtype == torch.bfloat16:
            return (*ts, None, None, None)
        (q, qs), (k, ks), (v, vs) = (quantised_fp8(t) for t in ts)
        return q, k, v, qs, ks, vs

    def call(q, k, v, qs, ks, vs):
        scales = {"q_descale": qs, "k_descale": ks, "v_descale": vs, "variant": variant}
        if varlen:
            return blockattn.flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=200, causal=causal,
                                                    return_lse=True, **scales)
        return blockattn.flash_attention(q, k, v, causal=causal, return_lse=True, **scales)
    _replays_match(call, inputs, [custom_ops._flash_attention_fwd])


@requires_gpu
def test_gpu_backward_with_the_group_split_replays():
    """The Triton backward at 128-token blocks past D = 128 under GQA, whose query heads' shares of dk and dv a
    kernel of ours adds up (``splits_group``; ``torch.sum`` there made the backward unplannable), replays a plan,
    bitwise as a fresh run."""
    _, offsets, randn = uniform_batch(3, 150, 256)

    def call(q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*leaves, offsets, block_size=128)
        return (out, *torch.autograd.grad(out, leaves, do))

    for _ in range(3):
        call(randn(4), randn(2), randn(2), randn(4))
    recorded = list(custom_ops._block_attention_backward.plans.values())
    assert recorded and all(isinstance(p, plans.Plan) for p in recorded), recorded
    inputs = (randn(4), randn(2), randn(2), randn(4))
    replayed = call(*inputs)
    plans.forget()
    for got, want in zip(replayed, call(*inputs)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@requires_gpu
def test_gpu_replayed_launches_go_direct_but_to_a_launch_hook():
    """A replayed forward launches its Triton kernel by ``cuLaunchKernel`` (``launch.DirectLaunch``) with the recorded
    kernel, grid and arguments on the new tensors (one: on three sequences it finds its blocks without a table), and
    so does the backward its kernel, on Hopper a Gluon kernel that finds its blocks too, whose host tensor
    descriptors' maps are encoded on the new tensors (elsewhere the Triton backward, and its table's kernel). While
    a Triton launch hook (a profiler's) is installed, through Triton, which calls it. All bitwise as a fresh run."""
    from triton import knobs

    _, offsets, randn = uniform_batch(3, 150, 128)

    def call(q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*leaves, offsets)
        return (out, *torch.autograd.grad(out, leaves, do))

    for _ in range(3):
        call(randn(4), randn(4), randn(4), randn(4))
    forward, backward = (next(p for p in fn.plans.values() if isinstance(p, plans.Plan))
                         for fn in (custom_ops._block_attention_forward, custom_ops._block_attention_backward))
    assert sum(hasattr(step, "direct") for step in forward.steps) == 1
    directs = [step.direct for step in backward.steps if hasattr(step, "direct")]
    hopper = torch.cuda.get_device_capability()[0] == 9 and backends.sm90_ops is not None
    assert len(directs) == (1 if hopper else 2)
    if hopper:
        assert directs[0].maps
    inputs = (randn(4), randn(4), randn(4), randn(4))
    replayed = call(*inputs)
    launched = []
    hooks = knobs.runtime.launch_enter_hook
    hooks.add(launched.append)  # a HookChain in the triton versions that have direct launches
    try:
        hooked = call(*inputs)
    finally:
        hooks.remove(launched.append)
    assert len(launched) >= 1 + len(directs)
    plans.forget()
    fresh = call(*inputs)
    for got_replayed, got_hooked, want in zip(replayed, hooked, fresh):
        assert torch.equal(got_replayed.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_hooked.view(torch.uint8), want.view(torch.uint8))


@requires_gpu
def test_gpu_one_plan_replayed_on_several_threads_at_once():
    """Threads replaying one plan share its launches' parameter buffers: each launch must still get its own
    tensors (bitwise as the implementation run afresh on them)."""
    _, offsets, randn = uniform_batch(3, 150, 128)
    layout = blockattn.block_layout(offsets, 450)
    batches = [[(randn(4), randn(4), randn(4)) for _ in range(20)] for _ in range(4)]
    for q, k, v in batches[0][:3]:
        blockattn.block_attention(q, k, v, layout)
    outputs = [[] for _ in batches]

    def replay(i):
        for q, k, v in batches[i]:
            outputs[i].append(blockattn.block_attention(q, k, v, layout))

    threads = [threading.Thread(target=replay, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for batch, got in zip(batches, outputs):
        assert len(got) == len(batch)
        for (q, k, v), out in zip(batch, got):
            plans.forget()  # each reference call runs the implementation
            assert torch.equal(out, blockattn.block_attention(q, k, v, layout))


class _Subclass(torch.Tensor):
    pass


def test_signatures_tell_apart_shapes_alignment_aliasing_types_and_the_current_device(monkeypatch):
    device = [0]
    monkeypatch.setattr(plans._signature, "context", lambda: device[0])
    monkeypatch.setattr(plans._signature, "functions", {})
    x = torch.randn(64)
    key = plans._signature
    assert key((x, 1.0)) != key((x[1:65 - 1], 1.0))  # shape
    assert key((x[:32], 1.0)) != key((x[1:33], 1.0))  # 16-byte alignment
    assert key((x[:32], 1.0)) == key((x[32:], 1.0))
    assert key((x.view(8, 8), None)) != key((x.view(8, 8).t(), None))  # strides
    assert key((x, None)) != key((x.half(), None))  # dtype
    assert key((x, x)) != key((x, x.clone()))  # one tensor twice against two tensors
    assert key((x, 1)) != key((x, 1.0)) != key((x, True)) != key((x, None))  # the type
    assert key((x, 2.0)) != key((x, 3.0))
    before = key((x, 1.0))
    device[0] = 1
    assert key((x, 1.0)) != before
    with pytest.raises(TypeError):  # the plan's caller runs the implementation as it is then
        key((x.as_subclass(_Subclass), 1.0))


@requires_gpu
def test_gpu_a_plan_replays_on_another_thread_and_under_graph_capture():
    """Recorded on this thread, replayed on a new one (a host descriptor's launch there needs the device's context
    made current) and inside a CUDA-graph capture (the replay's allocations and launches are captured)."""
    n, offsets, randn = uniform_batch(2, 150, 128)
    layout = blockattn.block_layout(offsets, n)
    q, k, v, do = (randn(4) for _ in range(4))

    def step():
        args = [t.detach().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*args, layout)
        return (out, *torch.autograd.grad(out, args, do))

    for _ in range(3):
        expected = step()
    assert all(isinstance(p, plans.Plan) for p in custom_ops._block_attention_backward.plans.values())
    on_thread = []
    worker = threading.Thread(target=lambda: on_thread.extend(step()))
    worker.start()
    worker.join()
    graph, captured = capture_cuda_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for got, thread_got, want in zip(captured, on_thread, expected):
        assert torch.equal(got, want) and torch.equal(thread_got, want)
