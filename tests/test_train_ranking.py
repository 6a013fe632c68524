"""examples/train_ranking.py: data sharding, learning, resume, DDP and FSDP2 (2 processes), torch.export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires_gpu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_ranking

# Tiny shapes: 7 sequences of 5..59 tokens, one layer of width 32.
TINY = ["--quiet", "--batch-seqs", "7", "--min-len", "5", "--max-len", "60", "--num-items", "16", "--num-categories",
        "4", "--d-model", "32", "--heads", "2", "--head-dim", "16", "--layers", "1", "--block-size", "16",
        "--eval-batches", "0", "--log-every", "2"]
# Small enough to learn in seconds on the CPU: 4 categories, 64 sequences of 8..63 tokens per step.
LEARNABLE = ["--quiet", "--batch-seqs", "64", "--min-len", "8", "--max-len", "64", "--num-items", "4",
             "--num-categories", "4", "--d-model", "32", "--heads", "2", "--head-dim", "16", "--layers", "1",
             "--block-size", "16", "--lr", "3e-3", "--warmup", "5", "--eval-batches", "4", "--log-every", "10"]


def run(*args) -> dict:
    """The example in this process; its summary."""
    return train_ranking.main([str(a) for a in args])


def torchrun(*args, nproc=2, timeout=180) -> dict:
    """The example under ``python -m torch.distributed.run`` (a free port: ``--standalone``); its JSON summary."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "examples" / "train_ranking.py"), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same_gradients(got_path, want_path, rtol=1e-5, atol=1e-6):
    got, want = torch.load(got_path)["grads"], torch.load(want_path)["grads"]
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_deal_balances_tokens():
    """Every sequence to exactly one rank; the token loads differ by at most one sequence's length."""
    lengths = torch.randint(1, 2000, (101,)).tolist()
    for world_size in (1, 2, 3, 8):
        shards = train_ranking.deal(lengths, world_size)
        assert sorted(i for shard in shards for i in shard) == list(range(101))
        loads = [sum(lengths[i] for i in shard) for shard in shards]
        assert max(loads) - min(loads) <= max(lengths)
        assert shards == train_ranking.deal(list(lengths), world_size)  # deterministic


def test_shards_are_parts_of_one_global_batch(seeded):
    """Each rank makes only its own sequences, and they are the sequences of the single-process batch."""
    data = train_ranking.SyntheticAds(seeded, 9, 3, 50, 64, 4, 8)
    whole, tokens = train_ranking.local_batch(data, 5, 0, 1, "cpu")
    assert tokens == whole.num_tokens == int(data.lengths(5).sum())
    lengths = data.lengths(5).tolist()
    for rank, shard in enumerate(train_ranking.deal(lengths, 3)):
        part, _ = train_ranking.local_batch(data, 5, rank, 3, "cpu")
        for j, i in enumerate(shard):
            rows, own = slice(whole.offsets[i], whole.offsets[i + 1]), slice(part.offsets[j], part.offsets[j + 1])
            assert torch.equal(part.item_ids[own], whole.item_ids[rows])
            assert torch.equal(part.action_ids[own], whole.action_ids[rows])
            assert part.target_ids[j] == whole.target_ids[i] and part.labels[j] == whole.labels[i]
    other, _ = train_ranking.local_batch(data, 6, 0, 1, "cpu")
    assert other.num_tokens != whole.num_tokens or not torch.equal(other.item_ids, whole.item_ids)


def test_training_loss_falls(seeded):
    """A short CPU run learns: held-out loss well below the base rate's entropy (a good share of what the true
    probabilities gain over it on the same held-out batches), AUC well above 0.5."""
    summary = run(*LEARNABLE, "--device", "cpu", "--steps", 40, "--seed", seeded % 1000)
    # Over 220 seeds (every fifth of 0..999, and 740..759) the loss gained at least 0.53 of the true probabilities'
    # gain over the entropy and AUC 0.80, but for seed 747: 0.45 and 0.78, whose held-out batches are hard (the
    # true probabilities gain only 0.19 over the entropy there).
    oracle_gain = summary["eval_base_entropy"] - summary["eval_oracle_loss"]
    assert summary["eval_base_entropy"] - summary["eval_loss"] > 0.3 * oracle_gain > 0, summary
    assert summary["eval_auc"] > 0.7, summary
    assert summary["tokens_per_s"] > 0 and len(summary["losses"]) == 40


