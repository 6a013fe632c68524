"""blockattn: block-diagonal attention on jagged sequences, and flash attention on whole sequences (dense and
varlen, fp8 included), as GPU kernels (Triton) with a PyTorch CPU path.

``blockattn.reference`` (import it by name) holds the float64 reference that tests and the bench compare with.
"""

from . import nn
from .attention import block_attention, block_layout, qkv_block_attention
from .block_table import BlockLayout
from .flash import flash_attention, flash_attention_varlen
from .rotary import apply_rotary

__all__ = ["BlockLayout", "apply_rotary", "block_attention", "block_layout", "flash_attention",
           "flash_attention_varlen", "nn", "qkv_block_attention"]
__version__ = "0.1.0"
