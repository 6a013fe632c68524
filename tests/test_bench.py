"""The benchmark harness and command line (timings themselves only on a GPU; the logic around them runs here with
stand-in timers, runners and reports)."""

import importlib.util
import io
import itertools
import json
import math
import sys
import types

import pytest
import torch
from conftest import HAS_GPU, make_offsets, random_angles, requires_gpu

from blockattn.__main__ import build_parser, main, make_console, print_report, workloads_from_args
from blockattn.bench import dense, harness, latency, sweep
from blockattn.bench import options as options_bench
from blockattn.bench.baselines import (
    BASELINES,
    NEEDS,
    QKV_IMPLS,
    QKV_REFERENCE,
    ROTARY_IMPLS,
    ROTARY_REFERENCE,
    Case,
    Runner,
    Unavailable,
    blockattn_runner,
    flex_block_mask,
    heads_first,
    padded_sdpa_runner,
    why_not_here,
)
from blockattn.bench.presets import PRESETS, Workload, lengths_for_sparsity
from blockattn.reference import block_attention_reference, snr_db


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_cli_defaults_and_presets():
    args = parse()
    assert [w.name for w in workloads_from_args(args)] == ["ads"]
    assert args.passes == "all"
    args = parse("--preset", "ads", "ads-d64", "short", "--pass", "bwd", "--dtype", "float16")
    chosen = workloads_from_args(args)
    assert [w.name for w in chosen] == ["ads", "ads-d64", "short"]
    assert all(w.dtype == "float16" for w in chosen)
    with pytest.raises(SystemExit):
        parse("--preset", "nope")


def test_cli_custom_workload():
    args = parse("--seqs", "10", "--max-len", "1000", "--sparsity", "0.7", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "64", "--block-size", "32")
    (w,) = workloads_from_args(args)
    assert (w.num_seqs, w.min_len, w.max_len, w.heads, w.kv_heads, w.head_dim, w.block_size) == (
        10, 400, 1000, 4, 2, 64, 32)
    (w,) = workloads_from_args(parse("--seqs", "2", "--max-len", "100", "--heads", "2", "--head-dim", "64",
                                     "--sparsity", "1"))
    assert set(w.lengths().tolist()) == {100}  # density 1: every sequence is max-len long


