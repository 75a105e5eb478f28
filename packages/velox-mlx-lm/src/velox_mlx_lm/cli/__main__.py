"""``python -m velox_mlx_lm.cli``: the same as ``velox-generate``."""

import sys

from velox_mlx_lm.cli.app import main

sys.exit(main())
