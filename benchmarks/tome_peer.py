"""ToMe's algorithm as its users run it: timm's own ``VisionTransformer`` with its blocks patched, on the dense batch.

The peer of our ToMe pipeline (issue 15). Token Merging (Bolya et al., ICLR 2023) is usually run by patching a
timm model in place: each block's forward is replaced by one that computes attention explicitly (the
proportional-attention bias ``log(size)`` on the keys needs the logits) and merges tokens between the attention
and the MLP. A user who knows SDPA can pass that bias as its ``attn_mask`` instead (an additive float mask,
broadcast over heads and queries): :func:`patch_tome`'s ``attention="sdpa"``, timed as a second peer. With a fixed
``r`` every image merges the same number of rows, so the batch stays a dense ``[B, N', C]`` tensor and the whole
forward is static: it runs under ``torch.compile(mode="reduce-overhead")`` (no host reads, no data-dependent
shapes).

:func:`patch_tome` applies that patch (written from the paper and ``docs/tome.md``'s rule, not from ToMe's code).
Per block, with the block's own weights:

1. ``x = x + ls1(attn(norm1(x)))`` with ``softmax(q k^T * scale + log(size)_key) v`` (explicit, or SDPA);
2. bipartite soft matching on the keys of that attention averaged over heads and L2-normalised (fp32), the paper's
   algorithm: A = even positions among all of an image's rows (the class token is A's first), B = odd ones (a
   distillation token is B's first); a prefix row (class, distillation, registers) is never a source (A) nor a
   destination (B); each A row's match is its most similar B row (ties: lowest B index); the ``min(r, patches //
   2)`` A rows of highest best similarity (ties: lower A index first) merge into their matches, several possibly
   into one; a merged row is the size-weighted average (summed in fp32 by ``scatter_add``), its size the sum of
   sizes; the new order is the prefix rows, the other unmerged A rows (in order; in rank order without prefix
   rows), then the other B rows in order;
3. ``x = x + ls2(mlp(norm2(x)))``;

then the final norm and timm's head (``token`` pooling, a distilled DeiT's two heads), or, for ``avg`` pooling, the
size-weighted mean of the patch rows. These are ``ragged_vit.reference.tome.tome_forward``'s merges and results
(``tests/test_tome_peer.py``); the similarities here are one batched GEMM, so exact ties that the reference breaks
by index are only ties here where the GEMM rounds them alike.

The benchmark (on a CUDA GPU, from the repository root)::

    python -m benchmarks.tome_peer --batches 1,4,64 --adaptive-batches 64 --r 13 --out FILE.json

times DeiT-B 224 in fp16 (random seeded weights, or ``RAGGED_VIT_DEIT_B_CHECKPOINT``, as ``benchmarks.e2e_common``)
at each batch size, rotating through 3 input batches (``benchmarks.e2e_common.INPUT_SETS``): unpruned timm eager and
under ``torch.compile(mode="reduce-overhead")``; this peer eager and under reduce-overhead, with explicit attention
and with SDPA; and our pipeline, ``GraphedPrunedViT`` over
``PrunedViT(model, make_pruner("tome", r=r), "triton", compile_blocks=True)`` (row ``ours``). Before timing, each
ToMe row's logits are compared with ``tome_forward`` in fp32 (max |diff|, top-1 agreement, and the fraction of
images whose patches ended in the same rows, from ``sources``); the peer is also run in fp32 against the same
reference (TF32 off): the strict check that its merges are the reference's. fp16 may merge differently where two
similarities lie within fp16's rounding of each other, so its differences are reported, not bounded.

**Adaptive rows** (issue 15's target: adaptive merging at the fixed ``r``'s average token count, within 5% of its
throughput at B=64), at those batch sizes of ``--batches`` that ``--adaptive-batches`` names (default 64): the
threshold is calibrated on the benchmark's own images (the 3 input batches of that size at once) with
``ragged_vit.reference.tome.calibrate_threshold`` in fp32 (TF32 off, on the fp32 model, on the GPU: 30 bisection
steps of ``tome_forward``), with ``r_max = 2 r``, so that the mean rows per image AND block (prefix rows included)
equal the fixed ``r``'s, ``mean(fixed_r_counts(N, [r] * depth))``. Then
``GraphedPrunedViT(PrunedViT(model, make_pruner("tome", threshold=t, r_max=2 r), "triton", compile_blocks=True))``
is timed in fp16 with the default buckets (row ``ours_adaptive``, "reads": a host read of the merged total at every
block's merge, except where ``B * N <= 1024``, below which the defaults already skip them: B <= 5 at 197 rows) and with
``TokenBuckets(sync_free_rows=B * N)`` (row ``ours_adaptive_sync_free``: no host read at all; every block then runs
on the ``B * N`` rows of the unmerged batch, the rows no image owns forming padding images) and with
``TokenBuckets(lagged_reads=True)`` (row ``ours_adaptive_lagged``: every block's total read one block late, while the
device runs on, each buffer sized by the total before). Each adaptive entry
reports the calibration (threshold, seconds, the fp32 reference's mean at it), the host reads per forward, the
pipeline's counts per block over every timed image (patch rows after each block's merge, prefix excluded: mean, min,
max and population std over the images, beside the fixed ``r``'s), its mean rows per image and block against the
fixed ``r``'s (``mean_vs_fixed``), its logits against ``tome_forward`` at the same threshold in fp32, and against
our fixed-``r`` pipeline's on the same images and dtype (``vs_fixed``: max and mean |diff|, top-1 agreement; the
``ours`` row's logits, or a run of its pipeline when that row is not run).

Clocks: ``benchmarks.timing.forward_times``: host wall time per forward, one synchronize around each (img/s = B /
median: ``img_per_s``, the targets' clock), then as many forwards back to back, one synchronize around them all
(``img_per_s_back_to_back``: each forward's host work and graph launch overlap the device work before it, as in a
stream of batches; a forward timed alone pays them). The last thing printed (``render``, which ``python -m
benchmarks.make_results`` also puts in ``docs/results.md``) is two markdown tables, one per clock:
img/s per row and batch, ours vs unpruned reduce-overhead, ours vs the peer's best mode (its fastest row at that
batch), and adaptive / fixed: the faster adaptive row (named) over ``ours``. Nothing asserts a time. ``--rows`` runs
a subset of the rows.

The CPU dry run (hidden flags ``--device cpu --model NAME --quick``, ``tests/test_tome_peer.py``) runs every row
that can run on a CPU, in fp32, on one input batch, with one timed forward (and one back to back): our rows without
``compile_blocks`` (segments run eagerly, the Triton kernels under the interpreter: ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Attention, Block, VisionTransformer

from benchmarks import BASELINES, bench_device, comma_list
from benchmarks.e2e_common import CHECKPOINT_ENV, DEIT_B, INPUT_SETS, Lab, count_summary, logit_diff, no_tf32
from benchmarks.report_e2e import cudagraph_skips, torch_threads, write_json
from benchmarks.timing import describe, elapsed, environment, forward_times, gpu_slug
from ragged_vit.pipelines.buckets import TokenBuckets
from ragged_vit.pipelines.graphs import GraphedPrunedViT
from ragged_vit.pipelines.model import PrunedOutput, PrunedViT
from ragged_vit.reference.merging import fixed_r_counts
from ragged_vit.reference.pruners import make_pruner
from ragged_vit.reference.tome import ToMeOutput, calibrate_threshold, check_model, per_block, tome_forward

ATTENTIONS = ("explicit", "sdpa")
ROW_LABELS = {
    "timm_eager": "unpruned timm, eager",
    "timm_compiled": 'unpruned timm, torch.compile(mode="reduce-overhead")',
    "peer_eager": "ToMe peer (patched timm, explicit attention), eager",
    "peer_compiled": 'ToMe peer (patched timm, explicit attention), torch.compile(mode="reduce-overhead")',
    "peer_sdpa_eager": "ToMe peer (patched timm, SDPA + bias mask), eager",
    "peer_sdpa_compiled": 'ToMe peer (patched timm, SDPA + bias mask), torch.compile(mode="reduce-overhead")',
    "ours": "ours: GraphedPrunedViT, Triton, compile_blocks",
    "ours_adaptive": "ours adaptive (reads)",
    "ours_adaptive_sync_free": "ours adaptive (sync-free)",
    "ours_adaptive_lagged": "ours adaptive (lagged reads)",
}
ROWS = tuple(ROW_LABELS)
PEER_ROWS = tuple(r for r in ROWS if r.startswith("peer_"))
ADAPTIVE_ROWS = ("ours_adaptive", "ours_adaptive_sync_free", "ours_adaptive_lagged")
ADAPTIVE_NAMES = {"ours_adaptive": "reads", "ours_adaptive_sync_free": "sync-free", "ours_adaptive_lagged": "lagged"}
PEER_FP32_BOUND = 1e-3  # fp32 peer vs fp32 reference on the GPU (TF32 off): same merges, summation order only


# --------------------------------------------------------------------------------------------------- the patch


def patch_tome(
    model: VisionTransformer, r: int | Sequence[int], *, attention: str = "explicit", inplace: bool = False
) -> VisionTransformer:
    """ToMe with a fixed ``r`` on a timm ``VisionTransformer``, by patching its blocks' and its own forward.

    Args:
        model: a timm ``VisionTransformer`` whose blocks are timm ``Block`` with timm ``Attention``, ``token`` or
            ``avg`` pooling, in eval mode (``ragged_vit.reference.tome.check_model``'s conditions).
        r: A rows merged per image and block: an int for every block or one per block (capped at half the patch
            rows, as the reference).
        attention: ``"explicit"`` (``softmax(q k^T * scale + bias) v`` as written) or ``"sdpa"``
            (``F.scaled_dot_product_attention`` with the bias as its float ``attn_mask``).
        inplace: patch ``model`` itself; by default a deep copy is patched and ``model`` is left as it was.

    Returns:
        The patched model: ``model(images) -> logits`` (the ``forward`` of this instance is replaced, and every
        block's: ``block(x, size, source) -> (x, size, source)``). Only instance attributes change: timm's classes,
        and every other model, are untouched. :func:`run_patched` also returns where each patch ended up.
    """
    depth = check_model(model)
    schedule = per_block(r, "r", depth)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    model = model if inplace else copy.deepcopy(model)
    for block, r_k in zip(model.blocks, schedule, strict=True):
        block.tome_r = r_k
        block.tome_prefix = model.num_prefix_tokens
        block.tome_sdpa = attention == "sdpa"
        block.forward = types.MethodType(_block_forward, block)
    model.tome_r = schedule
    model.forward = types.MethodType(_model_forward, model)
    return model


def run_patched(
    model: VisionTransformer, images: torch.Tensor, trace_source: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A :func:`patch_tome` model's forward: ``(logits [B, classes], sizes [B, N'] (fp32, the patches each final row
    holds), sources)``. ``sources`` (with ``trace_source``): int64 ``[B, num_patches]``, the row (prefix rows
    counted) holding each original patch after the last block, as ``tome_forward``'s; else None."""
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))  # [B, N, C]
    batch, n, _ = x.shape
    size = torch.ones(batch, n, dtype=torch.float32, device=x.device)
    source = None
    if trace_source:
        source = torch.arange(model.num_prefix_tokens, n, device=x.device).expand(batch, -1)
    for block in model.blocks:
        x, size, source = block(x, size, source)
    x = model.norm(x)
    if model.global_pool == "avg":  # the mean over patches: every row weighs as the patches it holds
        prefix = 0 if getattr(model, "pool_include_prefix", False) else model.num_prefix_tokens
        weight = size[:, prefix:, None]
        pooled = (x[:, prefix:].float() * weight).sum(1) / weight.sum(1)
        logits = model.head(model.head_drop(model.fc_norm(pooled.to(x.dtype))))
    else:  # the class row (a distilled DeiT: timm's mean of its two heads): prefix rows stay first
        logits = model.forward_head(x)
    return logits, size, source


