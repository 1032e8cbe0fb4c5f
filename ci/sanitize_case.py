"""A representative pack -> attention -> repack -> unpack sequence for ``compute-sanitizer --tool memcheck``.

Run on the GPU machine from the repo root: ``compute-sanitizer --tool memcheck python -m ci.sanitize_case``.
Mixed lengths (1..577), a fused extra token, a capacity-bounded repack and a too-small capacity, fp16 and bf16,
head dims 32 to 256 (80: padded inside the kernel), attention with and without a key bias (aligned, and one element
off an aligned address);
then the pruners' decision kernels (Threshold-L2, ATS, EViT with its fused token, DynamicViT) and ToMe's matching and
merge (fixed and adaptive, into an exact and a larger buffer, and with the residual add and LayerNorm fused) on the
same kind of batch, with an image longer than the bound, empty images, NaN rows, and 0, 1 or 5 prefix rows, and on 40
images (the large-batch tiles) and on one image (the PDL launches on Hopper); then a small ToMe pipeline, eager and
graphed (one image too).
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from benchmarks import has_gpu
from ragged_vit import PrunedViT
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.core.selection import DecisionInput
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.reference.pruners import ATSPruner, DynamicViTPruner, EViTPruner, ToMeMerger
from ragged_vit.triton_impl import ats, dynamicvit, evit, merging, select
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl import pack as tp
from ragged_vit.triton_impl import threshold_l2 as tl2


def decisions(device: str, gen: torch.Generator) -> None:
    """Threshold-L2 and ATS decisions on ragged images (0..700 rows: one past the 577-row bound), NaN rows."""
    lengths = torch.tensor([0, 1, 2, 197, 577, 700, 64])
    cu = cu_seqlens_from_counts(lengths).to(device)
    total = int(lengths.sum())
    qkv = torch.randn(total, 3 * 768, generator=gen).to(device, torch.float16)
    qkv[torch.randperm(total, generator=gen)[:5]] = float("nan")
    scores = tl2.l2_scores(qkv[:, :768])
    select.rank_keep(scores, cu, 577, rate=0.5)
    select.rank_keep(scores, cu, 577, threshold=float(scores.nanmedian()), min_keep=8)
    for pruner in (ATSPruner(), ATSPruner(num_samples=1000, min_keep=600)):
        ats.ats_select(pruner, DecisionInput(qkv[:, :768], cu, 0, 576, None, qkv, 12, 0.125))
    ats.ats_keep(ats.ats_scores(qkv, cu, 12, 0.125, 577), cu, 577, 576, 8)
    # Prefix rows (a class token and four registers; none at all), some images shorter than the prefix.
    select.rank_keep(scores, cu, 577, rate=0.5, num_prefix=5)
    select.rank_keep(scores, cu, 577, count=98, num_prefix=1)
    select.rank_keep(scores, cu, 577, threshold=float(scores.nanmedian()), min_keep=1, num_prefix=0)
    ats.ats_select(ATSPruner(), DecisionInput(qkv[:, :768], cu, 0, 572, None, qkv, 12, 0.125, num_prefix=5))
    keep = select.rank_keep(scores, cu, 577, rate=0.5)[0]
    for prefix in (0, 1, 5):  # EViT scores by the class token: at least one prefix row
        evit.fused_token(qkv[:, :768], scores, keep, cu, num_prefix=prefix)
        inp = DecisionInput(qkv[:, :768], cu, 0, 577 - prefix, None, qkv, 12, 0.125, num_prefix=max(prefix, 1))
        evit.evit_select(EViTPruner(rate=0.5, fuse_token=True).to(device), inp)
        predictor = DynamicViTPruner(768).to(device, torch.float16)
        dynamicvit.dynamicvit_select(predictor, DecisionInput(qkv[:, :768], cu, 0, 577 - prefix, num_prefix=prefix))
    evit.fused_token(qkv[:, 8:208], scores, keep, cu)  # odd channels, misaligned strided rows
    keys = qkv[:, 768:1536].view(total, 12, 64)  # strided: a view of the qkv projection
    sizes = torch.randint(1, 5, (total,), generator=gen, dtype=torch.int32).to(device)
    for prefix in (0, 1, 5):
        for mode in ({"r": 13}, {"threshold": 0.0, "r_max": 40}):
            merged = merging.decide_merges(keys, cu, 577, prefix, **mode)
            sources = (merged.sources, merged.source_offsets)
            merging.merge_rows(qkv[:, :768], sizes, merged.destination, cu, merged.cu_seqlens, sources=sources)
            merging.merge_rows(qkv[:, :768], sizes, merged.destination, cu, merged.cu_seqlens, capacity=total + 9)
            normed = torch.empty(total + 9, 768, device=device, dtype=qkv.dtype)
            weight, bias = torch.randn(2, 768, generator=gen).to(device, qkv.dtype)
            merging.merge_rows(qkv[:, :768], sizes, merged.destination, cu, merged.cu_seqlens, sources=sources,
                               capacity=total + 9, residual=qkv[:, 1536:], normed=normed, norm_weight=weight,
                               norm_bias=bias)  # fmt: skip
    # one image: on a Hopper GPU its best match and match are launched with programmatic dependent launch
    one = cu_seqlens_from_counts(torch.tensor([197])).to(device)
    for prefix in (0, 1):
        for mode in ({"r": 13}, {"threshold": 0.0, "r_max": 40}):
            merged = merging.decide_merges(keys[:197], one, 197, prefix, **mode)
            merging.merge_rows(qkv[:197, :768], sizes[:197], merged.destination, one, merged.cu_seqlens,
                               sources=(merged.sources, merged.source_offsets))
    # 40 ragged images of up to 197 rows: past one wave of the best match's programs (its 32-row tiles)
    many = cu_seqlens_from_counts(torch.randint(0, 198, (40,), generator=gen)).to(device)
    big = torch.randn(int(many[-1]), 12, 64, generator=gen).to(device, torch.float16)
    for mode in ({"r": 13}, {"threshold": 0.0, "r_max": 40}):
        merged = merging.decide_merges(big, many, 197, 1, **mode)
        merging.merge_rows(big.flatten(1), torch.ones(big.shape[0], dtype=torch.int32, device=device),
                           merged.destination, many, merged.cu_seqlens, sources=(merged.sources, merged.source_offsets))


def tome_pipeline() -> None:
    """A 4-block ViT with ToMe, fixed and adaptive, eager and graphed (fp16, Triton)."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=96, patch_size=16, embed_dim=128, depth=4, num_heads=2).cuda().half().eval()
    images = torch.randn(3, 3, 96, 96, device="cuda", dtype=torch.float16)
    for mode in ({"r": 6}, {"threshold": 0.2, "r_max": 8}):
        pv = PrunedViT(model, ToMeMerger(depth=4, **mode), "triton")
        pv.run(images)
        GraphedPrunedViT(pv).run(images)
        GraphedPrunedViT(pv).run(images[:1])  # one image: the decision's PDL launches, captured


