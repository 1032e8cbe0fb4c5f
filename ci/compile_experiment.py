"""Does torch.compile of the non-attention work help the graphed pruned forward? (GPU machine)

``python -m ci.compile_experiment``: DeiT-B 224 fp16, Threshold-L2 ratio 50% after block 3 (fixed counts: one
CUDA graph per batch size), Triton backend. Per batch size: the graphed runner without and with
``compile_blocks`` (Inductor fusions around the GEMMs, attention as the custom op), and the unpruned timm model
under ``torch.compile(mode="reduce-overhead")`` -- the user's real alternative -- in the same run. Prints img/s
(median of timed forwards, each synchronised) and the max |logit diff| between the two graphed variants.
"""

from __future__ import annotations

import time

import torch

from ragged_vit.pipelines.factory import build_pipeline
from ragged_vit.pipelines.graphs import GraphedPrunedViT


def _img_per_s(forward, images: list[torch.Tensor], iters: int = 30) -> float:
    for i in range(5):
        forward(images[i % len(images)])
    torch.cuda.synchronize()
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        forward(images[i % len(images)])
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return images[0].shape[0] / sorted(samples)[len(samples) // 2]


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| B | unpruned timm reduce-overhead | pruned graphed | pruned graphed + compile_blocks | compile gain "
          "| best / reduce-overhead | max abs logit diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 4, 64):
        images = [torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16) for _ in range(3)]
        plain = build_pipeline("deit_base_patch16_224", "threshold_l2", 0.5, "triton").cuda().half()
        fused = build_pipeline("deit_base_patch16_224", "threshold_l2", 0.5, "triton").cuda().half()
        fused.load_state_dict(plain.state_dict())
        fused.compile_blocks = True
        g_plain, g_fused = GraphedPrunedViT(plain), GraphedPrunedViT(fused)
        t_compile = time.perf_counter()
        diff = (g_plain(images[0]) - g_fused(images[0])).abs().max().item()
        t_compile = time.perf_counter() - t_compile
        r_plain = _img_per_s(g_plain, images)
        r_fused = _img_per_s(g_fused, images)
        timm_model = plain.model
        compiled = torch.compile(timm_model, mode="reduce-overhead")
        with torch.no_grad():
            r_timm = _img_per_s(compiled, images)
        best = max(r_plain, r_fused)
        print(f"| {batch} | {r_timm:,.0f} | {r_plain:,.0f} | {r_fused:,.0f} | {r_fused / r_plain:.2f}x "
              f"| {best / r_timm:.2f}x | {diff:.2e} |  (first fused call incl. compile+capture {t_compile:.0f} s)")
        del g_plain, g_fused, compiled
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
