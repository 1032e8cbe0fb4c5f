"""Compiles for SM90, on a CPU, every Triton kernel variant a CPU test run launches: ``python -m ci.sm90_compile``.

The CPU suite runs the kernels under Triton's interpreter, which executes them as Python, so what only compiling
checks passes there and fails on a GPU's first call: a loop-carried variable that changes type, a ``tl.dot`` narrower
than 16, shared memory past the card's. Triton's CPU wheel carries ptxas, so a CPU can compile for SM90 without a GPU.

    python -m ci.sm90_compile [--jobs N] [--out FILE] [--registers] [pytest args or test paths]

1. Runs pytest (default: ``tests -m interpreter``, the kernels' CPU twins) under the interpreter with this module as a
   plugin, which records each launch's kernel, argument types, constexpr values, warps and stages, as Triton would
   specialise the launch on a GPU (integers equal to 1 as constants, 16-byte aligned pointers and multiples of 16 as
   divisible by 16; :func:`signature_of`; ``RAGGED_RECORD_KERNELS`` names the file).
2. Compiles each distinct variant for SM90 (``GPUTarget("cuda", 90, 32)``: Triton's front end, its passes, ptxas) in
   ``--jobs`` processes without ``TRITON_INTERPRET`` (under it ``triton.jit`` gives interpreted functions), with
   those divisibility hints (vector loads where a GPU launch would have them).

Prints each failure (and each variant past SM90's 227 KiB of shared memory) and exits 1 if there is any, else 0;
``--registers`` adds ptxas's registers and spill bytes per thread, and lists the variants that spill (a cost, not a
failure); ``--out`` keeps every variant's result as JSON. The CPU's tensors stand in for the GPU's (their alignment,
strides and sizes), and compile options other than warps and stages are not recorded (the interpreter drops them), so
the generated code is close to, not the same as, a GPU's: this checks that it compiles, not how fast it runs.
``tests/test_sm90_compile.py`` compiles a few variants on every CPU run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD_ENV = "RAGGED_RECORD_KERNELS"
SMEM_BYTES = 227 * 1024


def signature_of(fn, args: tuple, kwargs: dict, jit_options: dict | None = None) -> dict:
    """One launch of the jitted function ``fn`` as a compilable variant: its module and name, each non-constexpr
    parameter's Triton type, each constexpr's value, the parameters a GPU launch would mark divisible by 16
    (``divisible``: 16-byte aligned pointers, integers that are multiples of 16), and the launch's warps and stages.
    Types and specialisations are Triton's own for these arguments (``native_specialize_impl``: an integer equal to 1
    becomes a constexpr), with the kernel's ``do_not_specialize`` and ``do_not_specialize_on_alignment``
    (``jit_options``, as ``triton.jit`` got them)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(fn).parameters
    names = list(params)
    bound = dict(zip(params, args, strict=False))  # the rest by keyword or default
    bound.update({k: v for k, v in kwargs.items() if k in params})
    jit_options = jit_options or {}

    def listed(option: str) -> set[str]:
        return {names[n] if isinstance(n, int) else n for n in jit_options.get(option) or ()}

    fixed, unaligned = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    types, consts, divisible = {}, {}, []
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            consts[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, name not in fixed, name not in unaligned)
        if kind == "constexpr":
            consts[name] = key
            continue
        types[name] = kind
        if key == "D":
            divisible.append(name)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    file = inspect.getsourcefile(fn)
    return {"module": fn.__module__, "file": file, "name": fn.__name__, "types": types, "consts": consts,
            "divisible": divisible, "options": options}  # fmt: skip


