"""Shared machinery for overlays onto megatron-core.

Every overlay is a :class:`Patch`: it names the Megatron symbol it replaces (module path plus
attribute), keeps the original, logs the swap once, is safe to apply twice, and can be undone.
If the symbol is missing (a different megatron-core), it fails with a message naming the symbol
and the supported version range instead of silently doing nothing.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("hyscale_patches")

SUPPORTED_MEGATRON = ">=0.19.2,<0.20"
_MIN = (0, 19, 2)
_MAX_EXCL = (0, 20, 0)


class MegatronPatchError(RuntimeError):
    """A patch could not be applied to the installed megatron-core."""


def megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except Exception:  # noqa: BLE001 - report what we can
        try:
            import megatron.core as mc

            return getattr(mc, "__version__", "unknown")
        except ImportError as exc:
            raise MegatronPatchError(
                f"megatron-core is not importable ({exc}); install megatron-core{SUPPORTED_MEGATRON}"
            ) from exc
    return __version__


def check_megatron_version() -> str:
    """Return the installed megatron-core version; raise if it is outside the supported range."""
    ver = megatron_version()
    try:
        parts = tuple(int(p) for p in ver.split("+")[0].split(".")[:3])
    except ValueError:
        parts = None
    if parts is None or not (_MIN <= parts < _MAX_EXCL):
        raise MegatronPatchError(
            f"hyscale_megatron supports megatron-core{SUPPORTED_MEGATRON}, found {ver}. "
            f"Install a supported version: pip install 'megatron-core{SUPPORTED_MEGATRON}'."
        )
    return ver


_VERSION_OK: str | None = None


def _checked_version() -> str:
    """check_megatron_version(), once per process (every overlay assumes the supported range)."""
    global _VERSION_OK
    if _VERSION_OK is None:
        _VERSION_OK = check_megatron_version()
    return _VERSION_OK


@dataclass
class Patch:
    """Replace ``module.attr`` by ``make(original)``; idempotent and reversible."""

    name: str
    module: str
    attr: str
    make: Callable[[Any], Any]
    _original: Any = field(default=None, init=False, repr=False)
    _applied: Any = field(default=None, init=False, repr=False)

    def _target(self):
        try:
            mod = importlib.import_module(self.module)
        except ImportError as exc:
            raise MegatronPatchError(
                f"patch '{self.name}': cannot import {self.module} ({exc}); expected in "
                f"megatron-core{SUPPORTED_MEGATRON} (installed: {megatron_version()})"
            ) from exc
        owner = mod
        path = self.attr.split(".")
        for part in path[:-1]:
            if not hasattr(owner, part):
                raise MegatronPatchError(self._missing(".".join(path[: path.index(part) + 1])))
            owner = getattr(owner, part)
        if not hasattr(owner, path[-1]):
            raise MegatronPatchError(self._missing(self.attr))
        return owner, path[-1]

    def _missing(self, what: str) -> str:
        return (
            f"patch '{self.name}': expected symbol {self.module}.{what} is missing; "
            f"hyscale_megatron supports megatron-core{SUPPORTED_MEGATRON} "
            f"(installed: {megatron_version()})"
        )

    @property
    def applied(self) -> bool:
        if self._applied is None:
            return False
        owner, leaf = self._target()
        return getattr(owner, leaf) is self._applied

    def apply(self) -> bool:
        """Apply once. Returns True if this call swapped the symbol, False if already applied."""
        if self.applied:
            return False
        if self.module.startswith("megatron"):
            _checked_version()
        owner, leaf = self._target()
        self._original = getattr(owner, leaf)
        self._applied = self.make(self._original)
        setattr(owner, leaf, self._applied)
        logger.info("hyscale: patched %s.%s (%s)", self.module, self.attr, self.name)
        return True

    def revert(self) -> None:
        if not self.applied:
            return
        owner, leaf = self._target()
        setattr(owner, leaf, self._original)
        self._applied = None
        logger.info("hyscale: restored %s.%s", self.module, self.attr)

    @property
    def original(self):
        if self._original is not None:
            return self._original
        owner, leaf = self._target()
        return getattr(owner, leaf)