def _model_forward(self: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    return run_patched(self, images)[0]


def _block_forward(
    self: Block, x: torch.Tensor, size: torch.Tensor, source: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A patched block: attention with proportional attention, the merge, the MLP."""
    out, keys = proportional_attention(self.attn, self.norm1(x), size, self.tome_sdpa)
    x = x + self.drop_path1(self.ls1(out))
    x, size, source = bipartite_merge(x, size, keys, self.tome_r, self.tome_prefix, source)
    x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
    return x, size, source


def proportional_attention(
    attn: Attention, x: torch.Tensor, size: torch.Tensor, sdpa: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's ``Attention`` on ``x [B, N, C]`` with ``log(size)`` added to every key's logits after the scale:
    explicit softmax, or (``sdpa``) SDPA with the bias as its float mask. Returns the projected output
    ``[B, N, C]`` and the keys ``[B, H, N, D]`` (after ``k_norm``)."""
    batch, n, _ = x.shape
    qkv = attn.qkv(x).reshape(batch, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, H, N, D]
    q, k = attn.q_norm(q), attn.k_norm(k)
    bias = size.log().to(q.dtype)[:, None, None, :]  # [B, 1, 1, N]: every head and query
    if sdpa:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scale)
    else:
        out = attn.attn_drop(((q * attn.scale) @ k.transpose(-2, -1) + bias).softmax(dim=-1)) @ v
    out = out.transpose(1, 2).reshape(batch, n, -1)
    out = attn.norm(out) if hasattr(attn, "norm") else out  # scale_norm (identity unless configured)
    gate = getattr(attn, "gate", None)  # gated attention of newer timm versions
    if gate is not None:
        out = out * gate(x).sigmoid()
    return attn.proj_drop(attn.proj(out)), k


def bipartite_merge(
    x: torch.Tensor,
    size: torch.Tensor,
    keys: torch.Tensor,
    r: int,
    num_prefix: int,
    source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block's merge on the dense batch (every image merges ``min(r, patches // 2)`` A rows).

    Args:
        x: ``[B, N, C]`` rows, the first ``num_prefix`` of each image never merge.
        size: fp32 ``[B, N]`` the patches each row holds.
        keys: ``[B, H, N, D]`` the attention's keys: the metric is their mean over heads, L2-normalised, in fp32.
        r: A rows merged per image.
        num_prefix: prefix rows per image.
        source: optional int64 ``[B, num_patches]``: the row holding each original patch; updated.

    Returns:
        ``(x [B, N', C], size [B, N'], source)``, ``N' = N - min(r, patches // 2)``: the prefix rows, the other
        unmerged A rows, the other B rows (module docstring), merged rows the size-weighted average of their members.
    """
    batch, n, channels = x.shape
    r = min(r, (n - num_prefix) // 2)
    if r <= 0:
        return x, size, source
    device = x.device
    metric = F.normalize(keys.float().mean(dim=1), dim=-1)  # [B, N, D]
    scores = metric[:, 0::2] @ metric[:, 1::2].transpose(1, 2)  # [B, |A|, |B|] cosine similarities
    b_rows = torch.arange(1, n, 2, device=device)
    scores[:, : (num_prefix + 1) // 2, :] = -math.inf  # a prefix row is never a source nor a destination
    scores[:, :, : num_prefix // 2] = -math.inf  # (slices, not masks: a mask is a data-dependent shape to Dynamo)
    best, match = scores.max(dim=-1)  # ties: the first (lowest) B index
    order = torch.argsort(best, dim=-1, descending=True, stable=True)  # ties: the lower A index first
    merged_a, rest_a = order[:, :r], order[:, r:]
    if num_prefix:  # the unmerged A rows back in their order, without the protected ones (they lead it)
        rest_a = rest_a.sort(dim=1).values[:, (num_prefix + 1) // 2 :]
    b_kept = b_rows[num_prefix // 2 :].expand(batch, -1)
    survivors = torch.cat([torch.arange(num_prefix, device=device).expand(batch, -1), 2 * rest_a, b_kept], dim=1)
    new_row = torch.empty(batch, n, dtype=torch.int64, device=device)
    new_row.scatter_(1, survivors, torch.arange(n - r, device=device).expand(batch, -1))
    new_row.scatter_(1, 2 * merged_a, new_row.gather(1, 2 * match.gather(1, merged_a) + 1))  # to their B rows
    weighted = x.float() * size[:, :, None]
    index = new_row[:, :, None].expand(-1, -1, channels)
    sums = weighted.new_zeros(batch, n - r, channels).scatter_add_(1, index, weighted)
    sizes = size.new_zeros(batch, n - r).scatter_add_(1, new_row, size)
    x = (sums / sizes[:, :, None]).to(x.dtype)
    if source is not None:
        source = new_row.gather(1, source)
    return x, sizes, source


# --------------------------------------------------------------------------------------------------- the benchmark


@dataclass(frozen=True)
class Settings:
    """``forward_times``' warm-up and iteration rule."""

    warmup: int = 5
    target_s: float = 0.6
    min_iters: int = 20
    max_iters: int = 120
    input_sets: int = INPUT_SETS  # input batches per row and batch size (the timed loop rotates through them)


QUICK = Settings(warmup=0, target_s=0.0, min_iters=1, max_iters=1, input_sets=1)  # the CPU dry run: each path once


@dataclass(frozen=True)
class Calibration:
    """The adaptive rows' threshold at one batch size, calibrated on every input batch of that size (concatenated:
    the images the timed loop rotates through).

    Attributes:
        batch: the batch size.
        threshold: ``calibrate_threshold``'s, on the fp32 model (TF32 off).
        r_max: the cap per image and block, ``2 r``.
        fixed_rows: rows of an image after each block with the fixed ``r`` (prefix rows included).
        target: their mean, the rows per image and block the threshold was calibrated to.
        reference: ``tome_forward`` in fp32 (TF32 off) at ``threshold`` on the calibration images.
        seconds: wall time of the calibration and of that reference run.
    """

    batch: int
    threshold: float
    r_max: int
    fixed_rows: tuple[int, ...]
    target: float
    reference: ToMeOutput
    seconds: float

    def to_dict(self) -> dict:
        counts = self.reference.counts.double()
        return {
            "threshold": self.threshold,
            "r_max": self.r_max,
            "target_rows": self.target,
            "images": counts.shape[1],
            "reference_mean_rows": round(float(counts.mean()), 4),
            "seconds": round(self.seconds, 2),
        }


class Bench:
    """The rows of one run: models from a :class:`benchmarks.e2e_common.Lab`, each row checked, then timed."""

    def __init__(self, lab: Lab, model_name: str, r: int, settings: Settings) -> None:
        self.lab = lab
        self.name = model_name
        self.r = r
        self.s = settings
        self.cuda = lab.device.type == "cuda"
        self.check_key = "check_fp16" if lab.dtype == torch.float16 else "check"
        self._reference: tuple[torch.Tensor, object] | None = None
        self._calibration: Calibration | None = None  # of the last batch size
        self._fixed: tuple[int, torch.Tensor] | None = None  # our fixed-r logits of the last batch size's images

    def reference(self, images: torch.Tensor):
        """``tome_forward`` in fp32 (TF32 off) on ``images``: the ground truth of every ToMe row (the last one
        kept)."""
        if self._reference is None or self._reference[0] is not images:
            with no_tf32():
                ref = tome_forward(self.lab.model(self.name, torch.float32), images.float(), self.r)
            self._reference = (images, ref)
        return self._reference[1]

    def check(self, logits: torch.Tensor, ref, sources: torch.Tensor | None = None) -> dict:
        """``logit_diff`` against the reference, and the images whose patches all ended in the reference's rows."""
        out = {k: v for k, v in logit_diff(logits, ref.logits).items() if k != "disagree_ref_margins"}
        if sources is not None:
            out["same_merges"] = (sources == ref.sources).all(1).float().mean().item()
        out["finite"] = bool(logits.float().isfinite().all())
        return out

    def row(self, row: str, batch: int) -> dict:
        """One row at one batch size; never raises (a failure is the row's result)."""
        entry: dict = {"row": row, "label": ROW_LABELS[row], "batch": batch}
        cleanup: Callable[[], None] = lambda: None
        try:
            images = self.lab.images(self.name, batch)[: self.s.input_sets]
            calls, cleanup = self.prepare(row, images, entry)
            if calls is not None:
                times = forward_times(
                    calls,
                    self.lab.device,
                    context=torch.no_grad,
                    warmup=self.s.warmup,
                    target_s=self.s.target_s,
                    min_iters=self.s.min_iters,
                    max_iters=self.s.max_iters,
                    back_to_back=True,
                )
                entry.update(
                    status="ok",
                    wall_us=times.wall.to_dict(),
                    events_us=times.events.to_dict() if times.events else None,
                    iters=times.iters,
                    img_per_s=batch / (times.wall.median * 1e-6),
                    back_to_back_us=times.back_to_back,
                    img_per_s_back_to_back=batch / (times.back_to_back * 1e-6),
                )
        except Exception as exc:  # one broken row must not end a run on a lent machine
            entry.update(status="failed", reason=f"raised {describe(exc)}")
            if self.cuda:
                torch.cuda.synchronize()  # a sticky CUDA error surfaces here and ends the run, as it should
        finally:
            cleanup()
        return entry

    def prepare(self, row: str, images: list[torch.Tensor], entry: dict) -> tuple[list | None, Callable[[], None]]:
        """Builds and checks a row: its forwards (one per input batch) and its cleanup; ``None`` forwards (with
        ``entry``'s status and reason set) when it is not timed."""
        model = self.lab.model(self.name)
        if row.endswith("_compiled") and not self.cuda:
            entry.update(status="unavailable", reason='mode="reduce-overhead" needs CUDA graphs (a CUDA device)')
            return None, lambda: None
        if row.startswith("timm_"):
            return self.compiled(model, images, entry) if row == "timm_compiled" else self.eager(model, images)
        if row == "ours" or row in ADAPTIVE_ROWS:
            return self.ours(row, model, images, entry)
        attention = "sdpa" if row.startswith("peer_sdpa") else "explicit"
        peer = patch_tome(model, self.r, attention=attention)
        ref = self.reference(images[0])
        if row.endswith("_eager"):
            with torch.no_grad():
                logits, _, sources = run_patched(peer, images[0], trace_source=True)
            entry[self.check_key] = self.check(logits, ref, sources)
            if self.cuda:  # the strict check: fp32 on the GPU, the reference's merges
                fp32 = patch_tome(self.lab.model(self.name, torch.float32), self.r, attention=attention)
                with torch.no_grad(), no_tf32():
                    logits32, _, sources32 = run_patched(fp32, images[0].float(), trace_source=True)
                check = self.check(logits32, ref, sources32)
                entry["check_fp32"] = {**check, "bound": PEER_FP32_BOUND}
                if not check["max"] <= PEER_FP32_BOUND:
                    entry.update(status="failed", reason=f"fp32 peer differs from tome_forward by {check['max']:.3g}")
                    return None, lambda: None
            return self.eager(peer, images)
        return self.compiled(peer, images, entry, ref)

    def eager(self, module: torch.nn.Module, images: list[torch.Tensor]) -> tuple[list, Callable[[], None]]:
        return [functools.partial(module, img) for img in images], lambda: None

    def compiled(
        self, module: torch.nn.Module, images: list[torch.Tensor], entry: dict, ref=None
    ) -> tuple[list | None, Callable[[], None]]:
        """``module`` under ``torch.compile(mode="reduce-overhead")``: compile time, CUDA-graph skips, and (for
        ToMe rows, ``ref`` given) its logits against the reference."""

        def cleanup() -> None:
            torch._dynamo.reset()  # frees the compiled graphs and their CUDA-graph pool
            torch.cuda.empty_cache()

        cleanup()
        skips = cudagraph_skips()
        try:
            fn = torch.compile(module, mode="reduce-overhead", dynamic=False)
            with torch.no_grad():
                firsts = [round(elapsed([functools.partial(fn, img)], self.lab.device), 3) for img in images]
                logits = fn(images[0]).float().clone()
        except Exception as exc:  # a compile failure is the row's result
            cleanup()
            entry.update(status="does not compile", reason=describe(exc))
            return None, lambda: None
        entry.update(compile_s=firsts[0], first_calls_s=firsts, cudagraph_skips=cudagraph_skips() - skips)
        if ref is not None:
            entry["check_fp16"] = self.check(logits, ref)
        return [functools.partial(fn, img) for img in images], cleanup

    def graphed(
        self, model: torch.nn.Module, merger: torch.nn.Module, buckets: TokenBuckets | None = None
    ) -> GraphedPrunedViT:
        """Our pipeline: ``GraphedPrunedViT`` over ``PrunedViT(model, merger, "triton", compile_blocks=True)``. On a
        CPU (the dry run) the blocks are not compiled (Inductor would build C++ for minutes) and the runner runs its
        segments eagerly, the Triton kernels under the interpreter."""
        return GraphedPrunedViT(PrunedViT(model, merger, "triton", compile_blocks=self.cuda), buckets)

    def ours(
        self, row: str, model: torch.nn.Module, images: list[torch.Tensor], entry: dict
    ) -> tuple[list | None, Callable[[], None]]:
        """Our pipeline: fixed ``r`` (``ours``), or adaptive at the calibrated threshold with ``r_max = 2 r``
        (``ours_adaptive``: the default buckets; ``ours_adaptive_sync_free``: ``sync_free_rows = B * N``, no host
        read; ``ours_adaptive_lagged``: ``lagged_reads``, every read one stage late). Every input batch runs once
        before timing (the first call's seconds: compilation and capture): the checks, the host reads per forward
        (graph launches less one; late ones for the lagged row) and, adaptive, the counts and the logits against the
        fixed ``r``'s."""
        depth, batch = len(model.blocks), images[0].shape[0]
        calibration, buckets = None, None
        if row == "ours":
            merger = make_pruner("tome", r=self.r, depth=depth)
        elif self.r == 0:
            entry.update(status="unavailable", reason="adaptive merging needs r > 0 (r_max = 2 r)")
            return None, lambda: None
        else:
            calibration = self.calibration(images)
            fixed = self.fixed_logits(model, images)
            merger = make_pruner("tome", threshold=calibration.threshold, r_max=calibration.r_max, depth=depth)
            if row == "ours_adaptive_sync_free":
                buckets = TokenBuckets(sync_free_rows=batch * _tokens(model))
            elif row == "ours_adaptive_lagged":
                buckets = TokenBuckets(lagged_reads=True)
        runner = self.graphed(model, merger, buckets)

        def cleanup() -> None:
            runner.reset()
            if self.cuda:
                torch._dynamo.reset()
                torch.cuda.empty_cache()

        outs: list[PrunedOutput] = []
        try:
            with torch.no_grad():
                before = runner.counters.replays + runner.counters.eager_segments
                capture = elapsed([lambda: outs.append(runner.run(images[0]))], self.lab.device)
                outs += [runner.run(img) for img in images[1:]]
                launches = runner.counters.replays + runner.counters.eager_segments - before
        except BaseException:
            cleanup()
            raise
        logits = torch.cat([out.logits.float() for out in outs])
        entry.update(capture_s=round(capture, 3), host_reads_per_forward=round(launches / len(images) - 1, 2))
        if calibration is None:
            entry[self.check_key] = self.check(outs[0].logits.float(), self.reference(images[0]))
            self._fixed = (batch, logits)
        else:
            counts = torch.cat([out.counts for out in outs])
            entry.update(
                calibration=calibration.to_dict(),
                buckets=dataclasses.asdict(runner.buckets),
                counts=count_stats(counts, calibration, model.patch_embed.num_patches, model.num_prefix_tokens),
            )
            entry[self.check_key] = self.check(logits, calibration.reference)
            diff = logit_diff(logits, fixed)
            entry["vs_fixed"] = {"max": diff["max"], "mean": diff["mean"], "top1_agree": diff["top1_agree"]}
        return [functools.partial(runner.run, img) for img in images], cleanup

    def calibration(self, images: list[torch.Tensor]) -> Calibration:
        """The adaptive threshold of this batch size: ``calibrate_threshold`` in fp32 (TF32 off) on the fp32 model,
        on every input batch at once, to the fixed ``r``'s mean rows per image and block, with ``r_max = 2 r``
        (kept for the last batch size)."""
        batch = images[0].shape[0]
        if self._calibration is None or self._calibration.batch != batch:
            self._calibration = None  # the previous batch size's reference is freed first
            model = self.lab.model(self.name, torch.float32)
            depth, r_max = len(model.blocks), 2 * self.r
            fixed = tuple(fixed_r_counts(_tokens(model), [self.r] * depth, model.num_prefix_tokens))
            target = sum(fixed) / depth
            x = torch.cat(images).float()
            found: list = []

            def calibrate() -> None:
                threshold = calibrate_threshold(model, x, target, r_max)
                found[:] = [threshold, tome_forward(model, x, threshold=threshold, r_max=r_max)]

            with no_tf32():
                seconds = elapsed([calibrate], self.lab.device)
            self._calibration = Calibration(batch, found[0], r_max, fixed, target, found[1], seconds)
        return self._calibration

    def fixed_logits(self, model: torch.nn.Module, images: list[torch.Tensor]) -> torch.Tensor:
        """Our fixed-``r`` pipeline's logits on ``images`` (concatenated): those of the ``ours`` row at this batch
        size, or run here when that row was not (``--rows``) or failed."""
        batch = images[0].shape[0]
        if self._fixed is None or self._fixed[0] != batch:
            runner = self.graphed(model, make_pruner("tome", r=self.r, depth=len(model.blocks)))
            try:
                with torch.no_grad():
                    logits = torch.cat([runner.run(img).logits.float() for img in images])
            finally:
                runner.reset()
            self._fixed = (batch, logits)
        return self._fixed[1]


def _tokens(model: torch.nn.Module) -> int:
    """N: rows of an unmerged image, prefix rows included."""
    return model.patch_embed.num_patches + model.num_prefix_tokens


def count_stats(counts: torch.Tensor, calibration: Calibration, num_patches: int, num_prefix: int) -> dict:
    """An adaptive run's counts ``[images, blocks]`` (``PrunedOutput.counts``: patch rows after each block's merge,
    prefix rows excluded): per block their mean, min and max over the images (``count_summary``) and their standard
    deviation (population), the fixed ``r``'s counts, and the mean rows per image and block (prefix rows included:
    the calibrated quantity) against the fixed ``r``'s."""
    mean_rows = float(counts.double().mean()) + num_prefix
    return {
        **count_summary(counts, num_patches),
        "std": [round(float(v), 2) for v in counts.double().std(0, correction=0)],
        "fixed_r": [rows - num_prefix for rows in calibration.fixed_rows],
        "images": counts.shape[0],
        "mean_rows": round(mean_rows, 4),
        "target_rows": calibration.target,
        "mean_vs_fixed": round(mean_rows / calibration.target, 4),
    }


# --------------------------------------------------------------------------------------------------- report


CLOCKS = {"img_per_s": "each forward alone", "img_per_s_back_to_back": "back to back"}
"""The rows' two rates (``markdown_table``'s ``clock``): each forward timed alone (a synchronize before and after
it: what a request served alone waits), and forwards back to back (a stream of batches: each forward's host work
and launch overlap the device work before it)."""


def _cell(entry: dict | None, clock: str = "img_per_s") -> str:
    if entry is None:
        return "-"
    if entry.get("status") == "ok":
        return f"{entry[clock]:.0f}"
    status = "not available" if entry.get("status") == "unavailable" else entry.get("status")
    return f"{status}: {entry.get('reason', '')}".replace("|", "/")


@dataclass(frozen=True)
class Speedups:
    """Ours against the others at one batch size, by one clock (None: a side not measured there).

    Attributes:
        vs_timm: ours over the unpruned timm model under ``reduce-overhead``.
        vs_peer: ours over the peer's best mode (its fastest row at that batch: eager or reduce-overhead, explicit
            attention or SDPA).
        adaptive: our faster adaptive row over our fixed ``r``.
        adaptive_row: that adaptive row.
    """

    vs_timm: float | None
    vs_peer: float | None
    adaptive: float | None
    adaptive_row: str | None


def speedups(rows: list[dict], batch: int, clock: str = "img_per_s") -> Speedups:
    """The ratios of ``rows`` (a run's JSON rows) at ``batch`` by ``clock`` (:data:`CLOCKS`); only rows that ran."""
    ok = {e["row"]: e[clock] for e in rows if e["batch"] == batch and e.get("status") == "ok"}

    def fastest(candidates: Sequence[str]) -> str | None:
        return max((r for r in candidates if r in ok), key=ok.get, default=None)

    def over(num: str | None, den: str | None) -> float | None:
        return ok[num] / ok[den] if num in ok and den in ok else None

    adaptive = fastest(ADAPTIVE_ROWS)
    ratio = over(adaptive, "ours")
    return Speedups(over("ours", "timm_compiled"), over("ours", fastest(PEER_ROWS)), ratio,
                    adaptive if ratio is not None else None)  # fmt: skip


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def markdown_table(rows: list[dict], batches: Sequence[int], clock: str = "img_per_s") -> str:
    """img/s per row (rows) and batch size (columns) by ``clock`` (:data:`CLOCKS`), then :func:`speedups`: ours vs
    unpruned reduce-overhead, ours vs the peer's best mode, and our faster adaptive row (named) vs our fixed ``r``."""
    at = {(e["row"], e["batch"]): e for e in rows}
    lines = [
        "| row | " + " | ".join(f"B={b} img/s, {CLOCKS[clock]}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for row in ROWS:
        if any((row, b) in at for b in batches):
            cells = " | ".join(_cell(at.get((row, b)), clock) for b in batches)
            lines.append(f"| {ROW_LABELS[row]} | {cells} |")
    ups = [speedups(rows, b, clock) for b in batches]
    adaptive = [_times(u.adaptive) + (f" ({ADAPTIVE_NAMES[u.adaptive_row]})" if u.adaptive_row else "") for u in ups]
    lines.append("| ours vs unpruned reduce-overhead | " + " | ".join(_times(u.vs_timm) for u in ups) + " |")
    lines.append("| ours vs the peer's best mode | " + " | ".join(_times(u.vs_peer) for u in ups) + " |")
    lines.append("| adaptive / fixed (the faster adaptive row) | " + " | ".join(adaptive) + " |")
    return "\n".join(lines)


def render(payload: dict) -> str:
    """The report of a run (its JSON): the checks and the adaptive rows' statistics, then a :func:`markdown_table`
    per clock its timed rows all have (runs before the back-to-back clock have one)."""
    rows = payload["rows"]
    batches = sorted({e["batch"] for e in rows})
    timed = [e for e in rows if e.get("status") == "ok"]
    clocks = [c for c in CLOCKS if timed and all(c in e for e in timed)] or ["img_per_s"]
    parts = ["\n".join(check_lines(rows) + adaptive_lines(rows)), *(markdown_table(rows, batches, c) for c in clocks)]
    return "\n\n".join(p for p in parts if p)


def check_lines(rows: list[dict]) -> list[str]:
    """One line per check made before timing: max |logit diff| against ``tome_forward`` in fp32."""
    lines = []
    for e in rows:
        for key in ("check_fp32", "check_fp16", "check"):
            c = e.get(key)
            if c:
                same = f", same merges in {c['same_merges']:.0%} of images" if "same_merges" in c else ""
                lines.append(
                    f"- {e['label']}, B={e['batch']}, {key.removeprefix('check').lstrip('_') or 'fp32'} vs "
                    f"tome_forward fp32: max |diff| {c['max']:.3g}, top-1 agree {c['top1_agree']:.0%}{same}"
                )
    return lines


def adaptive_lines(rows: list[dict]) -> list[str]:
    """Two lines per adaptive row run: its threshold, host reads, mean rows per image and block against the fixed
    ``r``'s and logits against our fixed ``r``; then its patch rows after each block over the images."""
    lines = []
    for e in rows:
        if e["row"] not in ADAPTIVE_ROWS or "counts" not in e:
            continue
        cal, c, v = e["calibration"], e["counts"], e["vs_fixed"]
        lines.append(
            f"- {e['label']}, B={e['batch']}: threshold {cal['threshold']:.6g} (r_max {cal['r_max']}, calibrated on "
            f"{cal['images']} images in {cal['seconds']:.1f} s), {e['host_reads_per_forward']:g} host reads per "
            f"forward; rows per image and block {c['mean_rows']:.2f} vs fixed r's {c['target_rows']:.2f} "
            f"({c['mean_vs_fixed']:.3f}x); vs our fixed r: max |logit diff| {v['max']:.3g}, "
            f"top-1 agree {v['top1_agree']:.0%}"
        )
        lines.append(
            f"  patch rows after each block over {c['images']} images: mean {c['mean']}, min {c['min']}, "
            f"max {c['max']}, std {c['std']}; fixed r: {c['fixed_r']}"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tome_peer", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,64", help="comma-separated batch sizes (default 1,4,64)")
    parser.add_argument("--r", type=int, default=13, help="A rows merged per image and block (default 13)")
    parser.add_argument("--rows", default=None, help="comma-separated subset of rows: " + ",".join(ROWS))
    parser.add_argument(
        "--adaptive-batches",
        default="64",
        help="comma-separated batch sizes (among --batches) at which the adaptive rows run (default 64)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/baselines/<gpu>/...)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the CPU test's dry run
    parser.add_argument("--model", default=DEIT_B, help=argparse.SUPPRESS)  # a smaller model (CPU test)
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # one timed forward per row
    args = parser.parse_args(argv)
    try:
        args.batches = comma_list(args.batches, int)
        args.rows = comma_list(args.rows, str, ROWS) or ROWS
        args.adaptive_batches = comma_list(args.adaptive_batches, int) or ()
    except ValueError as exc:
        parser.error(str(exc))
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches: positive batch sizes expected, got {args.batches}")
    if args.r < 0:
        parser.error(f"--r: must be >= 0, got {args.r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    picked = bench_device(args.device, "tome_peer")
    if picked is None:
        return 2
    device, dtype = picked
    out = args.out or BASELINES / gpu_slug() / "tome_peer.json"
    lab = Lab(device, dtype)
    bench = Bench(lab, args.model, args.r, QUICK if args.quick else Settings())
    checkpoint = os.environ.get(CHECKPOINT_ENV)
    weights = f"checkpoint {checkpoint}" if checkpoint and args.model == DEIT_B else "random (seeded)"
    payload: dict = {
        "meta": {
            **environment(),
            "timm": timm.__version__,
            "weights": weights,
            "model": args.model,
            "dtype": str(dtype).removeprefix("torch."),
            "r": args.r,
            "adaptive": {"r_max": 2 * args.r, "batches": [b for b in args.batches if b in args.adaptive_batches]},
            "settings": bench.s.__dict__,
            "args": {"quick": args.quick},
            "rows": {r: ROW_LABELS[r] for r in args.rows},
        },
        "rows": [],
    }
    started = time.perf_counter()
    print(f"tome_peer on {payload['meta']['card'] or 'cpu'}: {args.model}, r={args.r} -> {out}", file=sys.stderr)
    with torch_threads(1):
        for batch in args.batches:
            for row in args.rows:
                if row in ADAPTIVE_ROWS and batch not in args.adaptive_batches:
                    continue
                t0 = time.perf_counter()
                entry = bench.row(row, batch)
                entry["elapsed_s"] = round(time.perf_counter() - t0, 2)
                rates = _cell(entry) + (f", {_cell(entry, 'img_per_s_back_to_back')} back to back" if entry.get(
                    "status") == "ok" else "")  # fmt: skip
                print(f"  B={batch} {row}: {rates} ({entry['elapsed_s']} s)", file=sys.stderr, flush=True)
                payload["rows"].append(entry)
                payload["meta"]["elapsed_s"] = round(time.perf_counter() - started, 1)
                write_json(out, payload)
    payload["meta"]["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json(out, payload)  # also when no row ran (--rows and --adaptive-batches leave none)
    print(f"\n## ToMe peer, {args.model} r={args.r}, {payload['meta']['dtype']}, weights {weights} ({out})\n")
    print(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
