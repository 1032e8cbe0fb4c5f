"""Compiling for SM90 on the CPU (``ci.sm90_compile``): what the interpreter cannot see.

The interpreter runs a kernel as Python, so what only compiling checks (a loop-carried variable that changes type, a
dot's operand shapes, shared memory past the card's) passes under it and fails on a GPU's first call. Here, in a child
process without ``TRITON_INTERPRET`` (under it ``triton.jit`` gives interpreted functions, which do not compile):
the tool's recording of a launch, its report of a kernel that does not compile (a loop-carried variable that changes
type) beside one that does, and the RoPE variants of the attention and CLS-logits kernels with the launch
configurations of the SM90 bands (``ragged_vit.triton_impl.configs``). ``python -m ci.sm90_compile`` does the same
for every variant a test run launches.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from ci.sm90_compile import SMEM_BYTES, signature_of

REPO = Path(__file__).resolve().parents[1]


@triton.jit
def _rows_kernel(X, OUT, n, BLOCK: tl.constexpr):
    """A grid-stride loop whose carried variables keep their types."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(OUT + tl.arange(0, BLOCK), total)


@triton.jit
def _retyped_kernel(X, OUT, n, BLOCK: tl.constexpr):
    """``first`` is a scalar before the loop and a tile inside it: the interpreter runs it, the compiler refuses."""
    first = tl.load(X)
    for start in range(0, n, BLOCK):
        first = tl.load(X + start + tl.arange(0, BLOCK))
    tl.store(OUT + tl.arange(0, BLOCK), first)


def _variant(kernel: str, types: dict, consts: dict, module: str = __name__, divisible=(), **options) -> dict:
    file = sys.modules[module].__file__
    return {"module": module, "file": file, "name": kernel, "types": types, "consts": consts,
            "divisible": list(divisible), "options": options}  # fmt: skip


def _rotary_variants() -> list[dict]:
    """The rotary attention (both layouts, fp16 / bf16 / fp32, head dims 64, 80 and the padded 40, each SM90 band)
    and the rotary CLS logits (both layouts, with and without the values' squares)."""
    from ragged_vit.triton_impl import attention as ta
    from ragged_vit.triton_impl import cls_attention as ca
    from ragged_vit.triton_impl.configs import _bands

    out = []
    for dtype, head_dim, half, band in (("fp16", 64, False, -1), ("bf16", 80, True, 0), ("fp16", 64, True, 0),
                                        ("fp32", 40, False, -1)):  # fmt: skip
        config = _bands((9, 0), head_dim)[band][1]
        types = {n: f"*{dtype}" for n in ("Q", "K", "V", "O")}
        types.update(CU_SEQLENS="*i32", ROPE_TABLE="*fp32", ROPE_POS="*i32", qk_scale="fp32")
        types.update({n: "i32" for n in ("total_rows", "rope_rows", "stride_rh", "stride_rn")})
        types.update({f"stride_{t}{d}": "i32" for t in "qkvo" for d in "thd"})
        consts = {
            "KEY_BIAS": None, "K_OFFSET": 12 * head_dim, "V_OFFSET": 24 * head_dim, "NUM_HEADS": 12,
            "HEAD_DIM": head_dim, "BLOCK_D": ta._block_d(head_dim), "BLOCK_H": ta._block_d(head_dim // 2),
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n, "HAS_BIAS": False, "HAS_ROPE": True, "ROPE_HALF": half,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        }  # fmt: skip
        for n in ("stride_qd", "stride_kd", "stride_vd", "stride_od"):  # contiguous heads: specialised to 1
            types.pop(n)
            consts[n] = 1
        divisible = [n for n, t in types.items() if t.startswith("*")] + ["stride_rn", "stride_qt", "stride_ot"]
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        out.append(_variant("_ragged_attention_kernel", types, consts, ta.__name__, divisible, **options))
    for dtype, half, values in (("fp16", False, True), ("fp32", True, False)):
        types = {"QKV": f"*{dtype}", "CU": "*i32", "LOGITS": "*fp32", "SQUARES": "*fp32", "ROPE_TABLE": "*fp32",
                 "ROPE_POS": "*i32", "scale": "fp32", "total": "i32", "stride": "i32", "rope_rows": "i32",
                 "stride_rh": "i32", "stride_rn": "i32"}  # fmt: skip
        consts = {"H": 12, "D": 64, "BLOCK_T": ca._BLOCK_T, "BLOCK_D": 64, "VALUES": values, "HAS_ROPE": True,
                  "ROPE_HALF": half, "BLOCK_H": 32}  # fmt: skip
        out.append(_variant("_logits_kernel", types, consts, ca.__name__, num_warps=2, num_stages=1))
    return out


def main() -> None:
    """In the child: compiles a sound kernel, the retyped one and the rotary variants; prints each group's results
    (shared bytes and ptxas's registers, or the error) as JSON."""
    from ci.sm90_compile import compile_all

    pointers = {"X": "*fp32", "OUT": "*fp32", "n": "i32"}
    groups = {
        "good": [_variant("_rows_kernel", pointers, {"BLOCK": 64}, num_warps=4, num_stages=2)],
        "retyped": [_variant("_retyped_kernel", pointers, {"BLOCK": 64}, num_warps=4, num_stages=2)],
        "rotary": _rotary_variants(),
    }
    print(json.dumps({name: compile_all(variants, 1, registers=True) for name, variants in groups.items()}))


@functools.cache
def _compiled() -> dict[str, list[dict | str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.test_sm90_compile import main; main()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_ptxas = pytest.mark.skipif(
    not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists() and not shutil.which("ptxas"),
    reason="this Triton has no ptxas to compile for SM90 with",
)


def test_a_launch_is_recorded_as_a_gpu_launch_would_specialise_it():
    """The plugin's record of one launch: pointer and scalar types by parameter, constexprs by value, and Triton's
    specialisations: 16-byte aligned pointers and multiples of 16 divisible by 16, an integer equal to 1 a constant,
    none of them for a parameter in ``do_not_specialize``."""
    x = torch.zeros(64, dtype=torch.float16)
    options = {"BLOCK": 64, "num_warps": 2, "num_stages": 1}
    variant = signature_of(_rows_kernel.fn, (x, x[1:].int(), 7), options)
    assert variant == _variant("_rows_kernel", {"X": "*fp16", "OUT": "*i32", "n": "i32"}, {"BLOCK": 64}, __name__,
                               ["X", "OUT"], num_warps=2, num_stages=1)  # fmt: skip
    assert signature_of(_rows_kernel.fn, (x[1:], x, 32), options)["divisible"] == ["OUT", "n"]
    assert signature_of(_rows_kernel.fn, (x, x, 1), options)["consts"] == {"n": 1, "BLOCK": 64}
    fixed = signature_of(_rows_kernel.fn, (x, x, 1), options, {"do_not_specialize": ["n"]})
    assert fixed["types"]["n"] == "i32" and fixed["divisible"] == ["X", "OUT"]


@needs_ptxas
def test_a_retyped_loop_variable_fails_and_a_sound_kernel_compiles():
    (good,), (retyped,) = _compiled()["good"], _compiled()["retyped"]
    assert isinstance(good, dict) and good["shared"] <= SMEM_BYTES and good["registers"] > 0
    assert isinstance(retyped, str) and "Loop-carried variable" in retyped, retyped


@needs_ptxas
def test_rotary_kernels_compile_for_sm90():
    results = _compiled()["rotary"]
    failed = [r for r in results if isinstance(r, str) or r["shared"] > SMEM_BYTES]
    assert len(results) == 6 and not failed, failed
