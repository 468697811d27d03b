"""``python -m gpugate ...`` is the ``gpugate`` console script (for a venv whose bin/ is not on PATH)."""

import sys

from gpugate.cli import main

sys.exit(main())
