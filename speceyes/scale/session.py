"""Connecting to Ray: the import with a clear error when the extra is missing, and one way to
join a cluster (``ADDRESS``, ``auto``) or start a single-machine one here (``local``)."""

from __future__ import annotations

import os
from types import ModuleType

RAY_EXTRA = 'pip install "speceyes[ray]"'
LOCAL = "local"  # --ray local: start Ray in this process's machine, on loopback
# Ray reports usage statistics to its developers unless this is 0; speceyes keeps it off
# unless the user has set it (a cluster started with `ray start` keeps its own setting).
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"


def require_ray() -> ModuleType:
    """The ``ray`` module, or an ImportError that says how to install it."""
    os.environ.setdefault(USAGE_STATS_ENV, "0")  # read by ray at import and at init
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"--ray needs Ray, which is not installed: {RAY_EXTRA} (Ray Serve included)"
        ) from exc
    return ray


def connect(address: str) -> bool:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine is part of) or, for
    ``local``, start one here bound to 127.0.0.1. Returns whether this call started or joined
    a session (then the caller shuts it down); an already initialised session is kept."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    if address == LOCAL:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    else:
        ray.init(address=address, log_to_driver=True)
    return True