@pytest.mark.parametrize("argv,message", [
    (["--heads", "3", "--kv-heads", "2", "--seqs", "4", "--max-len", "100", "--head-dim", "64"],
     "--heads 3 must be a multiple of --kv-heads 2"),
    (["--sparsity", "2"], "argument --sparsity: must be in (0, 1]"),
    (["--sparsity", "0"], "argument --sparsity: must be in (0, 1]"),
    (["--max-len", "1"], "argument --max-len: must be >= 2, got 1"),
    (["--seqs", "0"], "argument --seqs: must be >= 1, got 0"),
    (["--seqs", "many"], "argument --seqs: expected an integer, got 'many'"),
    (["--heads", "0"], "argument --heads: must be >= 1"),
    (["--head-dim", "100"], "argument --head-dim: must be a multiple of 8 in [16, 256], got 100"),
    (["--head-dim", "512"], "argument --head-dim: must be a multiple of 8 in [16, 256], got 512"),
    (["--block-size", "48"], "argument --block-size: invalid choice: 48"),
    (["--rep-ms", "0"], "argument --rep-ms: must be >= 1, got 0"),
    (["--baselines", "FA2 varlen (aten)", "nope"], "argument --baselines: invalid choice: 'nope'"),
    (["--seqs", "10", "--max-len", "100", "--head-dim", "64"], "also needs --heads"),
    (["--sparsity", "0.5"], "a custom workload (--sparsity) also needs --seqs, --max-len, --heads, --head-dim"),
    (["--dense", "--options"], "--dense times its own shapes and passes; it takes no --options"),
    (["--latency", "--preset", "ads"], "--latency times its own shapes and passes; it takes no --preset"),
    (["--latency", "--options"], "--latency times its own shapes and passes; it takes no --options"),
    (["--dense", "--latency"], "--dense times its own shapes and passes; it takes no --latency"),
    (["--dense", "--pass", "bwd"], "--dense times its own shapes and passes; it takes no --pass"),
    (["--sweep", "--preset", "ads"], "--sweep times its own grid"),
    (["--sweep", "--heads", "4", "--rotary"], "it takes no --heads, --rotary"),
    (["--sweep", "--block-size", "48"], "argument --block-size: invalid choice: 48"),
    (["--sweep", "--pass", "fwdbwd"], "--sweep times the forward and the backward apart: --pass fwd, bwd or all"),
    (["--preset", "ads", "--dtype", "float8_e4m3fn"], "--dtype float8_e4m3fn applies to --sweep only"),
    (["--options", "--rotary"], "--options times its own baselines on the plain op; it takes no --rotary"),
    (["--options", "--preset", "ads", "short"], "--options times one workload, got 2"),
])
def test_cli_rejects_bad_flags_before_anything(argv, message, capsys):
    """Usage errors, exit status 2, whether or not there is a GPU: nothing runs first."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: blockattn bench" in err and message in err
    assert "Traceback" not in err


def test_cli_workload_errors_are_usage_errors(monkeypatch, capsys):
    """Whatever Workload itself rejects ends as a usage error too."""
    def refuse(**fields):
        raise ValueError("custom: lengths need 0 < min_len < max_len")

    monkeypatch.setattr("blockattn.__main__.Workload", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--seqs", "4", "--max-len", "100", "--heads", "2", "--head-dim", "64"])
    assert exit_info.value.code == 2
    assert "custom workload: custom: lengths need" in capsys.readouterr().err


def test_sparsity_is_a_density():
    assert lengths_for_sparsity(2000, 0.7) == (800, 2000)
    assert lengths_for_sparsity(8192, 0.5) == (1, 8192)
    assert lengths_for_sparsity(1000, 0.25) == (1, 500)
    assert lengths_for_sparsity(100, 1.0) == (100, 101)
    assert lengths_for_sparsity(2, 0.9) == (2, 3)
    with pytest.raises(ValueError):
        lengths_for_sparsity(100, 0.0)


@pytest.mark.parametrize(
    "name,lo,hi,mean,tokens",
    [("ads", 800, 2000, 1400, 1.61e6), ("ads-rotary", 1012, 2000, 1506, 1.74e6), ("ads-d64", 800, 2000, 1400, 1.61e6),
     ("long", 1, 8192, 4096, 4.72e6), ("short", 1, 307, 154, 0.63e6)],
)
def test_presets_match_the_documented_workloads(name, lo, hi, mean, tokens):
    lengths = PRESETS[name].lengths(seed=0).double()
    assert lengths.min() >= lo and lengths.max() < hi
    assert abs(lengths.mean().item() - mean) < 0.05 * mean
    assert abs(lengths.sum().item() - tokens) < 0.03 * tokens


def test_floor_bytes():
    # ads, N = 1.63 M, bf16, at an H200's 4.27 TB/s copy bandwidth -> 1.564 ms forward, 2.736 ms backward.
    w, n = PRESETS["ads"], 1_630_000
    floors = harness.floor_bytes(w, n)
    assert floors["fwd"] / 4.27e12 * 1e3 == pytest.approx(1.564, rel=0.01)
    assert floors["bwd"] / 4.27e12 * 1e3 == pytest.approx(2.736, rel=0.01)
    assert floors["fwdbwd"] == floors["fwd"] + floors["bwd"]


def small_case(dtype=torch.float32, device="cpu"):
    lengths = [0, 1, 63, 64, 65, 200, 3, 130]
    offsets = make_offsets(lengths, device)
    n = sum(lengths)
    q, do = (torch.randn(n, 4, 32, dtype=dtype, device=device) for _ in range(2))
    k, v = (torch.randn(n, 2, 32, dtype=dtype, device=device) for _ in range(2))
    projection = (torch.randn(n, 16, dtype=dtype), torch.randn(16, 8 * 32, dtype=dtype), torch.randn(8 * 32, dtype=dtype))
    return Case(q, k, v, do, offsets, 64, 1 / math.sqrt(32), random_angles(n, 32, dtype), projection)


@pytest.mark.parametrize("impls,reference", [(ROTARY_IMPLS, ROTARY_REFERENCE), (QKV_IMPLS, QKV_REFERENCE)],
                         ids=["rotary", "qkv"])
def test_rotary_and_projection_impls_agree(impls, reference):
    """The fused paths and their unfused counterparts compute the same thing (FA2 needs a GPU)."""
    case = small_case()
    assert reference in impls
    results = []
    for name, factory in impls.items():
        try:
            results.append(factory(case).check())
        except Unavailable:
            assert "FA2" in name  # CPU tensors: no FlashAttention
    assert len(results) >= 2
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert snr_db(got, want) > 100


def test_rotary_floor_adds_sinu_pos():
    w, n = PRESETS["ads-rotary"], 1000
    plain, rotary = harness.floor_bytes(w, n), harness.floor_bytes(w, n, rotary=True)
    for p in ("fwd", "bwd"):
        assert rotary[p] - plain[p] == n * w.head_dim * 2


def test_padded_sdpa_is_exact():
    """The padding/unpadding of the SDPA baselines, through the math back end (runs anywhere)."""
    case = small_case()
    ours = blockattn_runner(case).check()
    runner = padded_sdpa_runner(torch.nn.attention.SDPBackend.MATH)(case)
    for got, want in zip(runner.check(), ours):
        assert snr_db(got, want) > 100
    assert set(runner.extra) == {"pad q,k,v + unpad out", "pad do + unpad dq,dk,dv"}


def test_flex_block_mask_is_exact():
    from torch.nn.attention.flex_attention import flex_attention

    case = small_case()
    out = flex_attention(*(heads_first(t) for t in case.inputs), block_mask=flex_block_mask(case), scale=case.scale,
                         enable_gqa=True)
    assert snr_db(out.squeeze(0).transpose(0, 1), blockattn_runner(case).check()[0]) > 100


def segment_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """Attention within each ``cu_seqlens`` segment: what the packages' varlen functions compute."""
    return block_attention_reference(q, k, v, cu_seqlens, block_size=max_seqlen, scale=scale).to(q.dtype)


def fake_flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **unused):
    assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k and not causal and dropout_p == 0.0
    return segment_attention(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale)


class FakeBlockDiagonalMask:
    def __init__(self, seqlens):
        self.offsets = make_offsets(seqlens)

    @classmethod
    def from_seqlens(cls, seqlens):
        return cls(seqlens)


def fake_memory_efficient_attention(q, k, v, attn_bias, scale):
    assert q.dim() == 4 and q.shape[0] == 1
    return segment_attention(q[0], k[0], v[0], attn_bias.offsets, 64, scale)[None]


