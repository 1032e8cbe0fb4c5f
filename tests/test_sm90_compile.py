"""The RoPE variants of the attention and CLS-attention kernels compile for SM90 on the CPU: Triton's front end, its
passes and ptxas, without a GPU. The interpreter runs a kernel as Python, so what only compilation checks (a
loop-carried variable that changes type, a dot's operand shapes, shared memory past the card's) passes under it and
fails on the first GPU call; this catches it in the CPU suite. Each variant takes the launch configuration the SM90
bands give it (``ragged_vit.triton_impl.configs``). The compiles run in a child process without
``TRITON_INTERPRET`` (under it ``triton.jit`` gives interpreted functions, which do not compile)."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO = Path(__file__).resolve().parents[1]
SMEM_BYTES = 227 * 1024  # an SM90 program's shared memory
# (label, kernel, dtype, head dim, half layout, SM90 band: 0 short sequences, -1 long; values for the CLS logits)
VARIANTS = (
    ("attention fp16 d64 interleaved long", "attention", "fp16", 64, False, -1),
    ("attention bf16 d80 half short", "attention", "bf16", 80, True, 0),
    ("attention fp16 d64 half short", "attention", "fp16", 64, True, 0),
    ("attention fp32 d40 interleaved long", "attention", "fp32", 40, False, -1),
    ("cls logits fp16 interleaved values", "cls", "fp16", 64, False, True),
    ("cls logits fp32 half", "cls", "fp32", 64, True, False),
)


def _compile(kernel, types: dict[str, str], consts: dict[str, object], num_warps: int, num_stages: int):
    """``kernel`` compiled for SM90 with ``consts`` (constexpr values) and ``types`` (the other arguments' Triton
    types, ``i32`` where not named)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_variant(kind: str, dtype: str, head_dim: int, half: bool, option: int | bool) -> int:
    """Compiles one variant of :data:`VARIANTS`; returns its shared memory in bytes."""
    from ragged_vit.triton_impl import attention as ta
    from ragged_vit.triton_impl import cls_attention as ca
    from ragged_vit.triton_impl.configs import _bands

    if kind == "cls":
        types = {"QKV": f"*{dtype}", "CU": "*i32", "LOGITS": "*fp32", "SQUARES": "*fp32", "ROPE_TABLE": "*fp32",
                 "ROPE_POS": "*i32", "scale": "fp32"}  # fmt: skip
        consts = {"H": 12, "D": head_dim, "BLOCK_T": ca._BLOCK_T, "BLOCK_D": triton.next_power_of_2(head_dim),
                  "VALUES": option, "HAS_ROPE": True, "ROPE_HALF": half,
                  "BLOCK_H": triton.next_power_of_2(head_dim // 2)}  # fmt: skip
        return _compile(ca._logits_kernel, types, consts, num_warps=2, num_stages=1).metadata.shared
    config = _bands((9, 0), head_dim)[option][1]
    types = {n: f"*{dtype}" for n in ("Q", "K", "V", "O")}
    types.update(CU_SEQLENS="*i32", ROPE_TABLE="*fp32", ROPE_POS="*i32", qk_scale="fp32")
    consts = {
        "KEY_BIAS": None, "K_OFFSET": 12 * head_dim, "V_OFFSET": 24 * head_dim, "NUM_HEADS": 12, "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_H": max(ta._MIN_DOT, triton.next_power_of_2(head_dim // 2)),
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "HAS_BIAS": False, "HAS_ROPE": True, "ROPE_HALF": half,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }  # fmt: skip
    kernel = _compile(ta._ragged_attention_kernel, types, consts, config.num_warps, config.num_stages)
    return kernel.metadata.shared


def main() -> None:
    """Compiles every variant; prints ``{label: shared bytes or the error}`` as JSON."""
    results = {}
    for label, *variant in VARIANTS:
        try:
            results[label] = compile_variant(*variant)
        except Exception as error:  # noqa: BLE001 - reported per variant, the test names it
            results[label] = f"{type(error).__name__}: {str(error)[-1500:]}"
    print(json.dumps(results))


def _ptxas() -> bool:
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists() or bool(
        shutil.which("ptxas")
    )


@pytest.mark.skipif(not _ptxas(), reason="this Triton has no ptxas to compile for SM90 with")
def test_rotary_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.test_sm90_compile import main; main()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {label: r for label, r in results.items() if not isinstance(r, int) or r > SMEM_BYTES}
    assert not failed, failed
