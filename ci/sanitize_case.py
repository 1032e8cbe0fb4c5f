"""A representative pack -> attention -> repack -> unpack sequence for ``compute-sanitizer --tool memcheck``.

Run on the GPU machine from the repo root: ``compute-sanitizer --tool memcheck python -m ci.sanitize_case``.
Mixed lengths (1..577), a fused extra token, a capacity-bounded repack and a too-small capacity, fp16 and bf16.
"""

from __future__ import annotations

import torch

from triton_impl import attention as ta
from triton_impl import pack as tp


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(6, 577, 768, generator=gen).to("cuda", dtype)
        keep = torch.rand(6, 577, generator=gen) < torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0, 0.3])[:, None]
        keep[:, 0] = True
        tokens, cu, bound = tp.pack(x, keep.cuda())
        qkv = torch.randn(tokens.shape[0], 3 * 768, generator=gen).to("cuda", dtype)
        out = ta.ragged_attention_qkv(qkv, cu, bound, 12)
        keep2 = (torch.rand(tokens.shape[0], generator=gen) < 0.5).cuda()
        keep2[cu[:-1].long()] = True
        extra = torch.randn(6, 768, generator=gen).to("cuda", dtype)
        t2, cu2, b2 = tp.repack(out, cu, keep2, bound, extra_token=extra)
        tp.repack(out, cu, keep2, bound, capacity=int(cu2[-1]) + 50)
        tp.repack(out, cu, keep2, bound, capacity=5)
        tp.unpack(t2, cu2, b2)
        tp.cls_rows(t2, cu2)
        for d in (32, 128):
            q = torch.randn(tokens.shape[0], 4, d, generator=gen).to("cuda", dtype)
            ta.ragged_attention(q, q, q, cu, bound)
    torch.cuda.synchronize()
    print("sanitize case finished")


if __name__ == "__main__":
    main()
