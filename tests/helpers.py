"""Small helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import torch


class no_tf32:  # noqa: N801 - used like a function: ``with no_tf32():``
    """fp32 on the GPU must mean fp32: cuDNN convolutions (the patch embedding) and matmuls default to TF32."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *_: object) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved
