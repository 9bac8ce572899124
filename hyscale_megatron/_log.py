"""Logging helpers: one logger for the plugin and log-once for path choices."""

from __future__ import annotations

import logging

logger = logging.getLogger("hyscale_megatron")
_seen: set[str] = set()


def log_once(key: str, msg: str, *args, level: int = logging.INFO) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    if key in _seen:
        return
    _seen.add(key)
    logger.log(level, msg, *args)
