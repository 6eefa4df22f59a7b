"""How a weight multiplied as ``x @ W.T`` (``nn.functional.linear``; W [..., out, in]) is stored in memory.

On CPU, a product of a few rows (a decode step: one or two rows per expert, a handful through the LM head) reads
W faster when each [out, in] matrix is stored input-major, [in, out] contiguous, and seen through a transposed view:
the same shape and values, so every module computes on it unchanged (``linear`` hands the BLAS the contiguous
[in, out] matrix with no transpose). Measured on this project's 2-vCPU host, one thread, the 214M Mixtral's
shapes: one expert's [3584, 512] and [512, 1792] products, 4 experts x 2 rows, 7.0 ms against 4.3; the LM head
[32000, 512], 1 row 6.9 ms against 3.0, 8 rows 13.6 against 11.1; a prefill's hundreds of rows as fast or faster.
The products' last bits may differ (another BLAS kernel), as they already do with the number of rows in a call.
GPUs keep the checkpoint's layout.

Shapes: [..., out, in] is what every caller sees, before and after.
"""

from __future__ import annotations

import torch

__all__ = ["input_major", "prefers_input_major"]


def prefers_input_major(device: torch.device) -> bool:
    """Whether weights multiplied as ``x @ W.T`` on ``device`` are stored input-major."""
    return device.type == "cpu"


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [..., out, in] as a view of the same shape and values over [..., in, out] contiguous storage."""
    return weight.transpose(-1, -2).contiguous().transpose(-1, -2)
