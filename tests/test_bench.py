"""The benchmark harness and command line (timings themselves only on a GPU)."""

import importlib.util
import json
import math
import sys
import types

import pytest
import torch
from conftest import HAS_GPU, make_offsets, random_angles, requires_gpu, snr_db

from blockattn.__main__ import build_parser, main, workloads_from_args
from blockattn.bench import harness
from blockattn.bench.baselines import (
    BASELINES,
    QKV_IMPLS,
    QKV_REFERENCE,
    ROTARY_IMPLS,
    ROTARY_REFERENCE,
    Case,
    Unavailable,
    blockattn_runner,
    flex_block_mask,
    heads_first,
    padded_sdpa_runner,
)
from blockattn.bench.presets import PRESETS, lengths_for_sparsity
from blockattn.reference import block_attention_reference


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
    with pytest.raises(SystemExit, match="--heads"):
        workloads_from_args(parse("--seqs", "10", "--max-len", "100", "--head-dim", "64"))


def test_sparsity_is_a_density():
    assert lengths_for_sparsity(2000, 0.7) == (800, 2000)
    assert lengths_for_sparsity(8192, 0.5) == (1, 8192)
    assert lengths_for_sparsity(1000, 0.25) == (1, 500)
    with pytest.raises(ValueError):
        lengths_for_sparsity(100, 0.0)


@pytest.mark.parametrize(
    "name,lo,hi,mean,tokens",
    [("ads", 800, 2000, 1400, 1.61e6), ("ads-rotary", 1012, 2000, 1506, 1.74e6), ("ads-d64", 800, 2000, 1400, 1.61e6),
     ("long", 1, 8192, 4096, 4.72e6), ("short", 1, 307, 154, 0.63e6)],
)
def test_presets_follow_spec(name, lo, hi, mean, tokens):
    lengths = PRESETS[name].lengths(seed=0).double()
    assert lengths.min() >= lo and lengths.max() < hi
    assert abs(lengths.mean().item() - mean) < 0.05 * mean
    assert abs(lengths.sum().item() - tokens) < 0.03 * tokens


def test_floor_bytes_match_spec():
    # SPEC §4: ads, N = 1.63 M, bf16 at 4.27 TB/s -> 1.564 ms forward, 2.736 ms backward.
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


def fake_report():
    report = harness.Report({"device": "test device", "date": "2026-01-01T00:00:00+00:00"}, 1.0)
    for impl, ms in (("blockattn", 1.0), ("FA2 varlen (aten)", 2.0)):
        report.results.append({"workload": "ads", "group": "attention", "pass": "fwd", "impl": impl, "ms": ms,
                               "floor_ms": 1.0, "x_floor": ms, "floor_tbps": 1.0 / ms, "extra_ms": {},
                               "speedup_vs_fa2": 2.0 / ms, "reference": "FA2 varlen (aten)"})
    report.skipped.append({"workload": "ads", "impl": "xformers", "reason": "not installed"})
    return report


def test_report_files(tmp_path):
    paths = harness.write_files(fake_report(), tmp_path / "out")
    assert [p.name for p in paths] == ["bench.json", "bench.png"]
    data = json.loads(paths[0].read_text())
    assert set(data) == {"environment", "copy_bandwidth_tbps", "workloads", "results", "skipped", "accuracy"}
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_GPU, reason="checks the machine-without-GPU path")
def test_bench_without_gpu_says_so(capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "No CUDA GPU" in printed and "ms" not in printed
    assert not (tmp_path / "bench.json").exists()


def test_info(capsys):
    assert main(["info"]) == 0
    assert "FA2 varlen (aten)" in capsys.readouterr().out


@requires_gpu
def test_small_gpu_run(tmp_path):
    code = main(["bench", "--seqs", "32", "--max-len", "400", "--heads", "2", "--head-dim", "64", "--rep-ms", "20",
                 "--rotary", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    ours = [r for r in data["results"] if r["impl"] == "blockattn"]
    assert {r["pass"] for r in ours} == {"fwd", "bwd", "fwdbwd"}
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in ours)
    timed = {(r["group"], r["impl"]) for r in data["results"]}
    assert {("rotary", "blockattn fused rotary"), ("rotary", ROTARY_REFERENCE), ("qkv", QKV_REFERENCE),
            ("qkv", "blockattn qkv_block_attention")} <= timed
    assert any(a["impl"] == "blockattn" and a["snr_dq_db"] > 45 for a in data["accuracy"])
    assert (tmp_path / "bench.png").exists()
