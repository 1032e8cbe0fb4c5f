"""Small helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

#: Pruner cases of the pipeline tests: name -> (pruner, options); "evit_fused" is EViT with its fused token.
PRUNER_CASES = {
    "threshold_l2": ("threshold_l2", {}),
    "dynamicvit": ("dynamicvit", {}),
    "evit": ("evit", {}),
    "evit_fused": ("evit", {"fuse_token": True}),
    "ats": ("ats", {}),
}


class no_tf32:  # noqa: N801 - used like a function: ``with no_tf32():``
    """fp32 on the GPU must mean fp32: cuDNN convolutions (the patch embedding) and matmuls default to TF32."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *_: object) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved
