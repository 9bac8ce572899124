"""bench/mem_peak.py's trace replay (the GPU run itself needs CUDA; its analysis does not)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("mem_peak", os.path.join(ROOT, "bench", "mem_peak.py"))
mem_peak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mem_peak)


def _fr(*sites):
    return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}] + [
        {"filename": f"/tmp/site/{f}", "line": ln, "name": fn} for f, ln, fn in sites]


def _ev(action, addr, size, *sites):
    return {"action": action, "addr": addr, "size": size, "frames": _fr(*sites)}


def test_replay_finds_the_peak_live_set_and_the_oom():
    a = ("megatron/core/a.py", 10, "fwd")
    b = ("hyscale_kernels/k.py", 20, "bwd")
    events = [
        _ev("alloc", 1, 100, a), _ev("alloc", 2, 300, b), _ev("free_requested", 1, 100, a),
        _ev("free_completed", 1, 100, a),  # a second free of the same block must not count twice
        _ev("alloc", 3, 250, a),  # total 550: the peak
        _ev("free_requested", 2, 300, b), _ev("alloc", 4, 50, b),
        {"action": "oom", "addr": 0, "size": 1000, "frames": _fr(b)},
    ]
    local = {}
    peak, live, peak_i, oom = mem_peak.replay(events, local)
    assert peak == 550 and peak_i == 4 and set(live) == {2, 3}
    assert local == {"megatron/core/a.py:10 fwd": 550, "hyscale_kernels/k.py:20 bwd": 400}
    assert oom is not None and oom["live_total"] == 300 and set(oom["live"]) == {3, 4}
    groups = dict(mem_peak.group(live, depth=1))
    assert groups == {"hyscale_kernels/k.py:20 bwd": [300, 1, 300], "megatron/core/a.py:10 fwd": [250, 1, 250]}
    text = mem_peak.report({"device_traces": [[], events]}, tokens=10)
    assert "device 1" in text and "= 55 B/token" in text and "OOM event" in text and "local peaks" in text
    assert "torch/nn" not in text  # torch-internal frames are skipped


def test_report_without_trace_says_so():
    assert "no allocator trace" in mem_peak.report({"device_traces": []}, tokens=None)
