"""Compiles for SM90, on a CPU, every Triton kernel variant a CPU test run launches: ``python -m ci.sm90_compile``.

The CPU suite runs the kernels under Triton's interpreter, which executes them as Python, so what only compiling
checks passes there and fails on a GPU's first call: a loop-carried variable that changes type, a ``tl.dot`` narrower
than 16, shared memory past the card's. Triton's CPU wheel carries ptxas, so a CPU can compile for SM90 without a GPU.

    python -m ci.sm90_compile [--jobs N] [--out FILE] [pytest args or test paths]

1. Runs pytest (default: ``tests -m interpreter``, the kernels' CPU twins) under the interpreter with this module as a
   plugin, which records each launch's kernel, argument types, constexpr values, warps and stages
   (:func:`signature_of`; ``RAGGED_RECORD_KERNELS`` names the file).
2. Compiles each distinct variant for SM90 (``GPUTarget("cuda", 90, 32)``: Triton's front end, its passes, ptxas) in
   ``--jobs`` processes without ``TRITON_INTERPRET`` (under it ``triton.jit`` gives interpreted functions).

Prints each failure (and each variant past SM90's 227 KiB of shared memory) and exits 1 if there is any, else 0;
``--out`` keeps every variant's result as JSON. Integers compile as ``i32`` (``i64`` past it) without Triton's
divisibility hints, and compile options other than warps and stages are not recorded (the interpreter drops them), so
the generated code is close to, not the same as, a GPU's: this checks that it compiles, not how fast it runs.
``tests/test_sm90_compile.py`` compiles a few variants on every CPU run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD_ENV = "RAGGED_RECORD_KERNELS"
SMEM_BYTES = 227 * 1024
_POINTER_TYPES = {
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int8": "i8", "int16": "i16",
    "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1",
}  # fmt: skip


def signature_of(fn, args: tuple, kwargs: dict) -> dict:
    """One launch of the jitted function ``fn`` as a compilable variant: its module and name, each non-constexpr
    parameter's Triton type, each constexpr's value, and the launch's warps and stages."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False))  # the rest by keyword or default
    bound.update({k: v for k, v in kwargs.items() if k in params})
    types, consts = {}, {}
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            consts[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
        elif hasattr(value, "dtype") and hasattr(value, "data_ptr"):
            types[name] = "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            types[name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    file = inspect.getsourcefile(fn)
    return {"module": fn.__module__, "file": file, "name": fn.__name__, "types": types, "consts": consts,
            "options": options}  # fmt: skip


def pytest_configure(config) -> None:
    """The plugin: with ``RAGGED_RECORD_KERNELS`` set, every interpreted launch appends its variant to that file."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    from triton.runtime.interpreter import InterpretedFunction

    run, seen = InterpretedFunction.run, set()

    def recording(self, *args, grid, warmup, **kwargs):
        variant = json.dumps(signature_of(self.fn, args, kwargs), sort_keys=True)
        if variant not in seen:
            seen.add(variant)
            with open(path, "a") as f:
                f.write(variant + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording


def compile_variant(variant: dict) -> int | str:
    """Compiles one recorded variant for SM90: its shared memory in bytes, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        kernel = getattr(_module(variant), variant["name"])
        names = inspect.signature(kernel.fn).parameters
        consts = variant["consts"]
        signature = {n: "constexpr" if n in consts else variant["types"][n] for n in names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=variant["options"])
        return compiled.metadata.shared
    except Exception as error:  # noqa: BLE001 - reported per variant
        root = error
        while root.__cause__ is not None:  # Triton's CompilationError holds the compiler's own error as its cause
            root = root.__cause__
        where = "" if root is error else f"{str(error)[-1500:]}\n  "
        return f"{where}{type(root).__name__}: {str(root)[-1500:]}"


def _module(variant: dict):
    """The kernel's module: by name, or from its file (a test module, imported by pytest under its bare name)."""
    try:
        return importlib.import_module(variant["module"])
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(variant["module"], variant["file"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[variant["module"]] = module
        spec.loader.exec_module(module)
        return module


def compile_all(variants: list[dict], jobs: int) -> list[int | str]:
    """:func:`compile_variant` of each, in ``jobs`` processes (this one must not be interpreting)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("compile_all: unset TRITON_INTERPRET (under it triton.jit gives interpreted functions)")
    if jobs == 1:
        return [compile_variant(v) for v in variants]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(compile_variant, variants))


def label(variant: dict) -> str:
    """``module.kernel(pointer types; constexprs) options``."""
    pointers = ",".join(sorted({t for t in variant["types"].values() if t.startswith("*")}))
    consts = ", ".join(f"{k}={v}" for k, v in variant["consts"].items() if v is not None)
    return f"{variant['module']}.{variant['name']}({pointers}; {consts}) {variant['options']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s [options] [pytest args]")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: cores)")
    parser.add_argument("--out", default=None, help="every variant's result as JSON")
    opts, rest = parser.parse_known_args(argv)
    if opts.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {opts.jobs}")
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "kernels.jsonl"
        env = {**os.environ, "TRITON_INTERPRET": "1", RECORD_ENV: str(record)}
        paths = rest or ["tests", "-m", "interpreter"]
        pytest = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "ci.sm90_compile", "-p", "no:cacheprovider"]
        ran = subprocess.run(pytest, cwd=REPO, env=env)
        if not record.exists():
            print("no kernel launched under the interpreter: nothing to compile")
            return 1 if ran.returncode else 0
        lines = {line for line in record.read_text().splitlines() if line}
    variants = sorted((json.loads(line) for line in lines), key=label)
    print(f"compiling {len(variants)} kernel variants for SM90 in {opts.jobs} processes")
    env_interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        results = compile_all(variants, opts.jobs)
    finally:
        if env_interpret is not None:
            os.environ["TRITON_INTERPRET"] = env_interpret
    failed = [(v, r) for v, r in zip(variants, results, strict=True) if not isinstance(r, int) or r > SMEM_BYTES]
    for variant, result in failed:
        why = result if isinstance(result, str) else f"{result} bytes of shared memory (SM90: {SMEM_BYTES})"
        print(f"FAILED {label(variant)}\n  {why}")
    if opts.out:
        kept = [{**v, "result": r} for v, r in zip(variants, results, strict=True)]
        Path(opts.out).write_text(json.dumps(kept, indent=1))
    print(f"sm90 compile: {len(variants) - len(failed)} of {len(variants)} variants compile"
          f"{'' if ran.returncode == 0 else f' (pytest exited {ran.returncode})'}")  # fmt: skip
    return 1 if failed or ran.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
