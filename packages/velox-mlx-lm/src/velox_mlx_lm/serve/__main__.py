"""``python -m velox_mlx_lm.serve``: the same as ``velox-serve``."""

import sys

from velox_mlx_lm.serve.app import main

sys.exit(main())