def test_resume_continues_the_same_curve(tmp_path, seeded):
    """Checkpoint after 3 steps, resume: step 4's loss is that of an uninterrupted run, exactly."""
    args = [*TINY, "--device", "cpu", "--seed", seeded % 1000, "--ckpt", tmp_path]
    whole = run(*args, "--steps", 5, "--save-every", 3)
    (tmp_path / "latest").write_text("step-00000003")
    resumed = run(*args, "--steps", 5, "--resume")
    assert resumed["start_step"] == 3
    assert resumed["losses"] == whole["losses"][3:]


def test_ddp_gradients_match_one_process(tmp_path):
    """2 gloo processes, token-balanced shards: the all-reduced gradients are those of one process on the whole
    global batch."""
    args = [*TINY, "--device", "cpu", "--steps", 1]
    run(*args, "--dump-grads", tmp_path / "one.pt")
    summary = torchrun(*args, "--dump-grads", tmp_path / "ddp.pt")
    assert summary["parallel"] == "ddp" and summary["world_size"] == 2 and summary["tokens_per_s"] > 0
    assert_same_gradients(tmp_path / "ddp.pt", tmp_path / "one.pt")


def test_fsdp2_gradients_and_resume(tmp_path):
    """FSDP2 (fully_shard) on 2 gloo processes: gradients of one process on the global batch; a distributed
    checkpoint (torch.distributed.checkpoint) resumes on the same curve."""
    args = [*TINY, "--device", "cpu", "--fsdp", "--ckpt", tmp_path / "ckpt"]
    run(*TINY, "--device", "cpu", "--steps", 1, "--dump-grads", tmp_path / "one.pt")
    whole = torchrun(*args, "--steps", 3, "--save-every", 2, "--dump-grads", tmp_path / "fsdp.pt")
    assert whole["parallel"] == "fsdp2"
    assert_same_gradients(tmp_path / "fsdp.pt", tmp_path / "one.pt")
    (tmp_path / "ckpt" / "latest").write_text("step-00000002")
    resumed = torchrun(*args, "--steps", 3, "--resume")
    assert resumed["start_step"] == 2 and resumed["losses"] == whole["losses"][2:]


# A package of a model without any blockattn op, compiled and loaded in a child process: in the GPU machines' image
# (torch 2.11.0+cu130, Python 3.12, 2026-11-23) aoti_load_package crashes the process on any package, this one
# included, on the CPU and the GPU; with torch 2.11 on Python 3.11 and with torch 2.13 it loads.
PLAIN_AOTI = """
import torch
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
x = torch.randn(8, 16)
path = torch._inductor.aoti_compile_and_package(torch.export.export(m, (x,)), package_path=__import__("sys").argv[1])
assert (torch._inductor.aoti_load_package(path)(x) - m(x)).abs().max() < 1e-5
"""


def aoti_loads_here(tmp_path) -> bool:
    return subprocess.run([sys.executable, "-c", PLAIN_AOTI, str(tmp_path / "plain.pt2")], capture_output=True,
                          timeout=600, check=False).returncode == 0


def test_export_and_aoti_through_the_example(tmp_path):
    """The example's --export --aoti after a short CPU run: the exported program and the AOTInductor package match
    eager on batches of other sizes (one sequence included)."""
    if not aoti_loads_here(tmp_path):
        pytest.skip("aoti_load_package crashes here even on a package of plain nn.Linear layers (no blockattn op)")
    summary = run(*TINY, "--device", "cpu", "--steps", 1, "--eval-batches", "0", "--export", tmp_path / "r.pt2",
                  "--aoti")
    assert summary["export_max_err"] < 1e-5 and summary["aoti_max_err"] < 1e-4, summary
    assert Path(summary["aoti_path"]).exists()


def test_export_round_trip(tmp_path):
    """torch.export with dynamic N and B, saved and loaded: the eager output on batches of other sizes (one
    sequence included)."""
    args = train_ranking.parse_args([*TINY, "--device", "cpu"])
    data = train_ranking.SyntheticAds(0, 16, 5, 60, 16, 4, 4)
    model = train_ranking.build_model(args, "cpu").eval()

    def batch(step, num_seqs):
        return data.batch(step, torch.arange(num_seqs), data.lengths(step)[:num_seqs], "cpu")

    program = train_ranking.export_program(model, batch(0, 4))
    torch.export.save(program, tmp_path / "ranker.pt2")
    loaded = torch.export.load(tmp_path / "ranker.pt2").module()
    with torch.no_grad():
        for step, num_seqs in ((1, 1), (2, 11)):
            inputs = batch(step, num_seqs).model_inputs
            torch.testing.assert_close(loaded(*inputs), model(*inputs), atol=1e-6, rtol=1e-5)


