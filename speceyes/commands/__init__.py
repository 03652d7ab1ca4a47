"""Command modules: each gives ``add_args(parser)`` and ``run(args) -> int``."""
