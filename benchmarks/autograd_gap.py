"""Where an eager backward's host time goes under autograd (1 x 500 tokens, H 4, D 128, bf16, a layout).

    python benchmarks/autograd_gap.py      # OUT=folder for autograd_gap.json and a profiler trace (default /tmp)

Times (µs per call, median and least of repeats of back-to-back calls, one synchronisation each):
- engine: ``autograd.grad(out, (q, k, v), do, retain_graph=True)``;
- direct: ``out.grad_fn.apply(do)`` on the main thread (the Function's backward without the engine);
- handoff: from ``autograd.grad``'s call to the backward's entry (on the engine's device thread), inside the
  backward, and from its exit to the return;
for blockattn's eager Function, FA2 varlen in an ``autograd.Function`` (as ``bench --latency`` runs it), an identity
Function and one whose backward launches one small kernel. Then a profiler trace of 20 engine calls.
"""
import json
import os
import statistics
import sys
import time

import torch
from profile_host import _Identity as Identity
from profile_host import per_call_us as per_call

import blockattn
from blockattn import custom_ops
from blockattn.bench.latency import _FlashVarlen

OUT = os.environ.get("OUT", "/tmp")


class Launches(Identity):
    """Identity whose backward allocates and launches one small kernel (``grad.clone()``)."""

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


STAMPS = {}


def stamped(cls, name):
    """``cls.backward`` timed: its entry and exit times go to ``STAMPS[name]``."""
    orig = cls.backward

    def backward(ctx, *grads):
        t1 = time.perf_counter()
        result = orig(ctx, *grads)
        t2 = time.perf_counter()
        STAMPS.setdefault(name, []).append((t1, t2))
        return result
    cls.backward = staticmethod(backward)


def handoff(name, fn_grad, calls=300):
    """Per call: grad-call -> backward entry, inside, backward exit -> return (µs, medians)."""
    for _ in range(30):
        fn_grad()
    torch.cuda.synchronize()
    STAMPS[name] = []
    before, after = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn_grad()
        t3 = time.perf_counter()
        before.append(t0)
        after.append(t3)
    torch.cuda.synchronize()
    stamps = STAMPS[name][-calls:]
    into = [(s[0] - b) * 1e6 for s, b in zip(stamps, before)]
    inside = [(s[1] - s[0]) * 1e6 for s in stamps]
    out = [(a - s[1]) * 1e6 for s, a in zip(stamps, after)]
    return statistics.median(into), statistics.median(inside), statistics.median(out)


def main():
    torch.manual_seed(0)
    n, h, d, bs = 500, 4, 128, 64
    q, k, v, do = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    offsets = torch.tensor([0, n], device="cuda")
    layout = blockattn.block_layout(offsets, n)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = blockattn.block_attention(*leaves, layout)
    cu = torch.tensor([0, 64, 128, 192, 256, 320, 384, 448, 500], device="cuda", dtype=torch.int32)
    fa_out = _FlashVarlen.apply(*leaves, cu, 64, d**-0.5)
    x = leaves[0]
    ident = Identity.apply(x)
    launches = Launches.apply(x)

    # The planned backward implementation's arguments: no angles (so nothing rotates), no in-block options.
    backward_args = (do, q, k, v, layout.offsets, None, *layout.table, bs, d**-0.5, 7, False, None, None, None,
                     0.301, 0.0, None, None)
    results = {}
    fns = {
        "blockattn engine (autograd.grad, retained)": lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
        "blockattn direct (grad_fn.apply)": lambda: out.grad_fn.apply(do),
        "blockattn planned bwd impl": lambda: custom_ops._block_attention_backward(*backward_args),
        "FA2 engine": lambda: torch.autograd.grad(fa_out, leaves, do, retain_graph=True),
        "FA2 direct": lambda: fa_out.grad_fn.apply(do),
        "identity engine": lambda: torch.autograd.grad(ident, x, do, retain_graph=True),
        "identity direct": lambda: ident.grad_fn.apply(do),
        "clone engine": lambda: torch.autograd.grad(launches, x, do, retain_graph=True),
        "clone direct": lambda: launches.grad_fn.apply(do),
        "blockattn fwd+bwd layout": lambda: torch.autograd.grad(blockattn.block_attention(*leaves, layout), leaves,
                                                                do),
        "FA2 fwd+bwd": lambda: torch.autograd.grad(_FlashVarlen.apply(*leaves, cu, 64, d**-0.5), leaves, do),
        "torch.add": lambda: q + 1,
    }
    for name, fn in fns.items():
        results[name] = per_call(fn)
        print(f"{name:48s} median {results[name][0]:8.1f}  min {results[name][1]:8.1f} µs", flush=True)

    stamped(custom_ops._EagerBlockAttention, "blockattn")
    stamped(_FlashVarlen, "FA2")
    stamped(Identity, "identity")
    stamped(Launches, "clone")
    for name, fn in (("blockattn", fns["blockattn engine (autograd.grad, retained)"]), ("FA2", fns["FA2 engine"]),
                     ("identity", fns["identity engine"]), ("clone", fns["clone engine"])):
        for _ in range(2):
            into, inside, back = handoff(name, fn)
            results[f"{name} handoff"] = (into, inside, back)
            print(f"{name:10s} call->backward {into:7.1f}  inside {inside:7.1f}  exit->return {back:7.1f} µs",
                  flush=True)
    # The same inside-time on the main thread.
    for name, fn in (("blockattn", fns["blockattn direct (grad_fn.apply)"]), ("FA2", fns["FA2 direct"])):
        STAMPS[name] = []
        for _ in range(330):
            fn()
        torch.cuda.synchronize()
        inside = statistics.median((s[1] - s[0]) * 1e6 for s in STAMPS[name][30:])
        print(f"{name:10s} inside on the main thread {inside:7.1f} µs", flush=True)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
        for _ in range(20):
            fns["blockattn engine (autograd.grad, retained)"]()
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(OUT, "autograd_gap_trace.json"))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    with open(os.path.join(OUT, "autograd_gap.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "python": sys.version, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
