"""``python -m velox_bench.quality``: OpenBLAS is loaded before anything imports mlx."""

from velox_bench.blas import preload

preload()

from velox_bench.quality.run import main  # noqa: E402

raise SystemExit(main())
