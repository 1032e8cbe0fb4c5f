"""Device time of ATS's two decision kernels (GPU machine): ``python -m ci.ats_kernels``.

DeiT-B shapes (12 heads of 64, 197 rows per image), fp16 qkv. For each batch size: the logits kernel, the sample
kernel computing only the scores, the sample kernel sampling from given scores, and the whole ``ats_select``;
each captured 50 times into one CUDA graph and replayed 20 times (``benchmarks.timing.device_us``), so launch
overhead is not counted. Prints a table.
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks import has_gpu
from benchmarks.timing import device_us
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.reference.pruners import ATSPruner
from ragged_vit.triton_impl import ats
from ragged_vit.triton_impl.cls_attention import cls_attention_logits


def measure(batch: int, n: int, gen: torch.Generator) -> tuple[float, float, float, float]:
    """Microseconds of the logits kernel, the scores-only sample kernel, sampling from scores, ``ats_select``."""
    heads, head_dim = 12, 64
    scale = head_dim**-0.5
    lengths = torch.randint(n // 2, n + 1, (batch,), generator=gen)
    cu = cu_seqlens_from_counts(lengths).cuda()
    qkv = torch.randn(int(lengths.sum()), 3 * heads * head_dim, generator=gen).cuda().half()
    scores = ats.ats_scores(qkv, cu, heads, scale, n)
    logits, squares = cls_attention_logits(qkv, cu, heads, scale, n, values=True)
    out = torch.empty_like(scores)
    pruner = ATSPruner()
    inp = DecisionInput(qkv[:, : heads * head_dim], cu, 0, n - 1, n, qkv, heads, scale)
    us = functools.partial(device_us, calls_per_graph=50)
    return (
        us(lambda: cls_attention_logits(qkv, cu, heads, scale, n, values=True)),
        us(lambda: ats._sample(logits, squares, out, cu, n, 1, 0, 1, from_logits=True, sample=False)),
        us(lambda: ats.ats_keep(scores, cu, n, n - 1, 8, check_values=False)),
        us(lambda: ats.ats_select(pruner, inp)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,64")
    parser.add_argument("--tokens", type=int, default=197)
    args = parser.parse_args()
    if not has_gpu("python -m ci.ats_kernels"):
        return
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name())
    print("| B | logits | scores only | sample from scores | ats_select |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        times = measure(batch, args.tokens, gen)
        print(f"| {batch} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
