"""``python -m ragged_vit``: the command-line demo (:mod:`ragged_vit.pipelines.cli`)."""

import sys

from .pipelines.cli import main

sys.exit(main())
