"""Recurrent kernels (WKV) behind plain-tensor APIs.

Each kernel has a naive recurrent twin that is its specification and test oracle:
    wkv4.py   RWKV-4 WKV in log-space (numerically stable for any decay)
    wkv5.py   RWKV-5/6 matrix-valued state with per-key-channel decay (constant or data-dependent)
    wkv7.py   RWKV-7 generalized delta rule: per-token decay plus a rank-1 state correction
The `_export` forms are the chunked ones in operations ExecuTorch runs (rwkv_engine/export); the
dispatchers `wkv5` / `wkv7` pick them while torch.export traces.
"""

from .wkv4 import wkv4, wkv4_reference
from .wkv5 import wkv5, wkv5_chunked, wkv5_export, wkv5_naive
from .wkv7 import wkv7, wkv7_chunked, wkv7_export, wkv7_naive

__all__ = [
    "wkv4",
    "wkv4_reference",
    "wkv5",
    "wkv5_chunked",
    "wkv5_export",
    "wkv5_naive",
    "wkv7",
    "wkv7_chunked",
    "wkv7_export",
    "wkv7_naive",
]
