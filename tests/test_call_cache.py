"""The call cache (``call_cache.py``): a public call repeated on one signature replays its op's plan at once, and
only where the slow way would have done the same.

On the CPU the cache's parts are driven directly (nothing is cached there: plans are GPU-only); on a GPU the public
functions are called until the cache replays them, each replay compared bitwise with a fresh run, and calls whose
metadata differ must take the slow way again (its checks included)."""

import pytest
import torch
from conftest import requires_gpu, uniform_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockattn
from blockattn import attention, call_cache, checks, custom_ops, flash
from blockattn.ops import plans
from blockattn.reference import random_angles
from blockattn.signatures import Signature


def _learning(replay_of):
    cache = call_cache.CallCache(replay_of)
    return cache, cache.calls


def test_a_learned_call_binds_its_arguments_to_the_op_inputs_and_replays():
    a, b = torch.randn(3), torch.randn(4)
    seen = []
    cache, calls = _learning(lambda inputs: lambda inputs: seen.append(inputs) or "replayed")
    cache.learn("key", (a, b, a, 3, None), (b, a, 7.0, None, "x", a))
    c, d = torch.randn(3), torch.randn(4)
    assert calls["key"]((c, d, c, 3, None)) == "replayed"
    got = seen[0]
    assert got[0] is d and got[1] is c and got[2:5] == (7.0, None, "x") and got[5] is c


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_the_binder_puts_each_tensor_where_the_learned_call_had_it(data):
    """Arguments of tensors (some passed twice) and values; op inputs drawn from them in any order, with constants:
    the binder, applied to new arguments of the same pattern, gives each input position the new tensor."""
    num_tensors = data.draw(st.integers(1, 4))
    tensor_refs = st.tuples(st.just("tensor"), st.integers(0, num_tensors - 1))
    pattern = data.draw(st.lists(st.one_of(tensor_refs, st.sampled_from([None, 3, 0.5, "x"])), min_size=1,
                                 max_size=8))
    passed = sorted({p for p in pattern if type(p) is tuple})
    picks = data.draw(st.lists(st.one_of(st.sampled_from(passed) if passed else st.nothing(),
                                         st.sampled_from([None, 7.0, True, "y"])), max_size=8))

    def realised(refs, tensors):
        return tuple(tensors[p[1]] if type(p) is tuple else p for p in refs)
    tensors = [torch.randn(2) for _ in range(num_tensors)]
    bind = call_cache._binder(call_cache._sources(realised(pattern, tensors), realised(picks, tensors)))
    fresh = [torch.randn(2) for _ in range(num_tensors)]
    got = bind(realised(pattern, fresh))
    assert len(got) == len(picks)
    for value, p in zip(got, picks):
        assert value is fresh[p[1]] if type(p) is tuple else (value == p and type(value) is type(p))


def test_a_call_whose_op_takes_a_tensor_it_was_not_given_always_runs_the_slow_way():
    """A dropout seed (drawn per call), a nested tensor's values: the cache cannot build such inputs."""
    asked = []
    cache, calls = _learning(lambda inputs: asked.append(inputs) or (lambda inputs: None))
    q = torch.randn(3)
    cache.learn("key", (q, 0.5), (q, torch.zeros(1)))
    assert calls["key"] is call_cache._SLOW and not asked
    cache.learn("key", (q, 0.5), (q, None))  # learned once: not asked again
    assert calls["key"] is call_cache._SLOW and not asked


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_tensor_without_strides_or_storage_has_no_signature():
    """A sparse tensor (on a GPU the cache's signature would read its strides and address) is a call the cache
    leaves to the public function, whose checks refuse it by name."""
    signature = Signature(call_cache._TENSOR_KEY, lambda: None)
    for sparse in (torch.zeros(2, 2).to_sparse(), torch.zeros(2, 2).to_sparse_csr()):
        with pytest.raises(TypeError, match="no signature"):
            signature((sparse,))
    assert signature((torch.zeros(2, 2),))[1]


def test_a_signature_is_learned_once_its_plan_is_recorded():
    state = [None]
    cache, calls = _learning(lambda inputs: state[0])
    q = torch.randn(3)
    cache.learn("key", (q,), (q,))
    assert "key" not in calls  # no plan yet: asked again on the next call
    state[0] = False
    cache.learn("key", (q,), (q,))
    assert calls["key"] is call_cache._SLOW
    cache.learn(None, (q,), (q,))  # no signature: nothing to learn
    assert list(calls) == ["key"]


def test_the_oldest_learned_signature_goes_first(monkeypatch):
    monkeypatch.setattr(call_cache, "MAX_CALLS", 3)
    cache, calls = _learning(lambda inputs: False)
    for key in range(5):
        cache.learn(key, (1,), (1,))
    assert list(calls) == [2, 3, 4]


def test_forgetting_the_checks_or_the_plans_forgets_the_calls():
    for forget in (checks.forget, plans.forget):
        cache, calls = _learning(lambda inputs: False)
        cache.learn("key", (1,), (1,))
        forget()
        assert not calls


