"""One ragged attention call on a DeiT-B workload, for Nsight Compute.

``ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis -k regex:_ragged
python -m ci.profile_attention --batch 64 --pruned 0`` (the GPU suite's ``profile`` step does this).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import has_gpu
from benchmarks.workloads import MAX_SEQLEN, NUM_HEADS, make_qkv_sets, make_workload
from ragged_vit.triton_impl.attention import ragged_attention_qkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pruned", type=int, default=0)
    args = parser.parse_args()
    if not has_gpu("python -m ci.profile_attention"):
        return
    workload = make_workload(args.batch, args.pruned)  # the kernel benchmark's cell: counts within +-15%
    qkv, cu = make_qkv_sets(workload, 1, "cuda")[0], workload.cu_seqlens("cuda")
    for _ in range(3):
        ragged_attention_qkv(qkv, cu, MAX_SEQLEN, NUM_HEADS)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
