"""The lean configurations, where the launchers go when a GPU refuses the rule's program, fit the shared memory of an
sm_86 program (about 99 KiB, as on sm_89 and sm_120) with the installed Triton: compiled offline by
``benchmarks/shared_memory.py`` (Triton's compiler on the CPU, no GPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "shared_memory.py"


def shared_kib(*args: str) -> dict[str, int]:
    """``{configuration and kernel: KiB}`` of the script's lines (every configuration must compile and launch)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--arch", "86", *args], capture_output=True, text=True,
                            timeout=900, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()[1:]
    found = [re.fullmatch(r"(.*) (\d+) KiB(  ABOVE THE LIMIT)?", line) for line in lines]
    assert lines and all(found), result.stdout
    return {match[1]: int(match[2]) for match in found}


def test_lean_programs_fit_sm86_where_the_rules_do_not():
    """The shapes whose rules take more than 99 KiB on sm_86 (the pipelined backward at 64-token blocks and D = 128,
    the backward at 128-token blocks; the rotary forward under GQA at D = 128 is near it): their lean
    configurations fit, and the pipelined backward's lean program takes less than the rule's."""
    grid = ["--dtypes", "bf16", "--angles", "none", "fp32", "--head-dims", "128", "--block-sizes", "64", "128",
            "--kv-heads", "8", "2"]
    lean = shared_kib("--lean", *grid)
    assert len(lean) == 16 and max(lean.values()) <= 99, lean
    rule = shared_kib("--passes", "bwd", "--angles", "none", "--head-dims", "128", "--block-sizes", "64",
                      "--kv-heads", "2")
    (pipelined, rule_kib), = rule.items()
    assert "_block_attention_bwd_persistent_kernel" in pipelined
    lean_kib = lean["bwd bf16 angles=none D=128 BS=64 8:2: _block_attention_bwd_kernel"]
    assert lean_kib < rule_kib
