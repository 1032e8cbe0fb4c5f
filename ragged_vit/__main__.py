"""``python -m ragged_vit``: the command-line demo (:mod:`ragged_vit.pipelines.apps.cli`)."""

import sys

from .pipelines.apps.cli import main

sys.exit(main())
