"""ragged_vit.triton_impl.launcher: when the cached compiled launch may be used."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ragged_vit.triton_impl import launcher


def test_hooks_detected_in_hook_chains():
    """Profilers install Triton launch hooks; the cached launch must then step aside (it passes no hooks)."""
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no HookChain launch hooks")
    assert not launcher._hooks_installed()

    def hook(metadata):
        return None

    chain.add(hook)
    try:
        assert launcher._hooks_installed()
    finally:
        chain.remove(hook)
    assert not launcher._hooks_installed()


def test_interpreter_never_caches(device):
    """Under the interpreter there is no compiled handle: every launch takes Triton's own path."""
    if device != "cpu":
        pytest.skip("interpreter-only check; the GPU twin is test_cached_launch_respects_specialisation_gpu")
    import torch

    from ragged_vit.triton_impl import attention as ta

    qkv = torch.randn(5, 3 * 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    ta.ragged_attention_qkv(qkv, cu, 5, 1)
    ta.ragged_attention_qkv(qkv, cu, 5, 1)
    assert ta._launcher.cache_size() == 0


@triton.jit
def _program_ids(OUT):
    x, y, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    flat = (x * tl.num_programs(1) + y) * tl.num_programs(2) + z
    tl.store(OUT + flat, flat)


def test_cached_launch_covers_every_grid_dimension(device):
    """The cached launch must pass the whole grid: a 3-D grid once ran its cached launches on z = 0 only."""
    import torch

    run = launcher.CompiledLauncher(_program_ids)
    grid = (2, 3, 4)
    for call in range(3):  # the first call compiles, the later ones take the cached handle (on a GPU)
        out = torch.full((24,), -1, dtype=torch.int32, device=device)
        run(("ids",), out.get_device() if out.is_cuda else 0, grid, (out,), num_warps=1, num_stages=1)
        assert torch.equal(out.cpu(), torch.arange(24, dtype=torch.int32)), f"call {call}"
    assert run.cache_size() == (1 if device == "cuda" else 0)


def test_host_cdiv_and_next_power_of_2_are_tritons():
    """The launch paths size grids and tiles with these plain functions instead of Triton's constexpr-wrapped ones:
    the same integers for every argument a launch path passes (non-negative sizes; positive divisors)."""
    for n in range(0, 5000):
        assert launcher.next_power_of_2(n) == triton.next_power_of_2(n), n
    for n in (2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1):
        assert launcher.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 700):
        for b in (1, 2, 3, 7, 16, 32, 64, 100, 128, 1024):
            assert launcher.cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float16, torch.int64])
def test_scratch_views_are_disjoint_aligned_and_of_the_asked_lengths(dtype):
    lengths = (5, 0, 1, 7, 16, 3)
    views = launcher.scratch(lengths, dtype, torch.device("cpu"))
    assert [v.numel() for v in views] == list(lengths) and all(v.dtype == dtype and v.dim() == 1 for v in views)
    filled = [v for v in views if v.numel()]  # an empty view's data_ptr is 0
    base = filled[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in filled)  # one allocation
    end = 0
    for v in filled:  # in order, disjoint, each 16-byte aligned
        start = v.data_ptr() - base
        assert start % 16 == 0 and start >= end
        end = start + v.numel() * v.element_size()