# --- GPU ----------------------------------------------------------------------------------------------------------

GPU_SMALL = ["--quiet", "--batch-seqs", "64", "--min-len", "100", "--max-len", "400", "--num-items", "64",
             "--num-categories", "4", "--d-model", "128", "--heads", "2", "--head-dim", "64", "--layers", "2",
             "--eval-batches", "2", "--log-every", "10", "--lr", "2e-3"]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_gpu_bf16_training_loss_falls(compile):
    """bf16 autocast on the GPU kernels (and torch.compile): the model learns."""
    summary = run(*GPU_SMALL, "--device", "cuda", "--dtype", "bfloat16", "--steps", 60,
                  *(["--compile"] if compile else []))
    assert summary["eval_loss"] < summary["eval_base_entropy"] - 0.05, summary
    assert summary["eval_auc"] > 0.7, summary


@requires_gpu
@pytest.mark.gpu
def test_gpu_resume_and_export(tmp_path):
    """On the GPU: resume continues the curve; torch.export matches eager on batches of other sizes. (AOTInductor
    packages do not load in the GPU machines' image at all: examples/README.md.)"""
    args = [*GPU_SMALL, "--device", "cuda", "--ckpt", tmp_path / "ckpt", "--eval-batches", "0"]
    whole = run(*args, "--steps", 4, "--save-every", 3)
    (tmp_path / "ckpt" / "latest").write_text("step-00000003")
    resumed = run(*args, "--steps", 4, "--resume", "--export", tmp_path / "ranker.pt2")
    assert resumed["losses"] == pytest.approx(whole["losses"][3:], rel=1e-5)
    assert resumed["export_max_err"] < 1e-4, resumed


@requires_gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_ranking_step():
    """The example's whole training step (embeddings, layers, jagged pooling, loss, capturable AdamW) captured in
    a CUDA graph and replayed on new batches of the same shapes, against eager steps of a copy."""
    args = train_ranking.parse_args([*GPU_SMALL, "--device", "cuda"])
    data = train_ranking.SyntheticAds(0, 8, 100, 400, 64, 4, 4)
    lengths = data.lengths(0)
    batches = [data.batch(step, torch.arange(8), lengths, "cuda") for step in range(6)]  # the same lengths

    def make():
        model = train_ranking.build_model(args, "cuda")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def step(model, optimizer, batch):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # no cast cache across a capture
            logits = model(*batch.model_inputs).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        optimizer.step()
        return loss

    graphed, graphed_opt = make()
    eager, eager_opt = make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in batches[:3]:
            step(graphed, graphed_opt, batch)
    torch.cuda.current_stream().wait_stream(side)
    for batch in batches[:3]:
        step(eager, eager_opt, batch)
    static = batches[3]
    static = train_ranking.Batch(*(t.clone() if isinstance(t, torch.Tensor) else t for t in vars(static).values()))
    graph = torch.cuda.CUDAGraph()
    graphed_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(graphed, graphed_opt, static)
    for batch in batches[3:]:
        for name, value in vars(batch).items():
            if isinstance(value, torch.Tensor):
                getattr(static, name).copy_(value)
        graph.replay()
        # Two copies trained side by side in bf16, with the pooling's index_add in atomics (any order): they drift
        # by bf16 roundings (seen: 0.14% after four steps on an H200); a replay on stale inputs or weights would
        # differ by the batches' loss spread, several percent.
        torch.testing.assert_close(static_loss, step(eager, eager_opt, batch), atol=1e-3, rtol=1e-2)


@requires_gpu
@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_gpu_two_gpus_match_one(tmp_path, parallel):
    """DDP / FSDP2 over NCCL on 2 GPUs: the gradients of one GPU on the whole global batch (fp32)."""
    args = [*GPU_SMALL, "--device", "cuda", "--steps", 2, "--eval-batches", "1"]
    run(*args, "--dump-grads", tmp_path / "one.pt")
    summary = torchrun(*args, *(["--fsdp"] if parallel == "fsdp" else []), "--dump-grads", tmp_path / "two.pt")
    assert summary["world_size"] == 2 and summary["parallel"] == {"ddp": "ddp", "fsdp": "fsdp2"}[parallel]
    assert_same_gradients(tmp_path / "two.pt", tmp_path / "one.pt", rtol=1e-4, atol=1e-5)