def fake_modules(name):
    """Stand-ins for the optional packages with their documented signatures (they are not installable here)."""
    if name == "xformers BlockDiagonalMask":
        ops, fmha, attn_bias = (types.ModuleType(m) for m in ("xformers.ops", "xformers.ops.fmha",
                                                               "xformers.ops.fmha.attn_bias"))
        ops.memory_efficient_attention = fake_memory_efficient_attention
        attn_bias.BlockDiagonalMask = FakeBlockDiagonalMask
        return {"xformers": types.ModuleType("xformers"), "xformers.ops": ops, "xformers.ops.fmha": fmha,
                "xformers.ops.fmha.attn_bias": attn_bias}
    module = {"flash_attn FA2": "flash_attn", "flash_attn FA3": "flash_attn_interface",
              "flash_attn FA4": "flash_attn.cute"}[name]
    fake = types.ModuleType(module)
    fake.flash_attn_varlen_func = fake_flash_attn_varlen
    return {module.split(".")[0]: types.ModuleType(module.split(".")[0]), module: fake}


@pytest.mark.parametrize("name", ["flash_attn FA2", "flash_attn FA3", "flash_attn FA4", "xformers BlockDiagonalMask"])
def test_optional_package_adapters(name, monkeypatch):
    """The adapters' wiring (one segment per block, scale, layout), checked against stand-in packages."""
    case = small_case()
    if name == "xformers BlockDiagonalMask":
        case = Case(case.q, case.k.repeat_interleave(2, 1), case.v.repeat_interleave(2, 1), case.do, case.offsets,
                    64, case.scale)
    fakes = fake_modules(name)
    if importlib.util.find_spec(next(iter(fakes))) is None:
        with pytest.raises(Unavailable, match="not installed"):
            BASELINES[name](case)
    for module, fake in fakes.items():
        monkeypatch.setitem(sys.modules, module, fake)
    runner = BASELINES[name](case)
    for got, want in zip(runner.check(), blockattn_runner(case).check()):
        assert snr_db(got, want) > 100


FAKE_ENV = {"device": "test device", "compute_capability": "9.0", "sm_count": 132, "torch": "2.x", "triton": "3.x",
            "date": "2026-01-01T00:00:00+00:00"}
CUDNN_ERROR = ("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true, but got "
               "false.")


def fake_report(workloads=("ads",), groups=("attention",), passes=("fwd",)):
    """A report as the harness writes it, with one failed and one unavailable implementation per group."""
    report = harness.Report(dict(FAKE_ENV), 3.0123)
    for w in workloads:
        report.workloads.append({"name": w, "implementations": {}})
        for g in groups:
            impls = [f"blockattn {g}", f"other {g}", f"FA2 {g}", "xformers", "SDPA cuDNN padded"]
            report.workloads[-1]["implementations"][g] = impls
            for p in passes:
                for impl, ms in zip(impls[:3], (1.2346, 12345.678, 2.5)):
                    report.results.append({
                        "workload": w, "group": g, "pass": p, "impl": impl, "ms": ms,
                        "quantiles_ms": {"p20": ms, "p50": ms, "p80": ms}, "peak_mib": 4321.0, "floor_ms": 1.0,
                        "x_floor": ms, "floor_tbps": 3.0 / ms, "speedup_vs_fa2": 2.5 / ms, "reference": f"FA2 {g}",
                        "checked_against": None if impl == impls[0] else impls[0],
                        "extra_ms": {"pad q,k,v + unpad out": 0.4321} if impl == f"other {g}" else {}})
            report.skipped.append({"workload": w, "group": g, "impl": "xformers", "status": "unavailable",
                                   "reason": "`xformers` is not installed (No module named 'xformers')"})
            report.skipped.append({"workload": w, "group": g, "impl": "SDPA cuDNN padded", "status": "failed",
                                   "reason": f"RuntimeError: {CUDNN_ERROR}"})
        report.accuracy += [
            {"workload": w, "impl": "blockattn", "tokens": 32000, "max_out": 0.0012, "max_dq": 0.1234,
             "max_dk": 0.0456, "max_dv": 0.0078, "mean_dq": 1.5e-3, "snr_dq_db": 51.25},
            {"workload": w, "impl": "FA2 varlen (aten)", "status": "failed", "reason": "OutOfMemoryError: CUDA out"}]
    return report


def printed(report) -> str:
    stream = io.StringIO()
    print_report(report, make_console(file=stream))
    return stream.getvalue()


def test_report_is_readable_in_a_log():
    """Printed to a file (no terminal), nothing is cut: no "…", every number in full, failures in their row."""
    text = printed(fake_report(workloads=("ads-rotary", "short"), groups=("attention", "rotary", "qkv"),
                               passes=("fwd", "bwd", "fwdbwd")))
    assert "…" not in text and "\x1b[" not in text  # nothing shortened, no colour codes in the log
    for number in ("1.235", "12345.678", "4321", "0.432", "1.23", "51.2", "3.01 TB/s", "2.02x"):
        assert number in text, number
    lines = text.splitlines()
    assert any("SDPA cuDNN padded" in line and "FAILED: RuntimeError: Expected mha_graph" in line for line in lines)
    assert any("xformers" in line and "unavailable: `xformers` is not installed" in line for line in lines)
    assert any("FA2 varlen (aten)" in line and "FAILED: OutOfMemoryError" in line for line in lines)
    assert max(map(len, lines)) <= 200


