"""The shared memory of the Triton programs the launchers would run on a GPU architecture, compiled offline.

    python benchmarks/shared_memory.py --arch 86 --limit-kib 99
    python benchmarks/shared_memory.py --arch 86 --limit-kib 99 --lean --passes bwd --block-sizes 128
    python benchmarks/shared_memory.py --arch 86 --passes bwd --head-dims 128 --block-sizes 64 --pipeline-stages 2
    python benchmarks/shared_memory.py --arch 89 --flash

Compiles every kernel that the Triton launchers would launch for each configuration (pass x dtype x angles x head
dim x block size x kv heads, 8 query heads), as they would on a GPU whose programs may take ``--limit-kib`` of
shared memory (what ``kernel_config`` is told), and prints one line each: the configuration, the kernel and the
bytes of shared memory its program takes (Triton's metadata), flagged where above the limit. ``--lean`` asks for
``kernel_config``'s lean configuration, where the launchers go when the GPU refuses the rule's program;
``--pipeline-stages`` runs the backward's persistent kernel that many stages deep (the launcher's tuning override,
which it refuses for a rotary). ``--flash``: the flash attention's forward instead, the pipelined kernel that runs
off Hopper, dense, at the configuration its dispatcher picks for the architecture and limit (``flash_config``), over
``--dtypes`` x ``--head-dims`` x causal or not, 8 query heads on 2 kv heads. A configuration that cannot be launched
or compiled for the architecture (fp8 below sm_89) is listed with the reason. The figures depend on the installed
Triton; Triton's compiler (ptxas, shipped with it) does the work on the CPU.
"""

import argparse
import itertools

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

ANGLES = {"none": None, "fp32": torch.float32, "bf16": torch.bfloat16}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
NUM_TOKENS = 4096
QUERY_HEADS = 8


class _OfflineDriver:
    """Triton's active driver for compiling, not running: its target is the asked architecture, and nothing else
    is asked of it by ``JITFunction.warmup``."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=86, help="compute capability, e.g. 80, 86, 89, 90")
    parser.add_argument("--limit-kib", type=int, default=99, help="shared memory a program may take, KiB")
    parser.add_argument("--lean", action="store_true", help="kernel_config's lean configuration")
    parser.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=list(DTYPES))
    parser.add_argument("--angles", nargs="+", default=list(ANGLES), choices=list(ANGLES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--kv-heads", nargs="+", type=int, default=[8, 2, 1])
    parser.add_argument("--pipeline-stages", type=int, help="the persistent backward's depth (tuning override)")
    parser.add_argument("--flash", action="store_true", help="the flash attention's forward instead")
    args = parser.parse_args()

    driver.set_active(_OfflineDriver(args.arch))
    # Imported under the offline driver; the launchers' launches compile instead (``warmup``), and their rule is
    # told the limit, as on such a GPU (the launchers ask the GPU only for tensors on one).
    from blockattn.block_table import BlockTable
    from blockattn.ops import block_attention, flash_attention, fp8, rotary
    from blockattn.ops.in_block import PLAIN
    from blockattn.ops.tiles import ROTATE_ALL

    compiled = []

    def compile_only(kernel, grid, **kwargs):
        compiled.append(kernel.warmup(grid=grid, **kwargs))

    def report(label: str, launcher, *args, **kwargs) -> None:
        compiled.clear()
        try:
            launcher(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - listed, as the architecture's (or the launcher's) answer
            print(f"{label}: not launched ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            return
        for kernel in compiled:
            shared = kernel.metadata.shared
            print(f"{label}: {kernel.name} {shared / 1024:.0f} KiB{'  ABOVE THE LIMIT' if shared > limit else ''}",
                  flush=True)

    limit = args.limit_kib * 1024
    if args.flash:
        flash_attention.launch = compile_only
        print(f"triton {triton.__version__}, sm_{args.arch}, limit {args.limit_kib} KiB, flash attention")
        for dtype, head_dim, causal in itertools.product(args.dtypes, args.head_dims, (False, True)):
            cfg, reason = flash_attention.flash_config("pipelined", divmod(args.arch, 10), head_dim, dtype == "fp8",
                                                       limit, causal)
            label = f"flash {dtype} D={head_dim} causal={causal} {cfg}"
            if cfg is None:
                print(f"{label}: {reason}")
                continue
            q, k, v = (torch.zeros(2, 256, h, head_dim).to(DTYPES[dtype]) for h in (QUERY_HEADS, 2, 2))
            descales = tuple(torch.ones(1) for _ in range(3)) if dtype == "fp8" else None
            report(label, flash_attention.flash_attention_fwd_triton, q, k, v, None, None, None, 0.1, causal, False,
                   torch.bfloat16, descales, "pipelined", cfg)
        return
    rule = block_attention.kernel_config
    block_attention.launch = rotary.launch = compile_only
    block_attention.kernel_config = lambda *a, **kw: rule(*a, **{**kw, "shared_memory": limit,
                                                                "lean": args.lean or kw.get("lean", False)})
    block_attention.inline_asm = lambda t: True  # as on a GPU
    offsets = torch.tensor([0, NUM_TOKENS])
    print(f"triton {triton.__version__}, sm_{args.arch}, limit {args.limit_kib} KiB{', lean' if args.lean else ''}")
    for pass_name, dtype, angles, head_dim, block_size, kv_heads in itertools.product(
            args.passes, args.dtypes, args.angles, args.head_dims, args.block_sizes, args.kv_heads):
        if pass_name == "bwd" and dtype == "fp8":
            continue
        q, k, v = (torch.zeros(NUM_TOKENS, h, head_dim).to(DTYPES[dtype]) for h in (QUERY_HEADS, kv_heads, kv_heads))
        sinu_pos = None if ANGLES[angles] is None else torch.zeros(NUM_TOKENS, head_dim, dtype=ANGLES[angles])
        rotate = 0 if sinu_pos is None else ROTATE_ALL
        table = BlockTable(torch.zeros(2, dtype=torch.int32),
                           torch.zeros(triton.cdiv(NUM_TOKENS, block_size), dtype=torch.int32))
        label = f"{pass_name} {dtype} angles={angles} D={head_dim} BS={block_size} {QUERY_HEADS}:{kv_heads}"
        if pass_name == "fwd":
            scales = None if dtype != "fp8" else fp8.Fp8Scales(*(torch.ones(1) for _ in range(3)), torch.bfloat16)
            report(label, block_attention.block_attention_fwd_triton, q, k, v, offsets, table, block_size, 0.1,
                   sinu_pos, rotate, PLAIN, scales)
        else:
            grads = tuple(map(torch.empty_like, (q, k, v)))
            report(label, block_attention.block_attention_bwd_triton, torch.zeros_like(q), q, k, v, offsets, table,
                   block_size, 0.1, sinu_pos, rotate, PLAIN, grads, pipeline_stages=args.pipeline_stages)

if __name__ == "__main__":
    main()
