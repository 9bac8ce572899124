"""hyscale-compare on CPU: refusals, output files, and an end-to-end run on the tiny config."""

import csv
import math
from pathlib import Path

import pytest

from hyscale_megatron import compare

ROOT = Path(__file__).resolve().parents[1]
TINY = f"@{ROOT / 'configs' / 'tiny_cpu.args'}"
# fp32, same top-k sets: stock and HyScale compute the same function (16 index heads: exact ReLU ties rare)
LM_RTOL = 1e-4


@pytest.mark.parametrize("argv,msg", [
    ([TINY, "--no-hyscale"], "needs HyScale in one of the two runs"),
    ([TINY, "--spec", "hyscale_megatron.specs", "stock_block_spec"], "chooses the layer spec"),
    ([TINY, "--dsa-kernel-backend", "tilelang"], "--stock-backend"),
    ([TINY, "--hyscale-args", "--seed 7"], "refusing --seed in --hyscale-args"),
    ([TINY, "--hyscale-args", "--recompute-granularity selective"], "recompute must be the same"),
    ([TINY, "--hyscale-args", "--data-path /x"], "data"),
    ([TINY, "--experimental-attention-variant", "gated_delta_net"], "without DSA layers"),
    (["--num-layers", "2", "--hidden-size", "64"], "without DSA layers"),
    (["@/does/not/exist.args"], "does not exist"),
])
def test_refuses_unlike_comparisons(argv, msg, capsys, tmp_path):
    assert compare.main(["--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err, err
    assert not (tmp_path / "out").exists(), "nothing may run or be written for a refused comparison"


def test_allows_hyscale_settings_per_run():
    shared = compare.expand_arg_files([TINY])
    compare.check_like_for_like(shared, ["--hyscale-topk-impl", "reference", "--no-hyscale-replay"])


def test_commands_differ_only_in_spec_and_hyscale_flags(tmp_path):
    opts, rest = compare._parser().parse_known_args(["--iters", "3", TINY])
    cmds = compare.run_commands(opts, rest, tmp_path)
    st, hs = cmds["stock"], cmds["hyscale"]
    common = [t for t in st if t in hs]
    assert [t for t in st if t not in common] == ["stock_block_spec", "--no-hyscale", "stock",
                                                  str(tmp_path / "stock.jsonl")]
    assert [t for t in hs if t not in common] == ["hyscale_block_spec", "--hyscale", "hyscale",
                                                  str(tmp_path / "hyscale.jsonl")]
    assert st[st.index("--dsa-kernel-backend") + 1] == hs[hs.index("--dsa-kernel-backend") + 1]


def _fake(run, n, loss0, step):
    return [dict(iteration=i + 1, lm_loss=loss0 - 0.1 * i, indexer_loss=1e-3, step_ms=step, tokens_per_s=1e3 / step,
                 peak_mem_bytes=2**20 * (10 if run == "stock" else 5),
                 replay_store_bytes=None if run == "stock" else 4096) for i in range(n)]


def test_write_outputs_from_records(tmp_path):
    recs = {"stock": _fake("stock", 3, 4.0, 20.0), "hyscale": _fake("hyscale", 3, 4.0, 10.0)}
    meta = dict(config="x", device="cpu", device_name="CPU", torch="t", megatron="m", stock_backend="none",
                date="d", argv=[])
    s = compare.write_outputs(tmp_path, recs, {"stock": 1.0, "hyscale": 1.0}, meta)
    assert s["speedup"] == pytest.approx(2.0) and s["memory_ratio"] == pytest.approx(0.5)
    assert s["max_rel_lm_loss_diff"] == 0.0
    rows = list(csv.DictReader(open(tmp_path / "iterations.csv")))
    assert list(rows[0]) == list(compare.CSV_FIELDS) and len(rows) == 6
    assert rows[0]["replay_store_bytes"] == "0" and rows[3]["replay_store_bytes"] == "4096"
    assert "2.00x" in (tmp_path / "summary.md").read_text()
    with pytest.raises(RuntimeError, match="different iteration counts"):
        compare.write_outputs(tmp_path, {"stock": recs["stock"], "hyscale": recs["hyscale"][:2]}, {}, meta)


def test_compare_tiny_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "tiny"
    rc = compare.main(["--out", str(out), TINY, "--iters", "3", "--max-loss-rtol", str(LM_RTOL)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "[stock]" in printed and "[hyscale]" in printed and "| lm loss:" in printed, "progress must be visible"
    for name in ("iterations.csv", "summary.md", "comparison.png", "summary.json", "stock.log", "hyscale.log"):
        assert (out / name).is_file(), name
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert [r["run"] for r in rows] == ["stock"] * 3 + ["hyscale"] * 3
    assert [int(r["iteration"]) for r in rows] == [1, 2, 3] * 2
    by = {run: [r for r in rows if r["run"] == run] for run in ("stock", "hyscale")}
    for run, rs in by.items():
        for r in rs:
            for key in ("lm_loss", "indexer_loss", "step_ms", "tokens_per_s", "peak_mem_bytes"):
                assert math.isfinite(float(r[key])), (run, key, r[key])
            assert float(r["step_ms"]) > 0 and int(r["peak_mem_bytes"]) > 0
    assert all(int(r["replay_store_bytes"]) == 0 for r in by["stock"])
    assert any(int(r["replay_store_bytes"]) > 0 for r in by["hyscale"]), "full recompute: HyScale replays"
    for s, h in zip(by["stock"], by["hyscale"]):
        assert abs(float(h["lm_loss"]) - float(s["lm_loss"])) <= LM_RTOL * abs(float(s["lm_loss"]))
        assert abs(float(h["indexer_loss"]) - float(s["indexer_loss"])) <= 1e-2 * abs(float(s["indexer_loss"]))
    summary = (out / "summary.md").read_text()
    for text in ("| stock |", "| hyscale |", "speedup", "median step", "peak memory", "max relative LM-loss"):
        assert text in summary, text
    assert "DSAttention" in (out / "stock.log").read_text()
    assert "HyScaleDSAttention" in (out / "hyscale.log").read_text()