def test_dense_report_compares_fp8_with_the_same_kernel_in_bf16():
    """``bench --dense``: every row against its case's reference, our fp8 rows also against the same kernel in bf16
    (the fp8 target's baseline), and the printed notes say so; a missing bf16 row gives no figure."""
    cases = [{"case": "B4 S8192 D128", "reference": "SDPA cuDNN bf16"},
             {"case": "varlen long", "reference": "FA2 varlen bf16"}]
    rows = [{"case": "B4 S8192 D128", "impl": impl, "ms": ms, "tflops": 1000 / ms}
            for impl, ms in (("blockattn warp_specialized bf16", 3.0), ("blockattn warp_specialized fp8", 2.0),
                             ("blockattn pipelined fp8", 2.5), ("SDPA cuDNN bf16", 3.3))]
    rows.append({"case": "varlen long", "impl": "blockattn warp_specialized fp8", "ms": 4.0, "tflops": 250.0})
    dense.compare(rows, cases)
    by_impl = {(r["case"], r["impl"]): r for r in rows}
    fp8 = by_impl[("B4 S8192 D128", "blockattn warp_specialized fp8")]
    assert fp8["speedup_vs_bf16"] == pytest.approx(1.5) and fp8["speedup_vs_reference"] == pytest.approx(1.65)
    assert by_impl[("B4 S8192 D128", "blockattn pipelined fp8")]["speedup_vs_bf16"] is None  # no pipelined bf16
    assert "speedup_vs_bf16" not in by_impl[("B4 S8192 D128", "SDPA cuDNN bf16")]
    assert by_impl[("varlen long", "blockattn warp_specialized fp8")]["speedup_vs_reference"] is None
    stream = io.StringIO()
    dense.print_report({"environment": {"device": "GPU", "torch": "t", "triton": "tr", "date": "d"}, "cases": cases,
                        "results": rows, "skipped": []}, make_console(stream))
    line = next(line for line in stream.getvalue().splitlines() if "warp_specialized fp8" in line and "S8192" in line)
    assert "1.65x" in line and "1.50x our bf16" in line


def test_blockattn_failure_is_said_plainly():
    report = fake_report()
    report.skipped.append({"workload": "ads", "group": "attention", "impl": "blockattn", "status": "failed",
                           "reason": "RuntimeError: [1, 2] went wrong"})
    report.workloads.append({"name": "long", "failed": "OutOfMemoryError: CUDA out of memory."})
    text = printed(report)
    assert "FAILED: blockattn on ads (attention): RuntimeError: [1, 2] went wrong" in text
    assert "FAILED: workload long: OutOfMemoryError: CUDA out of memory." in text
    assert report.headline_failures() and not fake_report().headline_failures()


class NoProgress:
    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass

    def advance(self, *args, **kwargs):
        pass


@pytest.fixture
def fake_gpu(monkeypatch):
    """Stand-ins for what only a GPU measures: timings, CUDA graphs, peak memory, copy bandwidth, the
    environment."""
    def time_ms(fn, rep_ms):
        fn()
        return {"p20": 0.9, "p50": 1.0, "p80": 1.2}

    def peak_mib(fn):
        fn()
        return 64.0

    monkeypatch.setattr(harness, "time_ms", time_ms)
    monkeypatch.setattr(harness, "graphed", lambda fn: fn)
    monkeypatch.setattr(harness, "peak_mib", peak_mib)
    monkeypatch.setattr(harness, "environment", lambda: dict(FAKE_ENV))
    monkeypatch.setattr(harness, "copy_bandwidth_tbps", lambda rep_ms: 3.0)


def runner_of(results, check_error=None, fwd_error=None) -> Runner:
    def check():
        if check_error:
            raise check_error
        return results

    def fwd():
        if fwd_error:
            raise fwd_error

    return Runner(fwd=fwd, bwd=lambda: None, fwdbwd=lambda: None, check=check)


def raises(error):
    def factory(case):
        raise error

    return factory


def test_time_group_records_failures_and_goes_on(fake_gpu):
    case = small_case()
    good = [torch.ones(3, 2), torch.full((3, 2), 2.0)]
    factories = {
        "blockattn": lambda case: runner_of(good),
        "cuDNN": raises(RuntimeError(CUDNN_ERROR + "\nmore lines")),
        "oom in check": lambda case: runner_of(good, check_error=torch.OutOfMemoryError("CUDA out of memory.")),
        "oom in timing": lambda case: runner_of(good, fwd_error=torch.OutOfMemoryError("CUDA out of memory.")),
        "compile": raises(NotImplementedError()),
        "not here": raises(Unavailable("`xformers` is not installed")),
        "wrong": lambda case: runner_of([-t for t in good]),
        "FA2": lambda case: runner_of([t + 1e-4 for t in good]),
    }
    report = harness.Report(dict(FAKE_ENV), 3.0)
    harness._time_group(report, PRESETS["ads"], case, "attention", factories, "FA2", None, ["fwd", "bwd"], 10,
                        NoProgress(), 0)
    assert {(r["impl"], r["pass"]) for r in report.results} == {(i, p) for i in ("blockattn", "FA2")
                                                                for p in ("fwd", "bwd")}
    row = next(r for r in report.results if r["impl"] == "FA2")
    assert row["quantiles_ms"] == {"p20": 0.9, "p50": 1.0, "p80": 1.2} and row["ms"] == 1.0
    assert row["peak_mib"] == 64.0 and row["checked_against"] == "blockattn" and row["speedup_vs_fa2"] == 1.0
    status = {s["impl"]: (s["status"], s["reason"]) for s in report.skipped}
    assert status == {
        "cuDNN": ("failed", f"RuntimeError: {CUDNN_ERROR}"),
        "oom in check": ("failed", "OutOfMemoryError: CUDA out of memory."),
        "oom in timing": ("failed", "OutOfMemoryError: CUDA out of memory."),
        "compile": ("failed", "NotImplementedError"),
        "not here": ("unavailable", "`xformers` is not installed"),
        "wrong": ("failed", status["wrong"][1]),
    }
    assert status["wrong"][1].startswith("WrongResult: differs from blockattn's result")


