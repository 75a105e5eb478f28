"""``python -m velox_bench.quality``: OpenBLAS is loaded before anything imports mlx."""

from velox_blas import preload_openblas

preload_openblas()

from velox_bench.quality.run import main  # noqa: E402

raise SystemExit(main())