def test_a_layout_enters_a_signature_field_by_field():
    offsets = torch.tensor([0, 70])
    layout = blockattn.block_layout(offsets, 70, 32)
    flat = attention._signed(layout)
    assert flat[0] is offsets and flat[1:3] == (70, 32) and flat[3] is layout.table.block_cum
    assert flat[4] is layout.table.block_seq and flat[5:] == (None,) * 4
    assert attention._signed(offsets) == (offsets,)
    with pytest.raises(TypeError):  # a hand-made layout whose table is no tuple: no signature
        hash(attention._signed(layout._replace(table=object())))


def test_cpu_calls_are_not_cached():
    q = torch.randn(70, 2, 16)
    offsets = torch.tensor([0, 30, 70])
    assert attention._BLOCK_ATTENTION_CALLS.lookup((q, q, q, offsets)) == (None, None)
    for _ in range(4):
        blockattn.block_attention(q, q, q, offsets)
    assert not attention._BLOCK_ATTENTION_CALLS.calls


# --------------------------------------------------------------------------------------------------------------------
# GPU: the public functions.
# --------------------------------------------------------------------------------------------------------------------

def _counting(monkeypatch, module, name):
    """Counts the calls of ``module.name`` (the slow way's op call)."""
    count = [0]
    op = getattr(module, name)

    def counted(*inputs):
        count[0] += 1
        return op(*inputs)
    monkeypatch.setattr(module, name, counted)
    return count


def _bitwise(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def _cached_then_fresh(call, make_inputs, slow_calls, cache, calls=5):
    """``calls`` calls of one signature: from the third on (the second recorded the plan), no slow call and a learned
    replay; the last one's result bitwise that of the slow way run afresh on its inputs."""
    for i in range(calls):
        inputs = make_inputs()
        before = slow_calls[0]
        got = call(*inputs)
        assert (slow_calls[0] == before) == (i >= 2), i
    assert any(callable(replay) and replay is not call_cache._SLOW for replay in cache.calls.values())
    plans.forget()
    _bitwise(got, call(*inputs))


@requires_gpu
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_gpu_block_attention_replays_from_the_call_cache(monkeypatch, hq, hkv, d, rotary, layout, grad):
    n, offsets, randn = uniform_batch(3, 150, d)
    structure = blockattn.block_layout(offsets, n) if layout else offsets
    angles = random_angles(n, d, "cuda") if rotary else None
    slow = _counting(monkeypatch, custom_ops, "block_attention")

    def call(q, k, v, do):
        if not grad:
            return (blockattn.block_attention(q, k, v, structure, sinu_pos=angles),)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*leaves, structure, sinu_pos=angles)
        return (out, *torch.autograd.grad(out, leaves, do))
    _cached_then_fresh(call, lambda: (randn(hq), randn(hkv), randn(hkv), randn(hq)), slow,
                       attention._BLOCK_ATTENTION_CALLS)


@requires_gpu
def test_gpu_the_backward_of_a_replay_finds_its_plan_by_grad_out():
    """The backward of a forward replayed from the call cache finds its plan by ``grad_out``'s metadata, kept with
    the forward's plan: one for each layout of ``grad_out`` (a strided one gets its own), each result bitwise the
    slow way's."""
    plans.forget()
    n, offsets, randn = uniform_batch(2, 128, 64)
    layout = blockattn.block_layout(offsets, n)
    q, k, v = randn(4), randn(2), randn(2)

    def call(do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = blockattn.block_attention(*leaves, layout)
        return (out, *torch.autograd.grad(out, leaves, do))
    contiguous = randn(4)
    strided = torch.randn(n, 4, 128, device="cuda", dtype=torch.bfloat16)[..., :64]
    for _ in range(4):
        got = call(contiguous)
    (forward_plan,) = [p for p in custom_ops._block_attention_forward.plans.values() if isinstance(p, plans.Plan)]
    assert len(forward_plan.backward_plans) == 1
    for _ in range(4):
        got_strided = call(strided)
    assert len(forward_plan.backward_plans) == 2
    plans.forget()
    _bitwise(got, call(contiguous))
    _bitwise(got_strided, call(strided))


@requires_gpu
def test_gpu_packed_projection_replays_from_the_call_cache(monkeypatch):
    n, offsets, _ = uniform_batch(2, 130, 64)
    layout = blockattn.block_layout(offsets, n)
    w = torch.randn(96, (4 + 2 * 2) * 64, device="cuda", dtype=torch.bfloat16) * 0.1
    bias = torch.randn((4 + 2 * 2) * 64, device="cuda", dtype=torch.bfloat16)
    slow = _counting(monkeypatch, custom_ops, "qkv_block_attention")

    def call(x, do):
        x = x.detach().requires_grad_()
        out = blockattn.qkv_block_attention(x, w, layout, num_heads=4, num_kv_heads=2, bias=bias)
        return (out, *torch.autograd.grad(out, x, do))
    _cached_then_fresh(call, lambda: (torch.randn(n, 96, device="cuda", dtype=torch.bfloat16),
                                      torch.randn(n, 4, 64, device="cuda", dtype=torch.bfloat16)), slow,
                       attention._QKV_BLOCK_ATTENTION_CALLS)


@requires_gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_flash_attention_replays_from_the_call_cache(monkeypatch, varlen):
    shape = (300, 4, 128) if varlen else (2, 150, 4, 128)
    cu = torch.tensor([0, 100, 100, 300], device="cuda", dtype=torch.int32)
    slow = _counting(monkeypatch, custom_ops, "flash_attention")

    def call(q, k, v):
        if varlen:
            return blockattn.flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=200, causal=True, return_lse=True)
        return (blockattn.flash_attention(q, k, v),)
    _cached_then_fresh(call, lambda: [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)],
                       slow, flash._CALLS)