def test_results_are_checked_against_the_first_that_ran(fake_gpu):
    """blockattn failing leaves the others checked against the next implementation, which the rows name."""
    good = [torch.ones(3, 2)]
    factories = {"blockattn": raises(RuntimeError("boom")), "FA2": lambda case: runner_of(good),
                 "SDPA": lambda case: runner_of(good), "wrong": lambda case: runner_of([2 * t for t in good])}
    report = harness.Report(dict(FAKE_ENV), 3.0)
    report.workloads.append({"name": "ads", "implementations": {"attention": list(factories)}})
    harness._time_group(report, PRESETS["ads"], small_case(), "attention", factories, "FA2", None, ["fwd"], 10,
                        NoProgress(), 0)
    assert {r["impl"]: r["checked_against"] for r in report.results} == {"FA2": None, "SDPA": "FA2"}
    assert {s["impl"]: s["status"] for s in report.skipped} == {"blockattn": "failed", "wrong": "failed"}
    assert "differs from FA2's result" in next(s["reason"] for s in report.skipped if s["impl"] == "wrong")
    text = printed(report)
    assert "checked against FA2 (blockattn gave no result)" in text
    assert "FAILED: blockattn on ads (attention): RuntimeError: boom" in text


def test_run_goes_on_past_a_failed_workload_and_writes_the_report(fake_gpu, monkeypatch, tmp_path):
    """The whole run on the CPU: a workload whose inputs cannot be made fails alone, the others are measured, and
    the table, bench.json and the chart are written."""
    make_case = harness.make_case

    def flaky_make_case(w, offsets, seed):
        if w.name == "too big":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return make_case(w, offsets, seed)

    monkeypatch.setattr(harness, "make_case", flaky_make_case)
    workloads = [Workload("small", 3, 1, 130, 2, 1, 32, dtype="float32", rotary=True),
                 Workload("too big", 3, 1, 130, 2, 2, 32, dtype="float32"),
                 Workload("plain", 2, 1, 70, 2, 2, 32, dtype="float32")]
    report = harness.run(workloads, ["fwd", "bwd"], ["FA2 varlen (aten)", "SDPA mem-eff padded"], 10, 0,
                         NoProgress(), device="cpu")
    assert [w.get("failed") for w in report.workloads] == [
        None, "OutOfMemoryError: CUDA out of memory. Tried to allocate 80.00 GiB", None]
    timed = {(r["workload"], r["group"], r["impl"]) for r in report.results}
    assert {("small", "attention", "blockattn"), ("small", "rotary", "blockattn fused rotary"),
            ("small", "qkv", "blockattn qkv_block_attention"), ("plain", "attention", "blockattn")} <= timed
    assert not any(w == "too big" for w, _, _ in timed)
    assert {s["status"] for s in report.skipped} == {"unavailable"}  # FA2 and SDPA need a GPU
    assert {(a["workload"], a["impl"]) for a in report.accuracy if "status" not in a} == {
        ("small", "blockattn"), ("plain", "blockattn")}
    paths = harness.write_files(report, tmp_path / "out")
    assert [p.name for p in paths] == ["bench.json", "bench.png"]
    data = json.loads(paths[0].read_text())
    assert data["workloads"][1]["failed"].startswith("OutOfMemoryError")
    assert "FAILED: workload too big: OutOfMemoryError" in printed(report)


def test_accuracy_goes_on_when_an_implementation_fails(monkeypatch):
    monkeypatch.setattr(harness, "blockattn_runner", raises(torch.OutOfMemoryError("CUDA out of memory.")))
    w = Workload("small", 3, 1, 130, 2, 2, 32, dtype="float32")
    rows = harness._accuracy(w, w.offsets(), 0)
    assert [(r["impl"], r["status"]) for r in rows] == [("blockattn", "failed"), ("FA2 varlen (aten)", "unavailable")]
    assert rows[0]["reason"] == "OutOfMemoryError: CUDA out of memory."


def test_report_files(tmp_path):
    paths = harness.write_files(fake_report(), tmp_path / "out")
    assert [p.name for p in paths] == ["bench.json", "bench.png"]
    data = json.loads(paths[0].read_text())
    assert set(data) == {"environment", "copy_bandwidth_tbps", "workloads", "results", "skipped", "accuracy"}
    assert {s["status"] for s in data["skipped"]} == {"unavailable", "failed"}
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_is_legible(tmp_path):
    """Five presets, three passes, three groups: one panel per group, and no tick label over another."""
    report = fake_report(workloads=("ads", "ads-rotary", "ads-d64", "long", "short"),
                         groups=("attention", "rotary", "qkv"), passes=("fwd", "bwd", "fwdbwd"))
    for r in report.results:
        if r["workload"] == "long":  # as when FA2 failed on it: no speedups
            r["speedup_vs_fa2"] = None
    fig = harness.chart(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().split(":")[0] for ax in panels] == ["attention", "rotary", "qkv"]
    for ax in fig.axes:  # the panels, and the workload names under them
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert boxes
        assert all(a.x1 <= b.x0 for a, b in itertools.pairwise(boxes)), ax
    assert sum(t.get_text() == "no reference\nresult" for t in panels[0].texts) == 3
    harness.write_chart(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_GPU, reason="checks the machine-without-GPU path")
def test_bench_without_gpu_says_so(capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "--preset", "ads", "short", "--out", str(out)]) == 0
    printed_text = capsys.readouterr().out
    assert "No CUDA GPU" in printed_text and "ms" not in printed_text
    assert "Asked for: ads, short" in printed_text and f"Nothing written to {out}" in printed_text
    assert not out.exists()


