"""``python -m lce_patch run ...``: the ``lce-patch`` command (``lce_patch/cli.py``)."""

import sys

from .cli import main

sys.exit(main())
