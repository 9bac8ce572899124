"""hyscale-longest: how a run's end is classified (ok, OOM, error, time limit), the sweep's
stop-at-first-OOM order with an injected runner, bad commands answered with one line, merging
sweeps, and one real sweep on the tiny config."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from _tools import TINY, error_lines

from hyscale_megatron.tools import longest

CUDA_OOM = """Traceback (most recent call last):
  File "/x/train.py", line 600, in run_core_loop
    losses = fwd_bwd(forward_step_func=forward_step, data_iterator=data_iter,
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 GiB. GPU 0 has a total capacity of 139.81 GiB
"""
HOST_OOM = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: out of memory\n"
OTHER = """ [..] iteration        1/       3 | lm loss: 4.8E+00 |
Traceback (most recent call last):
  File "/x/dsa.py", line 10, in forward
RuntimeError: shape '[1, 64, 128]' is invalid for input of size 4096
"""
TORCHRUN_OTHER = OTHER + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
SUCCESS = " [..] iteration        3/       3 | lm loss: 4.8E+00 | peak memory (MB): 10.0 |\n"
REC = [dict(iteration=i, lm_loss=4.0, indexer_loss=1e-3, step_ms=s, tokens_per_s=1e3 / s, peak_mem_bytes=2**20 * i,
            replay_store_bytes=4096) for i, s in ((1, 30.0), (2, 10.0), (3, 20.0))]


@pytest.mark.parametrize("rc,log,status,err", [
    (1, CUDA_OOM, "oom", "torch.OutOfMemoryError: CUDA out of memory."),
    (1, "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n", "oom", "CUDA out of memory"),
    (1, HOST_OOM, "oom", "out of memory"),
    (-9, "", "oom", ""),            # SIGKILL from the kernel's OOM killer
    (137, OTHER, "oom", ""),        # the same, reported by a shell or launcher
    (1, OTHER, "error", "RuntimeError: shape '[1, 64, 128]' is invalid for input of size 4096"),
    (1, TORCHRUN_OTHER, "error", "RuntimeError: shape '[1, 64, 128]'"),
    # torch.distributed's "[rankN]: " prefix; a later NCCL warning is not the error
    (1, "[rank0]:     raise ValueError(msg)\n[rank0]: ValueError: T or S too large\n"
        "[rank0]:[W1202 15:42:20 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called\n",
     "error", "ValueError: T or S too large"),
    (-11, "", "error", "killed by signal SIGSEGV"),
    (2, "hyscale-train: error: argument file x does not exist\n", "error", "exit code 2"),
    (0, SUCCESS, "ok", ""),
])
def test_classify(rc, log, status, err):
    got, line = longest.classify(rc, log, REC)
    assert got == status
    assert err in line
    if status == "ok":
        assert line == ""


def test_success_without_iterations_is_an_error():
    assert longest.classify(0, SUCCESS, [])[0] == "error"
    # a successful run that mentions memory in its log is still a success
    assert longest.classify(0, SUCCESS + "warning: nearly out of memory\n", REC)[0] == "ok"


def test_run_metrics_skips_warmup():
    m = longest.run_metrics(REC)
    assert m["median_step_ms"] == 15.0 and m["peak_mem_bytes"] == 3 * 2**20 and m["replay_store_bytes"] == 4096


class FakeRunner:
    """Writes the files a training subprocess would: stock OOMs from 512, HyScale from 2048,
    except an optional real error."""

    def __init__(self, oom_at, error_at=None):
        self.oom_at, self.error_at, self.calls = oom_at, error_at or {}, []

    def __call__(self, kind, cmd, run_dir):
        seq = int(cmd[cmd.index("--seq-length") + 1])
        assert cmd[cmd.index("--max-position-embeddings") + 1] == str(seq)
        self.calls.append((kind, seq, cmd))
        if seq >= self.error_at.get(kind, 1 << 62):
            (run_dir / f"{kind}.log").write_text(OTHER)
            return 1
        if seq >= self.oom_at[kind]:
            (run_dir / f"{kind}.log").write_text(CUDA_OOM)
            return 1
        (run_dir / f"{kind}.log").write_text(SUCCESS)
        recs = [dict(r, peak_mem_bytes=seq * r["iteration"]) for r in REC]
        (run_dir / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return 0


def _rows(path):
    return list(csv.DictReader(open(path)))


def test_stops_each_kind_at_its_first_oom(tmp_path, capsys):
    fake = FakeRunner({"stock": 512, "hyscale": 2048})
    rc = longest.main(["--out", str(tmp_path), TINY, "--seq-lengths", "256,128,512,1024,2048,4096"], runner=fake)
    assert rc == 0
    assert [(k, s) for k, s, _ in fake.calls] == [
        ("stock", 128), ("hyscale", 128), ("stock", 256), ("hyscale", 256), ("stock", 512), ("hyscale", 512),
        ("hyscale", 1024), ("hyscale", 2048)], "stock stops at 512, HyScale at 2048, nothing runs at 4096"
    for kind, _, cmd in fake.calls:
        assert ("--hyscale-replay" in cmd) == (kind == "hyscale")
        assert cmd[cmd.index("--train-iters") + 1] == "3"
    rows = _rows(tmp_path / "longest.csv")
    assert list(rows[0]) == list(longest.CSV_FIELDS)
    got = [(r["kind"], int(r["seq_len"]), r["status"]) for r in rows]
    assert got == [(k, s, "oom" if s >= {"stock": 512, "hyscale": 2048}[k] else "ok") for k, s, _ in fake.calls]
    oom = [r for r in rows if r["status"] == "oom"]
    assert all("OutOfMemoryError" in r["error"] and r["median_step_ms"] == "" for r in oom)
    ok = rows[0]
    assert float(ok["median_step_ms"]) == 15.0 and int(ok["peak_mem_bytes"]) == 3 * 128
    md = (tmp_path / "longest.md").read_text()
    assert ("stock's longest trainable length: 256 (out of memory at 512); "
            "HyScale's: 1024 (out of memory at 2048)") in md
    assert "| 4096 | not run |" in md and "| 512 | OOM |" in md
    assert "stock OOM" in capsys.readouterr().out, "progress must say where a kind stopped"


def test_real_error_is_not_reported_as_oom(tmp_path):
    fake = FakeRunner({"stock": 1 << 30, "hyscale": 1 << 30}, error_at={"hyscale": 128})
    rc = longest.main(["--out", str(tmp_path), TINY, "--seq-lengths", "64,128,256", "--iters", "2"], runner=fake)
    assert rc == 1, "a real failure makes the command fail"
    rows = {(r["kind"], int(r["seq_len"])): r for r in _rows(tmp_path / "longest.csv")}
    assert rows[("hyscale", 128)]["status"] == "error"
    assert rows[("hyscale", 128)]["error"].startswith("RuntimeError: shape")
    assert ("hyscale", 256) not in rows and rows[("stock", 256)]["status"] == "ok"
    md = (tmp_path / "longest.md").read_text()
    assert "stock's longest trainable length: 256 (the longest tried; did not run out of memory)" in md
    assert "HyScale's: 64 (failed with an error at 128, not an OOM)" in md


@pytest.mark.parametrize("argv,msg", [
    ([TINY, "--recompute-granularity", "selective"], "without full activation recompute"),
    ([TINY, "--hyscale-args=--no-hyscale-replay"], "--no-hyscale-replay"),
    ([TINY, "--experimental-attention-variant", "gated_delta_net"], "without DSA layers"),
    ([TINY, "--hyscale-args", "--seed 3"], "refusing --seed"),
    ([TINY, "--spec", "hyscale_megatron.specs", "stock_block_spec"], "layer spec"),
    ([TINY, "--hyscale-args", "--hyscale-attn-impl bogus"], "attn_impl='bogus' is invalid"),
    ([TINY, "--iters", "0"], "argument --iters: must be an integer >= 1"),
    ([TINY, "--run-timeout-s", "0"], "argument --run-timeout-s: must be > 0 seconds"),
    ([TINY, "--kinds", "stock,dense"], "--kinds wants"),
    ([TINY, "--seq-lengths", "64,x"], "--seq-lengths wants comma-separated integers"),
])
def test_refusals(argv, msg, tmp_path, capsys):
    def never(*a):
        raise AssertionError("nothing may run for a refused sweep")

    assert longest.main(["--out", str(tmp_path / "o"), *argv], runner=never) == 2
    lines = error_lines(capsys.readouterr().err, "hyscale-longest")
    assert len(lines) == 1 and msg in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_default_config_is_the_deepseek_v32_one(tmp_path):
    rest = longest.with_default_config(["--micro-batch-size", "1"])
    assert rest[0].startswith("@") and rest[0].endswith("configs/deepseek_v32_longest.args")
    assert Path(rest[0][1:]).is_file()
    assert longest.with_default_config([TINY]) == [TINY]
    opts = longest._parser().parse_args([])
    assert opts.seq_lengths == [32768, 131072, 524288, 1048576] and opts.iters == 3


def test_real_sweep_of_the_tiny_config(tmp_path, capsys):
    """Two real HyScale runs (64 and 128 tokens): the runner, the appended lengths and the replay store
    growing with the sequence (the stock runs go through the same runner in test_compare.py)."""
    out = tmp_path / "tiny"
    rc = longest.main(["--out", str(out), TINY, "--seq-lengths", "64,128", "--iters", "2", "--kinds", "hyscale"])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert "[hyscale]" in printed and "| lm loss:" in printed, "progress must be visible"
    rows = _rows(out / "longest.csv")
    assert [(r["kind"], int(r["seq_len"]), r["status"]) for r in rows] == [("hyscale", 64, "ok"), ("hyscale", 128, "ok")]
    for r in rows:
        for key in ("median_step_ms", "tokens_per_s"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, key
        assert int(r["peak_mem_bytes"]) > 0 and r["error"] == "" and r["iterations"] == "2"
    store = {int(r["seq_len"]): int(r["replay_store_bytes"]) for r in rows}
    assert 0 < store[64] < store[128], "full recompute + replay: the store grows with the sequence"
    for seq in (64, 128):
        assert f"--seq-length {seq} --max-position-embeddings {seq}" in printed
        assert "HyScaleDSAttention" in (out / f"L{seq}" / "hyscale.log").read_text()
    md = (out / "longest.md").read_text()
    assert "| 64 | not run |" in md and "HyScale's: 128 (the longest tried; did not run out of memory)" in md
    assert "- command: `hyscale-longest --out" in md
    assert ("CPU timings are not meaningful" in md) != torch.cuda.is_available()


class TimeoutRunner(FakeRunner):
    """Like FakeRunner, but the time limit fires at `slow_at` (after one logged iteration when `partial`)."""

    def __init__(self, oom_at, slow_at, partial):
        super().__init__(oom_at)
        self.slow_at, self.partial = slow_at, partial

    def __call__(self, kind, cmd, run_dir):
        assert cmd[:3] == ["timeout", "--kill-after=60", "90"], "every run is wrapped in the time limit"
        inner = cmd[3:]
        if int(inner[inner.index("--seq-length") + 1]) >= self.slow_at.get(kind, 1 << 62):
            self.calls.append((kind, int(inner[inner.index("--seq-length") + 1]), inner))
            (run_dir / f"{kind}.log").write_text(" [..] iteration        1/       3 |\n" if self.partial else "")
            recs = REC[:1] if self.partial else []
            (run_dir / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            return longest.TIMEOUT_RC
        return super().__call__(kind, inner, run_dir)


@pytest.mark.parametrize("partial", [True, False])
def test_time_limit_is_not_an_oom(tmp_path, partial):
    fake = TimeoutRunner({"stock": 1 << 30, "hyscale": 1 << 30}, {"stock": 256}, partial)
    rc = longest.main(["--out", str(tmp_path), TINY, "--seq-lengths", "128,256,512", "--run-timeout-s", "90"],
                      runner=fake)
    assert rc == 0, "a time limit is not a failure of the code"
    assert [(k, s) for k, s, _ in fake.calls] == [("stock", 128), ("hyscale", 128), ("stock", 256), ("hyscale", 256),
                                                  ("hyscale", 512)], "stock stops after its time limit"
    rows = {(r["kind"], int(r["seq_len"])): r for r in _rows(tmp_path / "longest.csv")}
    slow = rows[("stock", 256)]
    md = (tmp_path / "longest.md").read_text()
    if partial:
        assert slow["status"] == "partial" and float(slow["median_step_ms"]) == 30.0
        assert "after 1 iteration(s)" in slow["error"]
        assert "stock's longest trainable length: 256 (time limit 90 s reached after 1 iteration(s) at 256" in md
    else:
        assert slow["status"] == "timeout" and slow["median_step_ms"] == ""
        assert "stock's longest trainable length: 128 (no iteration within the time limit at 256: not an OOM" in md
    assert "HyScale's: 512 (the longest tried" in md


def test_kinds(tmp_path):
    fake = FakeRunner({"stock": 1 << 30, "hyscale": 1 << 30})
    assert longest.main(["--out", str(tmp_path), TINY, "--seq-lengths", "64,128", "--kinds", "hyscale"],
                        runner=fake) == 0
    assert [(k, s) for k, s, _ in fake.calls] == [("hyscale", 64), ("hyscale", 128)]
    md = (tmp_path / "longest.md").read_text()
    assert "stock's longest trainable length: not run" in md and "| 64 | not run |" in md


def test_real_time_limit_with_the_tiny_config(tmp_path):
    """Real subprocesses under coreutils timeout: 1 s is less than the start-up, so both time out."""
    rc = longest.main(["--out", str(tmp_path), TINY, "--seq-lengths", "64,128", "--iters", "1", "--run-timeout-s", "1"])
    assert rc == 0
    rows = [(r["kind"], int(r["seq_len"]), r["status"]) for r in _rows(tmp_path / "longest.csv")]
    assert rows == [("stock", 64, "timeout"), ("hyscale", 64, "timeout")]


def test_merge_two_sweeps(tmp_path, capsys):
    """--merge joins a stock-only and a HyScale-only sweep; a one-iteration PARTIAL row is marked as a
    warm-up step time and gets no speedup; a directory without meta.json is refused."""
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    fake = FakeRunner({"stock": 1 << 30, "hyscale": 1 << 30})
    assert longest.main(["--out", str(a), TINY, "--seq-lengths", "128,256", "--kinds", "hyscale"], runner=fake) == 0
    assert longest.main(["--out", str(b), TINY, "--seq-lengths", "128,256", "--kinds", "stock"], runner=fake) == 0
    rows = _rows(b / "longest.csv")
    rows[1].update(status="partial", iterations="1", error="time limit 9 s reached after 1 iteration(s)")
    with open(b / "longest.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    capsys.readouterr()
    assert longest.main(["--merge", f"{a},{b}", "--out", str(out)]) == 0
    merged = _rows(out / "longest.csv")
    assert [(r["kind"], r["seq_len"], r["status"]) for r in merged] == [
        ("stock", "128", "ok"), ("hyscale", "128", "ok"), ("stock", "256", "partial"), ("hyscale", "256", "ok")]
    assert merged[1]["iterations"] == "3"
    md = (out / "longest.md").read_text()
    assert "| 128 | ok | 15.0 |" in md and "| 1.00x |" in md
    assert "| 256 | PARTIAL | 15.0 (warm-up) |" in md
    assert md.count("x |") == 1, "no speedup from a warm-up-only step time"
    assert md.count("- device:") == 1
    assert "HyScale flags added by hyscale-longest: `--hyscale-replay" in md
    assert json.loads((out / "meta.json").read_text())["merged_from"] == [str(a), str(b)]
    meta_b = json.loads((b / "meta.json").read_text())
    (b / "meta.json").write_text(json.dumps(dict(meta_b, torch="0.0-other")))
    assert longest.main(["--merge", f"{a},{b}", "--out", str(out)]) == 2
    assert "torch='0.0-other'" in capsys.readouterr().err
    (a / "meta.json").unlink()
    (b / "meta.json").unlink()
    assert longest.main(["--merge", f"{a},{b}", "--out", str(out)]) == 2
    assert "meta.json" in capsys.readouterr().err