@pytest.mark.skipif(HAS_GPU, reason="checks the machine-without-GPU path")
def test_latency_bench_without_gpu_says_so(capsys, tmp_path):
    assert main(["bench", "--latency", "--out", str(tmp_path / "out")]) == 0
    assert "No CUDA GPU here" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_reports_are_written_as_json(tmp_path):
    report = {"environment": dict(FAKE_ENV), "results": [{"us": 1.5}]}
    for module, name in ((latency, "latency.json"), (options_bench, "options.json")):
        path = module.write_file(report, tmp_path / "new")
        assert path == tmp_path / "new" / name and json.loads(path.read_text()) == report


@pytest.mark.skipif(HAS_GPU, reason="checks the machine-without-GPU path")
def test_sweep_without_gpu_says_so(capsys, tmp_path):
    assert main(["bench", "--sweep", "--block-size", "64", "--out", str(tmp_path / "out")]) == 0
    assert "No CUDA GPU here" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_sweep_grid_and_its_restrictions():
    full = sweep.grid()
    assert len(full) == len(set(full)) == 4 * 4 * 4 * 3 * 3
    assert all(c.passes == ("fwd",) for c in full if c.dtype == sweep.FP8)
    some = sweep.grid(block_sizes=(64,), dtypes=("float16",))
    assert {c.block_size for c in some} == {64} and {c.dtype for c in some} == {"float16"} and len(some) == 48


def test_sweep_on_the_cpu(fake_gpu, tmp_path):
    """The sweep's bookkeeping, with stand-in timings: each configuration's floor counts its own angle bytes, a
    configuration that cannot run is recorded and the others still run, and the JSON and heatmap are written."""
    configs = sweep.grid(block_sizes=(16,), head_dims=(32,), kv_heads=(8, 2), dtypes=("bfloat16",))
    bad = sweep.Config(16, 20, 8, "bfloat16", "none")  # head dim 20: not a multiple of 8
    report = sweep.run([*configs, bad], rep_ms=1, query_elements=sweep.NUM_HEADS * 32 * 1000, device="cpu")
    assert [f["head_dim"] for f in report["failed"]] == [20] and "head_dim" in report["failed"][0]["reason"]
    rows = {(r["kv_heads"], r["rotary"]): r for r in report["results"]}
    assert len(rows) == len(configs)
    for kv_heads in (8, 2):
        none, fp32, same = (rows[(kv_heads, rotary)] for rotary in sweep.ROTARY)
        n = none["tokens"]
        for pass_name in sweep.PASSES:
            floor_bytes = none[pass_name]["floor_ms"] * 3.0e9  # fake_gpu's 3 TB/s, in bytes per ms
            assert fp32[pass_name]["floor_ms"] * 3.0e9 == pytest.approx(floor_bytes + n * 32 * 4)
            assert same[pass_name]["floor_ms"] * 3.0e9 == pytest.approx(floor_bytes + n * 32 * 2)
            assert none[pass_name]["x_floor"] == pytest.approx(1.0 / none[pass_name]["floor_ms"])
            # fake_gpu times 1 ms: the rate the floor would need is the achieved one over the floor's ms
            assert none[pass_name]["tflops_at_floor"] == pytest.approx(none[pass_name]["tflops"]
                                                                       / none[pass_name]["floor_ms"])
        # 2 products forward, 5 backward, over at most 16 keys per query (1 ms: FLOP / 1e9 is TFLOP/s)
        assert none["bwd"]["tflops"] == pytest.approx(2.5 * none["fwd"]["tflops"])
        assert 0.5 * (2 * 2 * n * 16 * 8 * 32) / 1e9 < none["fwd"]["tflops"] <= (2 * 2 * n * 16 * 8 * 32) / 1e9
    assert rows[(2, "none")]["fwd"]["floor_ms"] < rows[(8, "none")]["fwd"]["floor_ms"]  # GQA reads fewer k, v
    fp8_report = sweep.run(sweep.grid(block_sizes=(16,), head_dims=(32,), kv_heads=(2,), dtypes=(sweep.FP8,)),
                           rep_ms=1, query_elements=sweep.NUM_HEADS * 32 * 1000, device="cpu")
    assert not fp8_report["failed"]
    fp8_rows = {r["rotary"]: r for r in fp8_report["results"]}
    # fp8: q, k, v one byte per element, the bf16 output two; the angles in fp32 or bf16
    for rotary, angle_bytes in (("none", 0), ("fp32 angles", 4), ("input angles", 2)):
        row = fp8_rows[rotary]
        assert "bwd" not in row
        assert row["fwd"]["floor_ms"] * 3.0e9 == pytest.approx((8 + 2 * 2 + 2 * 8 + angle_bytes) * row["tokens"] * 32)
    report["results"] += fp8_report["results"]
    paths = sweep.write_files(report, tmp_path)
    assert json.loads(paths[0].read_text())["results"] == report["results"]
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep.print_report(report, make_console(io.StringIO()))


