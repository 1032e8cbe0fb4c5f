"""One ragged attention call on a DeiT-B workload, for Nsight Compute.

``ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis -k regex:_ragged
python -m ci.profile_attention --batch 64 --pruned 0`` (the GPU suite's ``profile`` step does this).
"""

from __future__ import annotations

import argparse

import torch

from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.triton_impl.attention import ragged_attention_qkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pruned", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    target = 196 * (100 - args.pruned) / 100
    lo, hi = max(1, round(target * 0.85)), min(196, round(target * 1.15))
    counts = torch.randint(lo, hi + 1, (args.batch,), generator=gen) + 1
    cu = cu_seqlens_from_counts(counts).cuda()
    qkv = torch.randn(int(counts.sum()), 3 * 768, generator=gen).half().cuda()
    for _ in range(3):
        ragged_attention_qkv(qkv, cu, 197, 12)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