def pytest_configure(config) -> None:
    """The plugin: with ``RAGGED_RECORD_KERNELS`` set, every interpreted launch appends its variant to that file."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    from triton.runtime.interpreter import InterpretedFunction

    run, seen = InterpretedFunction.run, set()

    def recording(self, *args, grid, warmup, **kwargs):
        variant = json.dumps(signature_of(self.fn, args, kwargs, self.kwargs), sort_keys=True)
        if variant not in seen:
            seen.add(variant)
            with open(path, "a") as f:
                f.write(variant + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording


def compile_variant(variant: dict, registers: bool = False) -> dict | str:
    """Compiles one recorded variant for SM90: its shared memory in bytes (``shared``) and, with ``registers``,
    ptxas's registers and spill-store bytes per thread (``registers``, ``spill_bytes``); or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        kernel = getattr(_module(variant), variant["name"])
        names = list(inspect.signature(kernel.fn).parameters)
        consts = variant["consts"]
        signature = {n: "constexpr" if n in consts else variant["types"][n] for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in variant["divisible"]}
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=variant["options"])
        result = {"shared": compiled.metadata.shared}
        if registers:
            result.update(_ptxas_usage(compiled.asm["ptx"]))
        return result
    except Exception as error:  # noqa: BLE001 - reported per variant
        root = error
        while root.__cause__ is not None:  # Triton's CompilationError holds the compiler's own error as its cause
            root = root.__cause__
        where = "" if root is error else f"{str(error)[-1500:]}\n  "
        return f"{where}{type(root).__name__}: {str(root)[-1500:]}"


def _ptxas_usage(ptx: str) -> dict:
    """``ptxas -v``'s registers and spill-store bytes per thread for SM90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        cmd = [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source), "-o", str(Path(tmp) / "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(used.group(1)) if used else 0, "spill_bytes": int(spills.group(1)) if spills else 0}


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


def compile_all(variants: list[dict], jobs: int, registers: bool = False) -> list[dict | str]:
    """:func:`compile_variant` of each, in ``jobs`` processes (this one must not be interpreting)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("compile_all: unset TRITON_INTERPRET (under it triton.jit gives interpreted functions)")
    compile_one = functools.partial(compile_variant, registers=registers)
    if jobs == 1:
        return [compile_one(v) for v in variants]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(compile_one, variants))


def label(variant: dict) -> str:
    """``module.kernel(pointer types; constexprs) options``."""
    pointers = ",".join(sorted({t for t in variant["types"].values() if t.startswith("*")}))
    consts = ", ".join(f"{k}={v}" for k, v in variant["consts"].items() if v is not None)
    return f"{variant['module']}.{variant['name']}({pointers}; {consts}) {variant['options']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s [options] [pytest args]")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: cores)")
    parser.add_argument("--out", default=None, help="every variant's result as JSON")
    parser.add_argument("--registers", action="store_true", help="also ptxas's registers and spills per thread")
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
        results = compile_all(variants, opts.jobs, opts.registers)
    finally:
        if env_interpret is not None:
            os.environ["TRITON_INTERPRET"] = env_interpret
    failed = [(v, r) for v, r in zip(variants, results, strict=True) if isinstance(r, str) or r["shared"] > SMEM_BYTES]
    for variant, result in failed:
        why = result if isinstance(result, str) else f"{result['shared']} bytes of shared memory (SM90: {SMEM_BYTES})"
        print(f"FAILED {label(variant)}\n  {why}")
    spilled = [(v, r) for v, r in zip(variants, results, strict=True) if isinstance(r, dict) and r.get("spill_bytes")]
    for variant, result in spilled:  # a cost, not a failure: the variant runs, slower
        print(f"spills {result['spill_bytes']} bytes/thread ({result['registers']} registers): {label(variant)}")
    if opts.out:
        kept = [{**v, "result": r} for v, r in zip(variants, results, strict=True)]
        Path(opts.out).write_text(json.dumps(kept, indent=1))
    spills = f", {len(spilled)} spill registers" if opts.registers else ""
    print(f"sm90 compile: {len(variants) - len(failed)} of {len(variants)} variants compile{spills}"
          f"{'' if ran.returncode == 0 else f' (pytest exited {ran.returncode})'}")  # fmt: skip
    return 1 if failed or ran.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