def test_sweep_times_one_pass_when_asked(fake_gpu, tmp_path):
    """``--pass bwd``: the backward alone, fp8 configurations (forward only) left out; ``--pass fwd``: the forward
    alone. The heatmap then has one row of panels."""
    configs = sweep.grid(block_sizes=(16,), head_dims=(32,), kv_heads=(2,), dtypes=("bfloat16", sweep.FP8))
    elements = sweep.NUM_HEADS * 32 * 1000
    backward = sweep.run(configs, rep_ms=1, query_elements=elements, device="cpu", passes=("bwd",))
    assert backward["passes"] == ["bwd"] and not backward["failed"]
    assert len(backward["results"]) == 3 and {r["dtype"] for r in backward["results"]} == {"bfloat16"}
    assert all("bwd" in r and "fwd" not in r for r in backward["results"])
    forward = sweep.run(configs, rep_ms=1, query_elements=elements, device="cpu", passes=("fwd",))
    assert len(forward["results"]) == 6 and all("fwd" in r and "bwd" not in r for r in forward["results"])
    import matplotlib.pyplot as plt

    figure = sweep.heatmap(backward)
    assert len(figure.axes) == 3 + 1  # a panel per rotary choice, and the colour bar
    plt.close(figure)
    out = io.StringIO()
    sweep.print_report(backward, make_console(out))
    assert "bfloat16" in out.getvalue()


def test_sweep_newest_figures_merge_reports_by_date():
    """Sweeps run one axis at a time: each configuration and pass keeps the figure of the newest report that timed
    it (a backward-only rerun replaces the backward alone), per device; the table spans the GQA ratios of a row."""
    def report(device, date, rows):
        return {"environment": {"device": device, "date": date}, "results": [
            {"block_size": 64, "head_dim": 128, "kv_heads": kv, "dtype": dtype, "rotary": "none", "gqa": 8 // kv,
             **{p: {"x_floor": x} for p, x in passes.items()}} for kv, dtype, passes in rows]}

    old = report("H100", "2026-11-27T10:00", [(8, "bfloat16", {"fwd": 1.5, "bwd": 1.6}),
                                              (2, "bfloat16", {"fwd": 1.2, "bwd": 1.3}),
                                              (8, "float16", {"fwd": 9.0, "bwd": 9.0})])
    new_bwd = report("H100", "2026-11-28T08:00", [(8, "bfloat16", {"bwd": 1.1})])
    other_gpu = report("H200", "2026-11-26T08:00", [(8, "bfloat16", {"fwd": 2.0, "bwd": 2.0})])
    # Given out of date order: the date decides, not the order
    merged = sweep.newest_figures([("new", new_bwd), ("h200", other_gpu), ("old", old)], dtypes=("bfloat16",))
    assert set(merged) == {"H100", "H200"}
    h100 = merged["H100"]
    assert set(h100) == {(64, 128, 8, "bfloat16", "none"), (64, 128, 2, "bfloat16", "none")}  # no float16
    mha = h100[(64, 128, 8, "bfloat16", "none")]
    assert (mha["fwd"]["x_floor"], mha["fwd"]["name"]) == (1.5, "old")
    assert (mha["bwd"]["x_floor"], mha["bwd"]["name"]) == (1.1, "new")
    table = sweep.summary_table(h100).splitlines()
    assert table[0].startswith("| dtype | BS | D | fwd, none |") and len(table) == 3
    assert table[2].startswith("| bfloat16 | 64 | 128 | 1.20–1.50 |") and "| 1.10–1.30 |" in table[2]


def test_baselines_say_why_not_here():
    assert set(NEEDS) == set(BASELINES)
    for name in BASELINES:
        reason = why_not_here(name)
        assert reason is None or reason.strip()
        if not torch.cuda.is_available():
            assert "needs a CUDA GPU" in reason
    if importlib.util.find_spec("xformers") is None:
        assert "`xformers` not installed" in why_not_here("xformers BlockDiagonalMask")


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "FA2 varlen (aten)" in out and "Baselines (bench):" in out
    assert "Backends (blockattn)" in out and all(f"  {name} (" in out for name in ("triton", "torch"))
    if not HAS_GPU:
        assert "Presets here (cpu)" in out and "ads-rotary rotary  fwd: torch  bwd: torch" in out
        assert "not here: needs a CUDA GPU" in out
        assert "FlexAttention               not here: needs a CUDA GPU" in out


def test_info_backend_reasons(monkeypatch, capsys):
    """Against a stand-in dispatcher: a backend that takes some presets names the others and why."""
    from blockattn import backends

    def hopper_only(call):
        return None if call.head_dim == 128 else f"takes D = 128, not {call.head_dim}"

    fake = types.ModuleType("blockattn.backends")
    fake.AttentionCall = backends.AttentionCall
    fake.BACKENDS = {
        "special": types.SimpleNamespace(name="special", passes=("bwd",), summary="D = 128 only",
                                         why_not=hopper_only),
        "everything": types.SimpleNamespace(name="everything", passes=("fwd", "bwd"), summary="the rest",
                                            why_not=lambda call: None),
    }
    fake.select = lambda call, registry=None: backends.select(call, registry) if registry else next(
        b for b in fake.BACKENDS.values() if call.pass_name in b.passes and b.why_not(call) is None)
    fake.FLASH_BACKENDS, fake.FlashCall = backends.FLASH_BACKENDS, backends.FlashCall
    monkeypatch.setitem(sys.modules, "blockattn.backends", fake)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "  special (bwd): D = 128 only\n      not for ads-d64, short: takes D = 128, not 64\n" in out
    presets = out.split("Presets here")[1].split("Flash attention backends")[0].splitlines()[1:]
    runs = {line.split()[0]: line.split(maxsplit=1)[1] for line in presets}
    assert runs["ads"] == "fwd: everything  bwd: special" and runs["short"] == "fwd: everything  bwd: everything"


def test_padded_sdpa_refuses_what_its_kernel_does_not_take():
    """Inputs a fused SDPA kernel does not take make it unavailable, checked before anything runs."""
    case = small_case()
    with pytest.raises(Unavailable, match="takes no mask"):
        padded_sdpa_runner(torch.nn.attention.SDPBackend.FLASH_ATTENTION)(case)
    if not HAS_GPU:
        with pytest.raises(Unavailable, match="refused these inputs"):
            padded_sdpa_runner(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)(case)


