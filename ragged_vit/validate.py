"""``python -m ragged_vit.validate DATA_DIR ...`` (also ``torchrun ... -m ragged_vit.validate``): accuracy of a
token-pruned ViT on an image folder, the same as ``ragged-vit validate`` (:mod:`ragged_vit.pipelines.apps.validate`)."""

import sys

from .pipelines.apps.validate import main

if __name__ == "__main__":
    sys.exit(main())
