"""Where litctx caches what it prepares once (converted models, preprocessed data, synthetic studies)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$LITCTX_CACHE_DIR`` when set (and not empty), else ``~/.cache/litctx``; read at each call."""
    return Path(os.environ.get("LITCTX_CACHE_DIR") or Path.home() / ".cache" / "litctx")