@requires_gpu
def test_small_gpu_run(tmp_path):
    code = main(["bench", "--seqs", "32", "--max-len", "400", "--heads", "2", "--head-dim", "64", "--rep-ms", "20",
                 "--rotary", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    ours = [r for r in data["results"] if r["impl"] == "blockattn"]
    assert {r["pass"] for r in ours} == {"fwd", "bwd", "fwdbwd"}
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 and r["peak_mib"] > 0 for r in ours)
    assert all(r["quantiles_ms"]["p20"] <= r["ms"] <= r["quantiles_ms"]["p80"] for r in ours)
    timed = {(r["group"], r["impl"]) for r in data["results"]}
    assert {("rotary", "blockattn fused rotary"), ("rotary", ROTARY_REFERENCE), ("qkv", QKV_REFERENCE),
            ("qkv", "blockattn qkv_block_attention")} <= timed
    assert any(a["impl"] == "blockattn" and a["snr_dq_db"] > 45 for a in data["accuracy"])
    assert (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_GPU else []))
@pytest.mark.parametrize("option", [o for o in options_bench.OPTION_SETS if o != "dropout"])
def test_options_baselines_compute_the_same(option, device):
    """The in-block options built from FlexAttention (eager on the CPU, which has no Flex backward there) and from
    padded SDPA with a bias tensor give blockattn's output and gradients."""
    w = Workload("options-test", 5, 10, 150, 2, 2, 16, block_size=16, dtype="float32")
    inputs = options_bench._Inputs(w, seed=3, device=device)
    kwargs = inputs.options(option)
    results = {}
    for name, build in options_bench.IMPLEMENTATIONS.items():
        calls = build(inputs, kwargs)
        if device == "cpu" and name.startswith("FlexAttention"):
            with torch.no_grad():
                results[name] = [calls["out"]()]
            continue
        out = calls["out"]()
        results[name] = [out, *torch.autograd.grad(out, calls["leaves"], inputs.case.do)]
    ours = results.pop(options_bench.OURS)
    for name, got in results.items():
        for g, want in zip(got, ours):
            assert snr_db(g.detach(), want.detach()) > 60, name


@requires_gpu
def test_small_gpu_options_run(tmp_path):
    code = main(["bench", "--options", "--seqs", "32", "--max-len", "400", "--heads", "2", "--head-dim", "64",
                 "--rep-ms", "10", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "options.json").read_text())
    ours = {(r["option"], r["pass"]) for r in data["results"] if r["impl"] == options_bench.OURS}
    assert ours == set(itertools.product(options_bench.OPTION_SETS, ("fwd", "bwd", "fwdbwd")))
    assert all(r["ms"] > 0 and r["x_floor"] > 0 for r in data["results"])
    flex = [s for s in data["skipped"] if s["impl"].startswith("FlexAttention")]
    assert [s["option"] for s in flex] == ["dropout"], flex


@requires_gpu
def test_small_gpu_latency_run(tmp_path):
    """Every batch, mode and pass is timed for both implementations, and ``x_fa2`` divides by FA2's figure of the
    same batch, pass and mode (eager against eager)."""
    report = latency.run(seed=1, batches=((1, 100), (3, 130)), calls_per_repeat=5)
    rows = report["results"]
    keys = {(r["batch"], r["impl"], r["mode"], r["pass"]) for r in rows}
    ours = set(itertools.product(("1 x 100", "3 x 130"), [latency.OURS], latency.MODES, latency.PASSES))
    fa2 = set(itertools.product(("1 x 100", "3 x 130"), [latency.FA2], ("eager", "graph"), latency.PASSES))
    fa2_autograd = set(itertools.product(("1 x 100", "3 x 130"), [latency.FA2_AUTOGRAD], ("eager",), latency.PASSES))
    assert keys == ours | fa2 | fa2_autograd
    by_key = {(r["batch"], r["impl"], r["mode"], r["pass"]): r for r in rows}
    for r in rows:
        assert r["us"] > 0
        fa2_mode = "graph" if r["mode"] == "graph" else "eager"
        assert r["x_fa2"] == pytest.approx(r["us"] / by_key[(r["batch"], latency.FA2, fa2_mode, r["pass"])]["us"])
        if fa2_mode == "eager":
            fa2_autograd_us = by_key[(r["batch"], latency.FA2_AUTOGRAD, "eager", r["pass"])]["us"]
            assert r["x_fa2_autograd"] == pytest.approx(r["us"] / fa2_autograd_us)
        else:
            assert "x_fa2_autograd" not in r
    assert json.loads(latency.write_file(report, tmp_path).read_text())["results"] == rows


@requires_gpu
def test_small_gpu_sweep_run(tmp_path):
    configs = sweep.grid(block_sizes=(32,), head_dims=(64,), kv_heads=(8, 2), dtypes=("bfloat16", sweep.FP8))
    report = sweep.run(configs, rep_ms=5, query_elements=2**20)
    assert not report["failed"] and len(report["results"]) == len(configs)
    # Not a timing test: at this size the host's launches set the time (up to 200x the floor on an H100), but no
    # kernel beats its memory floor by 3x; a ratio under that means a floor counted too many bytes.
    ratios = {(r["kv_heads"], r["dtype"], r["rotary"], p): r[p]["x_floor"]
              for r in report["results"] for p in sweep.PASSES if p in r}
    assert all(x > 0.3 for x in ratios.values()), ratios
    assert [p.name for p in sweep.write_files(report, tmp_path)] == ["sweep.json", "sweep.png"]