def main() -> None:
    if not has_gpu("python -m ci.sanitize_case"):
        return
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(6, 577, 768, generator=gen).to("cuda", dtype)
        keep = torch.rand(6, 577, generator=gen) < torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0, 0.3])[:, None]
        keep[:, 0] = True
        tokens, cu, bound = tp.pack(x, keep.cuda())
        qkv = torch.randn(tokens.shape[0], 3 * 768, generator=gen).to("cuda", dtype)
        out = ta.ragged_attention_qkv(qkv, cu, bound, 12)
        bias = torch.randn(tokens.shape[0] + 1, generator=gen).cuda()
        ta.ragged_attention_qkv(qkv, cu, bound, 12, key_bias=bias[:-1])
        keep2 = (torch.rand(tokens.shape[0], generator=gen) < 0.5).cuda()
        keep2[cu[:-1].long()] = True
        extra = torch.randn(6, 768, generator=gen).to("cuda", dtype)
        t2, cu2, b2 = tp.repack(out, cu, keep2, bound, extra_token=extra)
        tp.repack(out, cu, keep2, bound, capacity=int(cu2[-1]) + 50)
        tp.repack(out, cu, keep2, bound, capacity=5)
        tp.unpack(t2, cu2, b2)
        tp.cls_rows(t2, cu2)
        for d in (32, 80, 128, 256):  # 80, 256: padded or wide head dims
            q = torch.randn(tokens.shape[0], 4, d, generator=gen).to("cuda", dtype)
            ta.ragged_attention(q, q, q, cu, bound)
            ta.ragged_attention(q, q, q, cu, bound, key_bias=bias[1:])
    decisions("cuda", gen)
    tome_pipeline()
    torch.cuda.synchronize()
    print("sanitize case finished")


if __name__ == "__main__":
    main()
