"""Process-wide HyScale settings chosen by the launcher (flags) and read by the spec builders."""

from __future__ import annotations

from typing import Optional

from .config import HyScaleConfig

_CONFIG: Optional[HyScaleConfig] = None


def set_config(cfg: HyScaleConfig) -> None:
    global _CONFIG
    _CONFIG = cfg.validate()


def current_config() -> HyScaleConfig:
    """The launcher's config, or defaults + HYSCALE_* environment variables."""
    return _CONFIG if _CONFIG is not None else HyScaleConfig.from_env()
