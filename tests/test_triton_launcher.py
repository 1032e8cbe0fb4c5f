"""triton_impl.launcher: when the cached compiled launch may be used."""

from __future__ import annotations

import pytest

from triton_impl import launcher


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

    from triton_impl import attention as ta

    qkv = torch.randn(5, 3 * 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    ta.ragged_attention_qkv(qkv, cu, 5, 1)
    ta.ragged_attention_qkv(qkv, cu, 5, 1)
    assert ta._launcher.cache_size() == 0