@requires_gpu
def test_gpu_other_metadata_takes_the_slow_way_and_is_right(monkeypatch):
    """Grad mode, ``requires_grad``, strides, 16-byte alignment and dtype each make another signature: such a call
    runs the slow way (checks, dispatcher, a plan of its own), and its result is the slow way's."""
    n, offsets, randn = uniform_batch(2, 128, 64)
    layout = blockattn.block_layout(offsets, n)
    q, k, v = randn(4), randn(4), randn(4)
    slow = _counting(monkeypatch, custom_ops, "block_attention")
    for _ in range(4):
        blockattn.block_attention(q, k, v, layout)
    learned = slow[0]
    wide = torch.randn(n, 4, 72, device="cuda", dtype=torch.bfloat16)
    shifted = torch.randn(n * 4 * 64 + 4, device="cuda", dtype=torch.bfloat16)[4:].view(n, 4, 64)  # 8 bytes off
    variants = {
        "requires_grad": lambda: blockattn.block_attention(q.detach().requires_grad_(), k, v, layout),
        "grad mode off": lambda: _no_grad(lambda: blockattn.block_attention(q, k, v, layout)),
        "strides": lambda: blockattn.block_attention(wide[..., :64], k, v, layout),
        "alignment": lambda: blockattn.block_attention(shifted, k, v, layout),
        "dtype": lambda: blockattn.block_attention(q.half(), k.half(), v.half(), layout),
    }
    for name, variant in variants.items():
        before = slow[0]
        got = variant().detach()
        assert slow[0] == before + 1, name
        plans.forget()
        want = variant().detach()
        assert torch.equal(got, want), name
    assert slow[0] == learned + 2 * len(variants)


def _no_grad(fn):
    with torch.no_grad():
        return fn()


@requires_gpu
def test_gpu_refused_arguments_are_refused_after_a_learned_call():
    """The signature holds which arguments are one tensor: a layout's timestamps passed as the call's own are
    accepted, another tensor with their metadata is refused (checks.layout_time_bias), learned call or not."""
    n, offsets, randn = uniform_batch(2, 128, 64)
    stamps = torch.arange(n, device="cuda", dtype=torch.int64)
    layout = blockattn.block_layout(offsets, n, timestamps=stamps, num_time_buckets=8)
    time_bias = torch.zeros(4, 8, device="cuda")
    q = randn(4)
    for _ in range(4):
        blockattn.block_attention(q, q, q, layout, time_bias=time_bias, timestamps=stamps)
    assert any(replay is not call_cache._SLOW for replay in attention._BLOCK_ATTENTION_CALLS.calls.values())
    with pytest.raises(ValueError, match="timestamps differ"):
        blockattn.block_attention(q, q, q, layout, time_bias=time_bias, timestamps=stamps.clone())


@requires_gpu
def test_gpu_calls_with_dropout_always_run_the_slow_way(monkeypatch):
    _, offsets, randn = uniform_batch(2, 100, 64)
    q = randn(4)
    slow = _counting(monkeypatch, custom_ops, "block_attention")
    outs = [blockattn.block_attention(q, q, q, offsets, dropout_p=0.5) for _ in range(5)]
    assert slow[0] == 5 and not torch.equal(outs[3], outs[4])
    assert list(attention._BLOCK_ATTENTION_CALLS.calls.values()) == [call_cache._SLOW]


@requires_gpu
def test_gpu_the_packed_projection_under_autocast_takes_the_slow_way(monkeypatch):
    """The projection runs before the op, in the dtype autocast picks: a call learned without autocast must not
    replay its bf16 plan on the fp16 projection autocast makes of the same bf16 inputs."""
    n, offsets, _ = uniform_batch(2, 130, 64)
    layout = blockattn.block_layout(offsets, n)
    x = torch.randn(n, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, (4 + 2 * 2) * 64, device="cuda", dtype=torch.bfloat16) * 0.1
    slow = _counting(monkeypatch, custom_ops, "qkv_block_attention")

    def call():
        return blockattn.qkv_block_attention(x, w, layout, num_heads=4, num_kv_heads=2)
    for _ in range(3):
        call()
    assert slow[0] == 2
    with torch.autocast("cuda", dtype=torch.float16):
        got = call()
        assert slow[0] == 3 and got.dtype == torch.float16
        plans.forget()
        want = call()
    assert torch.equal(got, want)
