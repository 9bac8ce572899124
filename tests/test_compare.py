"""hyscale-compare on CPU: refusals, output files, and an end-to-end run on the tiny config."""

import csv
import json
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


META = dict(config="@configs/x.args", device="cuda", device_name="NVIDIA H200", torch="t", megatron="m",
            stock_backend="tilelang", date="d", argv=[])


def _write_run(out, recs, meta=META):
    out.mkdir(parents=True, exist_ok=True)
    for run, rs in recs.items():
        (out / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    if meta is not None:
        (out / "meta.json").write_text(json.dumps(meta, indent=2))


def test_summarize_only_rebuilds_outputs(tmp_path, capsys):
    out = tmp_path / "cut"
    st, hs = _fake("stock", 4, 4.0, 20.0), _fake("hyscale", 4, 4.0, 10.0)
    for i, ms in enumerate((100.0, 21.0, 19.0, 23.0)):  # first iteration (warm-up) excluded from the medians
        st[i]["step_ms"] = ms
    for i, ms in enumerate((90.0, 11.0, 9.0, 10.0)):
        hs[i]["step_ms"] = ms
    hs[2]["lm_loss"] *= 1 + 1e-6
    _write_run(out, {"stock": st, "hyscale": hs})
    assert compare.main(["--out", str(out), "--summarize-only", "--max-loss-rtol", "1e-4"]) == 0
    printed = capsys.readouterr().out
    assert "# Stock DSA vs HyScale" in printed and f"wrote {out}/iterations.csv" in printed
    for name in ("iterations.csv", "summary.md", "summary.json", "comparison.png"):
        assert (out / name).is_file(), name
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert [(r["run"], int(r["iteration"])) for r in rows] == [("stock", i) for i in (1, 2, 3, 4)] + \
        [("hyscale", i) for i in (1, 2, 3, 4)]
    assert [float(r["step_ms"]) for r in rows] == [100.0, 21.0, 19.0, 23.0, 90.0, 11.0, 9.0, 10.0]
    s = json.loads((out / "summary.json").read_text())
    assert s["speedup"] == pytest.approx(21.0 / 10.0)  # median(21, 19, 23) / median(11, 9, 10)
    assert s["runs"]["stock"]["wall_s"] is None and s["runs"]["hyscale"]["wall_s"] is None
    assert s["max_rel_lm_loss_diff"] == pytest.approx(1e-6, rel=1e-3)
    assert s["meta"]["device_name"] == "NVIDIA H200" and "truncated" not in s
    assert "2.10x" in (out / "summary.md").read_text()
    # --max-loss-rtol applies
    assert compare.main(["--out", str(out), "--summarize-only", "--max-loss-rtol", "1e-7"]) == 3
    assert "exceeds --max-loss-rtol" in capsys.readouterr().err


def test_summarize_only_needs_meta_json(tmp_path, capsys):
    out = tmp_path / "cut"
    _write_run(out, {"stock": _fake("stock", 2, 4.0, 20.0), "hyscale": _fake("hyscale", 2, 4.0, 10.0)}, meta=None)
    assert compare.main(["--out", str(out), "--summarize-only"]) == 2
    err = capsys.readouterr().err
    assert str(out / "meta.json") in err and "write it by hand" in err, err
    assert not (out / "summary.md").exists()
    # a hand-written meta.json with only some keys is enough
    (out / "meta.json").write_text(json.dumps({"device": "cuda", "stock_backend": "tilelang"}))
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert "config: `unknown`" in (out / "summary.md").read_text()


def test_summarize_only_truncates_unequal_runs(tmp_path, capsys):
    out = tmp_path / "cut"
    _write_run(out, {"stock": _fake("stock", 5, 4.0, 20.0), "hyscale": _fake("hyscale", 3, 4.0, 10.0)})
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    printed = capsys.readouterr().out
    assert "note: the runs logged different iteration counts (stock 5, hyscale 3); both cut to the first 3" \
        in printed, printed
    rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert [(r["run"], int(r["iteration"])) for r in rows] == [("stock", i) for i in (1, 2, 3)] + \
        [("hyscale", i) for i in (1, 2, 3)]
    s = json.loads((out / "summary.json").read_text())
    assert s["runs"]["stock"]["iterations"] == s["runs"]["hyscale"]["iterations"] == 3
    assert s["truncated"]["used"] == 3
    assert "both cut to the first 3" in (out / "summary.md").read_text()


def test_summarize_only_still_checks_given_flags(tmp_path, capsys):
    out = tmp_path / "cut"
    _write_run(out, {"stock": _fake("stock", 2, 4.0, 20.0), "hyscale": _fake("hyscale", 2, 4.0, 10.0)})
    assert compare.main(["--out", str(out), "--summarize-only", TINY, "--no-hyscale"]) == 2
    assert "needs HyScale in one of the two runs" in capsys.readouterr().err
    assert not (out / "summary.md").exists()
    assert compare.main(["--out", str(out), "--summarize-only", TINY]) == 0


def test_meta_json_written_before_the_runs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    seen = []

    def fake_run_one(name, cmd, out_dir):
        seen.append((name, json.loads((out_dir / "meta.json").read_text())))  # already there
        (out_dir / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _fake(name, 3, 4.0, 20.0 if name == "stock" else 10.0)))
        return 1.5

    monkeypatch.setattr(compare, "run_one", fake_run_one)
    assert compare.main(["--out", str(out), TINY, "--iters", "3"]) == 0
    assert [name for name, _ in seen] == ["stock", "hyscale"]
    meta = seen[0][1]
    assert meta["config"].endswith("tiny_cpu.args --train-iters 3") and meta["argv"] == [TINY]
    assert set(compare.META_KEYS) <= set(meta)
    s = json.loads((out / "summary.json").read_text())
    assert s["speedup"] == pytest.approx(2.0) and s["runs"]["stock"]["wall_s"] == 1.5
    # the normal path stays strict about unequal iteration counts
    with pytest.raises(RuntimeError, match="different iteration counts"):
        compare.write_outputs(out, {"stock": _fake("stock", 3, 4.0, 1.0), "hyscale": _fake("hyscale", 2, 4.0, 1.0)},
                              {}, meta)
