"""Where the host time of one attention call goes (GPU machine): ``python -m ci.dispatch_profile``.

Times back-to-back calls (``benchmarks.timing.wall_time``: host clock, synchronize once per 200 calls, median of
15 rounds, after 20 warm-up calls) of: the public entry, the launcher on prepared views, Triton's ``kernel[grid]``
on prepared arguments, the compiled kernel's own ``run``, an empty Triton kernel, and FA2 through
``aten._flash_attention_forward``. Small B=1 workload: device time is ~4 us.
"""

from __future__ import annotations

import cProfile
import pstats

import torch
import triton

from benchmarks import has_gpu
from benchmarks.timing import wall_time, warmup
from ragged_vit.core.segments import cu_seqlens_from_counts
from ragged_vit.reference.attention import split_qkv
from ragged_vit.triton_impl import attention as ta
from ragged_vit.triton_impl.configs import attention_config


@triton.jit
def _empty(X):
    pass


def _per_call_us(fn) -> float:
    warmup([fn], n=20)
    return wall_time([fn], 200, rounds=15).median


def main() -> None:
    if not has_gpu("python -m ci.dispatch_profile"):
        return
    torch.set_num_threads(1)
    cu = cu_seqlens_from_counts(torch.tensor([90])).cuda()
    qkv = torch.randn(90, 3 * 768, device="cuda", dtype=torch.float16)
    out = torch.empty(90, 768, device="cuda", dtype=torch.float16)
    q, k, v = split_qkv(qkv, 12)
    cfg = attention_config(qkv.device, 64, 90.0)
    args = (qkv, qkv, qkv, out, cu, None, None, None, 90, 0, 0, 0, 0.125 * 1.4426950408889634, 2304, 64, 1, 2304, 64,
            1, 2304, 64, 1, 768, 64, 1, 768, 1536, 12, 64, 64, cfg.block_m, cfg.block_n, False, False, False,
            "tf32")  # fmt: skip  # no key bias, no rotary
    grid = (triton.cdiv(197, cfg.block_m) if cfg.grid_per_tile else 1, 12)
    launch = ta._ragged_attention_kernel[grid]
    compiled = launch(*args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    stream = torch.cuda.current_stream().cuda_stream

    def compiled_run():
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args)  # fmt: skip

    rows = {
        "public ragged_attention_qkv(out=)": lambda: ta.ragged_attention_qkv(qkv, cu, 197, 12, out=out),
        "public ragged_attention_qkv": lambda: ta.ragged_attention_qkv(qkv, cu, 197, 12),
        "custom op": lambda: torch.ops.ragged_vit.ragged_attention_qkv(qkv, cu, 197, 12, 0.125),
        "separate q, k, v views (binder path)": lambda: ta.ragged_attention(q, k, v, cu, 197),
        "kernel[grid](...) prepared args": lambda: launch(*args, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        "compiled.run(...) direct": compiled_run,
        "empty triton kernel[grid]": lambda: _empty[(1,)](qkv),
        "split_qkv only": lambda: split_qkv(qkv, 12),
        "fa2 aten": lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 90, 90, 0.0, False, False),
        "torch add (one elementwise op)": lambda: torch.add(out, out, out=out),
    }  # fmt: skip
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for name, fn in rows.items():
        print(f"{name:40s} {_per_call_us(fn):7.2f} us/call")
    from ragged_vit.triton_impl.launcher import _hooks_installed

    print(f"cached specialisations: {ta._launcher.cache_size()}, launch hooks installed: {_hooks_installed()}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        ta.ragged_attention_qkv(qkv, cu, 197, 12, out=out)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
