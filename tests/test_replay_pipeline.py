"""Replay under real pipeline parallelism: 2 CPU processes (gloo), 1F1B and interleaved schedules.

With PP=2 and 4 microbatches, stage 0 runs several forwards before their backwards (warm-up), so
each recompute must find its own microbatch's selection. Losses with full recompute + replay must
equal the run without recompute.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args_without_recompute(tmp_path):
    src = open(os.path.join(ROOT, "configs", "tiny_cpu.args")).read().splitlines()
    kept = [line for line in src if not line.strip().startswith("--recompute-")]
    path = tmp_path / "tiny_norecompute.args"
    path.write_text("\n".join(kept) + "\n")
    return str(path)


def _run(tmp_path, name, args_file, extra, port):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "hyscale_megatron.tools.train", f"@{args_file}", "--num-layers", "4",
           "--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--train-iters", "2",
           "--hyscale-metrics-file", str(metrics), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_recompute_with_replay_matches_no_recompute(tmp_path, schedule):
    extra = ["--num-layers-per-virtual-pipeline-stage", "1"] if schedule == "interleaved" else []
    base_port = 29700 + (0 if schedule == "1f1b" else 20) + os.getpid() % 50
    ref = _run(tmp_path, "ref", _args_without_recompute(tmp_path), extra, base_port)
    rep = _run(tmp_path, "replay", os.path.join(ROOT, "configs", "tiny_cpu.args"), extra + ["--hyscale-replay"],
               base_port + 1)
    assert len(ref) == len(rep) == 2
    for a, b in zip(ref, rep):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["indexer_loss"] == pytest.approx(a["indexer_loss"], rel=1e-4)
    assert all((r["replay_store_bytes"] or 0) > 0 for r in rep), "replay store was not used"
    assert all(not r["replay_store_bytes"] for r in ref)
