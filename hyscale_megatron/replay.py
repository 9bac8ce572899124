"""Selection replay: the top-k chosen in a layer's forward, reused by its recompute.

Entries are keyed by ``(layer_number, microbatch)``. The microbatch is the layer's own forward
count: Megatron's schedules pass no microbatch id, but every layer runs exactly once per
microbatch forward, in the same order for all layers of a model chunk, so the n-th forward of
layer L and the n-th forward of layer L' belong to the same microbatch. A recomputed region
remembers the count its original forward used (``Region.data``), so a recompute finds its own
microbatch's entry under any schedule (1F1B, interleaved, or backward in any order).

An entry holds int32 (or int16 when positions fit) indices, their shape and a fingerprint of
the indexer inputs. Each read checks key, shape and fingerprint and raises
:class:`ReplayMismatchError` on any difference: stale indices are never served. An entry
counts the reads still expected (the layer's own recompute, IndexShare layers that reuse it
and their recomputes) and is freed by the last one.

Memory: one entry is ``b * sq * k`` indices (4 bytes, or 2 with ``replay_compact`` when
``sk <= 32768``); per DSA layer and per microbatch in flight. See README, "Selection replay".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ._log import log_once


class ReplayMismatchError(RuntimeError):
    """The replay store was asked for indices it does not hold, or that do not match."""


def fingerprint(*tensors: torch.Tensor) -> torch.Tensor:
    """Cheap device-side fingerprint: shape-independent sums over a strided sample (fp64 [2 * n])."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step].double()
        ramp = torch.arange(1, sample.numel() + 1, device=sample.device, dtype=torch.float64)
        parts.append(torch.stack([sample.sum(), (sample * ramp).sum()]))
    return torch.cat(parts)


@dataclass
class _Entry:
    data: torch.Tensor
    dtype: torch.dtype
    shape: tuple
    device: torch.device
    fp: torch.Tensor
    pending: int
    ready: Optional[torch.cuda.Event] = None
    offloaded: bool = False
    prefetched: Optional[tuple] = None  # (device tensor, event) once copied back ahead of use

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class ReplayStore:
    """Process-wide (per model replica) store of selected indices."""

    def __init__(self):
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._lock = threading.Lock()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.host_bytes = 0
        self.puts = 0
        self.reads = 0
        self._stream = None

    # --- writing --------------------------------------------------------------------------
    def put(self, key: tuple[int, int], indices: torch.Tensor, fp: torch.Tensor, pending: int,
            offload: bool = False, compact: bool = True, sk: Optional[int] = None) -> None:
        if pending <= 0:
            return
        if key in self._entries:
            raise ReplayMismatchError(
                f"replay store already holds layer {key[0]} microbatch {key[1]}: a forward ran twice for the "
                "same key before its recompute (was the store cleared between steps?)")
        data = indices
        if compact and sk is not None and sk <= 32768 and indices.dtype != torch.int16:
            data = indices.to(torch.int16)
        elif indices.dtype == torch.int64:
            data = indices.to(torch.int32)
        ready = None
        if offload and data.is_cuda:
            data, ready = self._to_host(data)
        entry = _Entry(data, indices.dtype, tuple(indices.shape), indices.device, fp, pending, ready,
                       offloaded=data.device != indices.device)
        with self._lock:
            self._entries[key] = entry
            self._account(entry, +1)
            self.puts += 1

    def _to_host(self, data: torch.Tensor):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=data.device)
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(self._stream):
            host.copy_(data, non_blocking=True)
            data.record_stream(self._stream)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return host, ev

    def _account(self, entry: _Entry, sign: int) -> None:
        if not entry.offloaded:
            self.current_bytes += sign * entry.nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            self.host_bytes += sign * entry.nbytes

    def add_pending(self, key: tuple[int, int], n: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise self._missing(key)
            entry.pending += n

    # --- reading --------------------------------------------------------------------------
    def read(self, key: tuple[int, int], fp: Optional[torch.Tensor], shape: Optional[tuple] = None,
             prefetch_next: bool = True) -> torch.Tensor:
        """Return the stored indices (in their original dtype); free the entry on its last read.
        ``prefetch_next``: an offloaded entry also starts copying the next layer's entry back."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise self._missing(key)
            entry.pending -= 1
            last = entry.pending <= 0
            if last:
                del self._entries[key]
                self._account(entry, -1)
            self.reads += 1
        if shape is not None and tuple(shape) != entry.shape:
            raise ReplayMismatchError(
                f"replay entry for layer {key[0]} microbatch {key[1]} has shape {entry.shape}, the recompute "
                f"expects {tuple(shape)}: indices from another microbatch or sequence length")
        if fp is not None and not torch.equal(fp.to(entry.fp.device), entry.fp):
            raise ReplayMismatchError(
                f"replay entry for layer {key[0]} microbatch {key[1]} was computed from different indexer inputs "
                "(fingerprint mismatch): refusing to serve stale indices")
        data = entry.data
        if entry.offloaded:
            if entry.prefetched is not None:
                data, ev = entry.prefetched
                torch.cuda.current_stream(entry.device).wait_event(ev)
            else:
                if entry.ready is not None:
                    torch.cuda.current_stream(entry.device).wait_event(entry.ready)
                data = data.to(entry.device, non_blocking=True)
            # Backward recomputes layers in reverse order: bring the next one back now.
            if prefetch_next:
                self.prefetch((key[0] - 1, key[1]))
        return data.to(entry.dtype)

    def prefetch(self, key: tuple[int, int]) -> bool:
        """Start copying an offloaded entry back to its device on a side stream."""
        entry = self._entries.get(key)
        if entry is None or not entry.offloaded or entry.prefetched is not None:
            return False
        stream = self._stream or torch.cuda.Stream(device=entry.device)
        self._stream = stream
        with torch.cuda.stream(stream):
            if entry.ready is not None:
                stream.wait_event(entry.ready)
            dev = entry.data.to(entry.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        dev.record_stream(torch.cuda.current_stream(entry.device))
        entry.prefetched = (dev, ev)
        return True

    def _missing(self, key) -> ReplayMismatchError:
        held = sorted(self._entries)[:8]
        return ReplayMismatchError(
            f"replay store has no entry for layer {key[0]} microbatch {key[1]} (holding {held}{'...' if len(self._entries) > 8 else ''}); "
            "the recompute must follow its own forward")

    # --- lifecycle ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def keys(self):
        return sorted(self._entries)

    def clear(self, warn: bool = True) -> int:
        n = len(self._entries)
        if n and warn:
            log_once("replay-leak", "hyscale: replay store held %d entries at step end (a forward without "
                     "backward?); clearing", n)
        with self._lock:
            self._entries.clear()
            self.current_bytes = 0
            self.host_bytes = 0
        return n

    def stats(self) -> dict:
        return dict(entries=len(self._entries), current_bytes=self.current_bytes, peak_bytes=self.peak_bytes,
                    host_bytes=self.host_bytes, puts=self.puts, reads=self.reads)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes


_STORE = ReplayStore()


def get_store() -> ReplayStore:
    return _STORE


def store_stats() -> dict:
    """Current/peak bytes of the process-wide replay store (logged per iteration when enabled)."""
    return _STORE.stats()

