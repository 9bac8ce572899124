"""What is live at a training step's CUDA memory peak, from the caching allocator's own trace (GPU).

The CPU memory ledger (``bench/memory_ledger.py``) predicts the per-token peak from stand-ins; this
script measures it on the GPU: it records the allocator's alloc/free history with Python stacks
(``torch.cuda.memory._record_memory_history``) while ``hyscale_megatron.tools.train`` runs, replays the
trace to find the moment of the largest allocated total (or the OOM), and prints the live blocks
at that moment grouped by the first call site in this repo or Megatron, in bytes per token.

Usage on the device (carry .whl-tl; ``source bench/device_env.sh`` first)::

    python3 bench/mem_peak.py run --out $OUT/mem --tokens 131072 -- @configs/deepseek_v32_longest.args \\
        --seq-length 131072 --max-position-embeddings 131072 --train-iters 1 \\
        --spec hyscale_megatron.specs hyscale_dsa_layer_spec --hyscale --hyscale-replay-offload
    python3 bench/mem_peak.py analyze SNAPSHOT.pickle --tokens 131072     # an existing snapshot

``run`` writes ``OUT/peak.txt`` (and keeps ``OUT/snapshot.pickle`` only with ``--keep``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections import defaultdict
from typing import Optional

SITE_KEYS = ("hyscale", "kernels/", "patches/", "megatron/")
SKIP_KEYS = ("torch/", "bench/mem_peak.py", "<frozen", "runpy.py")


def site_of(frames, depth: int = 2) -> str:
    """The innermost ``depth`` frames in this repo or Megatron (not torch internals), as 'file:line fn'."""
    picked = []
    for f in frames or ():
        name = f.get("filename", "")
        if any(k in name for k in SKIP_KEYS) or not any(k in name for k in SITE_KEYS):
            continue
        short = name.split("site-packages/")[-1].split("/site/")[-1]
        picked.append(f"{short}:{f.get('line')} {f.get('name')}")
        if len(picked) == depth:
            break
    return " < ".join(picked) if picked else "(no repo frame)"


def replay(events, local: Optional[dict] = None):
    """Replay one device's trace: -> (peak_bytes, live blocks at the peak {addr: event}, index of the
    peak event, oom event or None). Blocks freed with ``free_requested`` count as freed (the
    allocator's "allocated" counter drops there too). ``local``: filled with {allocating site: the
    highest total reached by one of its allocations}, the step's local peaks (which phase would peak
    next once the global one is cut)."""
    live, total = {}, 0
    peak, peak_live, peak_i, oom = -1, {}, -1, None
    for i, e in enumerate(events):
        act = e.get("action")
        if act == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if local is not None:
                site = site_of(e.get("frames"), 2)
                local[site] = max(local.get(site, 0), total)
            if total > peak:
                peak, peak_i = total, i
                peak_live = dict(live)
        elif act in ("free_requested", "free_completed"):
            blk = live.pop(e["addr"], None)
            if blk is not None:
                total -= blk["size"]
        elif act == "oom" and oom is None:
            oom = dict(e, live_total=total, live=dict(live))
    return peak, peak_live, peak_i, oom


def group(live: dict, depth: int = 2):
    """{site: [bytes, count, largest]} of a live set, largest first."""
    sites = defaultdict(lambda: [0, 0, 0])
    for e in live.values():
        s = sites[site_of(e.get("frames"), depth)]
        s[0] += e["size"]
        s[1] += 1
        s[2] = max(s[2], e["size"])
    return sorted(sites.items(), key=lambda kv: -kv[1][0])


def report(snapshot: dict, tokens: Optional[int], top: int = 30, depth: int = 2) -> str:
    traces = snapshot.get("device_traces") or []
    dev = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else None
    if dev is None or not traces[dev]:
        return "no allocator trace in the snapshot (was _record_memory_history on before the run?)\n"
    events = traces[dev]
    local = {}
    peak, live, peak_i, oom = replay(events, local)
    per_tok = (lambda b: f"{b / tokens:10.0f}") if tokens else (lambda b: "")
    gib = 2 ** 30
    lines = [f"device {dev}: {len(events)} trace events; tokens {tokens or '?'}",
             f"peak allocated (replayed): {peak / gib:.2f} GiB" + (f" = {peak / tokens:.0f} B/token" if tokens else ""),
             f"peak at event {peak_i}: {site_of(events[peak_i].get('frames'), 4)}", ""]

    def table(title, live_set):
        out = [title, f"{'bytes/token' if tokens else '':>10} {'GiB':>8} {'n':>4}  site"]
        for site, (b, n, _) in group(live_set, depth)[:top]:
            out.append(f"{per_tok(b)} {b / gib:8.2f} {n:4d}  {site}")
        return out

    lines += table("live at the peak, by call site:", live)
    lines += ["", "local peaks: the highest total reached when each site allocates (the next phases to cut):",
              f"{'bytes/token' if tokens else '':>10} {'GiB':>8}  allocating site"]
    for site, b in sorted(local.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{per_tok(b)} {b / gib:8.2f}  {site}")
    if oom is not None:
        lines += ["", f"OOM event: tried {oom.get('size', 0) / gib:.2f} GiB with {oom['live_total'] / gib:.2f} GiB "
                  f"allocated, at {site_of(oom.get('frames'), 4)}"]
        lines += table("live at the OOM, by call site:", oom["live"])
    return "\n".join(lines) + "\n"


def _run(opts, train_args) -> int:
    import torch  # noqa: PLC0415

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _repo  # noqa: F401,PLC0415
    from hyscale_megatron.tools import train  # noqa: PLC0415

    os.makedirs(opts.out, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=opts.max_entries, context="alloc", stacks="python")
    rc = 1
    try:
        rc = train.main(train_args)
    except BaseException as exc:  # OOM included: the trace up to it is what we want
        print(f"mem_peak: training stopped: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    snap = torch.cuda.memory._snapshot()
    text = report(snap, opts.tokens, opts.top, opts.depth)
    with open(os.path.join(opts.out, "peak.txt"), "w") as f:
        f.write(text)
    print(text, flush=True)
    if opts.keep:
        with open(os.path.join(opts.out, "snapshot.pickle"), "wb") as f:
            pickle.dump(snap, f)
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train under the allocator trace, then report (args after --)")
    r.add_argument("--out", required=True)
    r.add_argument("--keep", action="store_true", help="also keep snapshot.pickle")
    r.add_argument("--max-entries", type=int, default=2_000_000)
    a = sub.add_parser("analyze", help="report on an existing snapshot pickle")
    a.add_argument("snapshot")
    for s in (r, a):
        s.add_argument("--tokens", type=int, default=None, help="tokens per step, for bytes/token")
        s.add_argument("--top", type=int, default=30)
        s.add_argument("--depth", type=int, default=2, help="repo frames per call site")
    opts = p.parse_args(argv)
    if opts.cmd == "run":
        if not train_args:
            p.error("run: give the hyscale_megatron.tools.train arguments after --")
        return _run(opts, train_args)
    with open(opts.snapshot, "rb") as f:
        snap = pickle.load(f)
    sys.stdout.write(report(snap, opts.tokens, opts.top, opts.depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
