"""The keep-rate-1.0 difference against timm of every model family of ``tests/test_models.py`` (``docs/models.md``).

Run from the repository root: ``python -m ci.model_families`` (CPU: fp32 only; on a GPU also fp16 with the Triton
kernel). For each family (random weights, 4 blocks of width 64): max |logit diff| of the unpruned pipeline and of
the pipeline at keep rate 1.0 (Threshold-L2 ratio) against timm's own forward of the same model, in fp32, and on a
GPU in fp16 against timm in fp32, beside timm's own fp16 error (the tests allow twice that).
"""

from __future__ import annotations

import torch

from ragged_vit import PrunedViT
from ragged_vit.reference.pruners import make_pruner
from tests.helpers import no_tf32
from tests.test_models import FAMILIES, family, images


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    head = "| family | timm model | prefix | pool | fp32 unpruned | fp32 keep 1.0 |"
    head += " fp16 keep 1.0 (Triton) | timm fp16 |" if cuda else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, (model_name, _) in FAMILIES.items():
        model = family(name).to(device)
        x = images(model, 4, 4).to(device)
        keep_all = make_pruner("threshold_l2", mode="ratio", rate=1.0, block=1)
        with torch.no_grad(), no_tf32():
            ref = model(x)
            unpruned = PrunedViT(model).run(x).logits
            kept = PrunedViT(model, keep_all, "reference").run(x).logits
            cells = [f"{_diff(unpruned, ref):.1e}", f"{_diff(kept, ref):.1e}"]
            if cuda:
                half = PrunedViT(model.half(), keep_all.half(), "triton").run(x.half()).logits
                cells += [f"{_diff(half, ref):.1e}", f"{_diff(model(x.half()), ref):.1e}"]
        pool = "map" if getattr(model, "attn_pool", None) is not None else model.global_pool
        print(f"| {name} | `{model_name}` | {model.num_prefix_tokens} | {pool} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
