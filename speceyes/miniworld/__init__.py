"""Mini-world: an offline benchmark of real easy-VQA shapes pasted into large synthetic scenes.

The point of the world is a controlled size effect: small targets are unreadable in a small
model's low-resolution view but readable after a zoom crop; large targets are readable directly.
See ``docs/miniworld.md`` and :mod:`speceyes.miniworld.scenes`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CATEGORIES",
    "COLORS",
    "GENERATOR_VERSION",
    "POPULAR_PAIRS",
    "SHAPES",
    "Scene",
    "SceneObject",
    "SceneQuestion",
    "Sprite",
    "SpritePool",
    "generate_scene",
    "load_pool",
    "low_res_scale",
    "make_split",
    "pixel_labels",
    "size_ranges",
    "verify_labels",
]


def __getattr__(name: str) -> Any:
    # Lazy on purpose: an eager import would make `python -m speceyes.miniworld.splits` warn that
    # the module was already in sys.modules before running as __main__.
    if name in __all__:
        import importlib

        for module in ("scenes", "sprites", "splits"):
            mod = importlib.import_module(f"speceyes.miniworld.{module}")
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
