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


# ----------------------------------------------------------------------------- --noise-ref (bf16-noise reference)
def test_noise_ref_command_is_stock_with_the_reference_backend(tmp_path):
    opts, rest = compare._parser().parse_known_args(["--iters", "3", "--stock-backend", "tilelang",
                                                     "--noise-ref", "none", TINY])
    cmds = compare.run_commands(opts, rest, tmp_path)
    assert list(cmds) == ["stock", "hyscale", "stock_ref"]
    st, ref = cmds["stock"], cmds["stock_ref"]
    assert st[st.index("--dsa-kernel-backend") + 1] == "tilelang"
    assert ref[ref.index("--dsa-kernel-backend") + 1] == "none"
    assert ref[ref.index("--hyscale-metrics-file") + 1] == str(tmp_path / "stock_ref.jsonl")
    assert ref[ref.index("--hyscale-run-name") + 1] == "stock_ref"
    assert len(ref) == len(st)
    assert [(a, b) for a, b in zip(st, ref) if a != b] == [
        ("tilelang", "none"), ("stock", "stock_ref"),
        (str(tmp_path / "stock.jsonl"), str(tmp_path / "stock_ref.jsonl"))]
    assert "--no-hyscale" in ref and "stock_block_spec" in ref
    # off by default: two runs, as before
    opts, rest = compare._parser().parse_known_args(["--iters", "3", TINY])
    assert list(compare.run_commands(opts, rest, tmp_path)) == ["stock", "hyscale"]


@pytest.mark.parametrize("argv,msg", [
    (["--stock-backend", "none", "--noise-ref", "none"], "refusing --noise-ref none: the stock run already uses"),
    (["--stock-backend", "tilelang", "--noise-ref", "tilelang"], "must be stock with a DIFFERENT backend"),
    (["--noise-ref", compare.stock_backend("auto")], "(--stock-backend auto)"),  # auto resolved first
    (["--require-parity"], "refusing --require-parity without --noise-ref"),
])
def test_noise_ref_refusals(argv, msg, capsys, tmp_path):
    assert compare.main(["--out", str(tmp_path / "out"), TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("slack", ["0", "-1", "nan", "inf", "x"])
def test_noise_slack_validated(slack, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--out", str(tmp_path / "out"), TINY, "--noise-ref", "cudnn", "--noise-slack", slack])
    assert exc.value.code == 2
    assert "--noise-slack: must be a finite number > 0" in capsys.readouterr().err


def _noise_records(n=20):
    """Hand-made losses, n = 20 -> window W = 2. Stock: LM 2.0, indexer 1e-3 throughout.
    HyScale: LM 2.1, 1.9 at iterations 5, 6 (per-iteration 0.05; windowed means: (2.0+2.1)/2 -> 0.025,
    (2.1+1.9)/2 -> 0, (1.9+2.0)/2 -> 0.025); indexer 1.1e-3 at iteration 1 (0.1; window (1, 2): 0.05).
    stock_ref: LM 2.03 at iterations 11, 12 (per-iteration 0.015; window (11, 12): 0.015)."""
    def recs(run):
        return [dict(iteration=i + 1, lm_loss=2.0, indexer_loss=1e-3, step_ms=10.0, tokens_per_s=100.0,
                     peak_mem_bytes=2**20, replay_store_bytes=4096 if run == "hyscale" else None) for i in range(n)]
    st, hs, ref = recs("stock"), recs("hyscale"), recs("stock_ref")
    hs[4]["lm_loss"], hs[5]["lm_loss"] = 2.1, 1.9
    hs[0]["indexer_loss"] = 1.1e-3
    ref[10]["lm_loss"] = ref[11]["lm_loss"] = 2.03
    return {"stock": st, "hyscale": hs, "stock_ref": ref}


def test_divergence_metrics_by_hand():
    r = _noise_records()
    hs = compare.divergence(r["hyscale"], r["stock"])
    assert hs["window"] == 2 and hs["iterations"] == 20
    assert hs["max_rel_lm_loss_diff"] == pytest.approx(0.05)
    assert hs["max_rel_windowed_lm_diff"] == pytest.approx(0.025)
    assert hs["max_rel_indexer_loss_diff"] == pytest.approx(0.1)
    assert hs["max_rel_windowed_indexer_diff"] == pytest.approx(0.05)
    assert hs["first_divergence_iter"] == 5
    ref = compare.divergence(r["stock_ref"], r["stock"])
    assert ref["max_rel_lm_loss_diff"] == pytest.approx(0.015)
    assert ref["max_rel_windowed_lm_diff"] == pytest.approx(0.015)
    assert ref["max_rel_windowed_indexer_diff"] == 0.0 and ref["first_divergence_iter"] == 11
    # window = max(1, n // 10); a window of 1 is the per-iteration difference; never diverged -> None
    assert [compare.loss_window(n) for n in (1, 9, 10, 19, 20, 105)] == [1, 1, 1, 1, 2, 10]
    assert compare.max_windowed_rel([1.0, 3.0, 2.0], [1.0, 2.0, 2.0]) == pytest.approx(0.5)
    assert compare.max_windowed_rel([1.0] * 10 + [3.0, 1.0] * 5, [1.0] * 20) == pytest.approx(1.0)  # W = 2
    assert compare.divergence(r["stock"], r["stock"])["first_divergence_iter"] is None
    nan = [dict(rec) for rec in r["hyscale"]]
    nan[7]["lm_loss"] = float("nan")
    assert math.isnan(compare.divergence(nan, r["stock"])["max_rel_windowed_lm_diff"])
    assert not compare.parity_verdict(compare.divergence(nan, r["stock"]), ref, 1.5)["within_noise"]


def test_summary_two_runs_has_windowed_metrics_only_in_json(tmp_path):
    r = _noise_records()
    s = compare.write_outputs(tmp_path, {"stock": r["stock"], "hyscale": r["hyscale"]}, {}, META)
    assert s["loss_window"] == 2 and s["max_rel_windowed_lm_diff"] == pytest.approx(0.025)
    assert s["max_rel_windowed_indexer_diff"] == pytest.approx(0.05) and s["first_divergence_iter"] == 5
    assert "noise_ref" not in s and "parity" not in s
    md = (tmp_path / "summary.md").read_text()
    assert "bf16 noise:" not in md and "windowed" not in md and "| stock_ref" not in md


META_REF = dict(META, stock_backend="tilelang", noise_ref="none")


def test_noise_ref_summary_and_verdict(tmp_path):
    r = _noise_records()
    s = compare.write_outputs(tmp_path, r, {}, META_REF)  # slack 1.5: 0.025 > 1.5 x 0.015
    assert s["noise_ref"]["backend"] == "none" and s["noise_ref"]["run"] == "stock_ref"
    assert s["noise_ref"]["vs_stock"]["max_rel_windowed_lm_diff"] == pytest.approx(0.015)
    par = s["parity"]
    assert par["hyscale_vs_stock"]["max_rel_windowed_lm_diff"] == pytest.approx(0.025)
    assert par["stock_ref_vs_stock"]["first_divergence_iter"] == 11
    assert par["slack"] == 1.5 and par["bound"] == pytest.approx(0.0225) and par["window"] == 2
    assert par["within_noise"] is False
    md = (tmp_path / "summary.md").read_text()
    assert "## bf16 noise: reference `stock_ref` = stock with `--dsa-kernel-backend none`" in md
    assert "| pair | max per-iter LM diff | max windowed LM diff | max windowed indexer diff | " \
           "first iteration > 0.01 |" in md
    assert "| hyscale vs stock | 0.05 | 0.025 | 0.05 | 5 |" in md
    assert "| stock_ref (none) vs stock | 0.015 | 0.015 | 0 | 11 |" in md
    hr = par["hyscale_vs_stock_ref"]  # the third pair, against the reference run itself
    assert hr == compare.divergence(r["hyscale"], r["stock_ref"]) and hr["iterations"] == 20
    assert "| hyscale vs stock_ref (none) (information) |" in md
    assert "**HyScale within bf16 noise: no** (windowed LM-loss divergence 0.025 > 1.5 x reference's 0.015)" in md
    assert "| stock_ref | 10.0 |" in md  # its row in the run table
    rows = list(csv.DictReader(open(tmp_path / "iterations.csv")))
    assert [r["run"] for r in rows] == ["stock"] * 20 + ["hyscale"] * 20 + ["stock_ref"] * 20
    assert rows[-1]["replay_store_bytes"] == "0"
    assert (tmp_path / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = compare.write_outputs(tmp_path, r, {}, META_REF, noise_slack=2.0)  # 0.025 <= 2 x 0.015
    assert s["parity"]["within_noise"] is True
    assert "**HyScale within bf16 noise: yes** (windowed LM-loss divergence 0.025 <= 2 x reference's 0.015)" \
        in (tmp_path / "summary.md").read_text()


def test_noise_ref_run_end_to_end_with_fake_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    recs = _noise_records()
    seen = []

    def fake_run_one(name, cmd, out_dir):
        seen.append((name, cmd))
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[name]))
        return 2.0

    monkeypatch.setattr(compare, "run_one", fake_run_one)
    base = ["--out", str(out), TINY, "--iters", "20", "--stock-backend", "tilelang", "--noise-ref", "none"]
    assert compare.main(base) == 0  # no --require-parity: the verdict is reported, not enforced
    assert [name for name, _ in seen] == ["stock", "hyscale", "stock_ref"]
    ref_cmd = seen[2][1]
    assert ref_cmd[ref_cmd.index("--dsa-kernel-backend") + 1] == "none"
    assert ref_cmd[ref_cmd.index("--hyscale-metrics-file") + 1] == str(out / "stock_ref.jsonl")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["noise_ref"] == "none" and meta["stock_backend"] == "tilelang"
    s = json.loads((out / "summary.json").read_text())
    assert s["runs"]["stock_ref"]["wall_s"] == 2.0 and s["parity"]["within_noise"] is False
    assert "HyScale within bf16 noise: no" in capsys.readouterr().out
    for name in ("iterations.csv", "summary.md", "comparison.png"):
        assert (out / name).is_file(), name
    assert compare.main([*base, "--require-parity"]) == 3
    assert "HyScale is not within bf16 noise" in capsys.readouterr().err
    assert compare.main([*base, "--require-parity", "--noise-slack", "2"]) == 0
    # without --noise-ref: two runs, meta records none
    seen.clear()
    assert compare.main(["--out", str(out), TINY, "--iters", "20"]) == 0
    assert [name for name, _ in seen] == ["stock", "hyscale"]
    assert json.loads((out / "meta.json").read_text())["noise_ref"] is None
    assert "parity" not in json.loads((out / "summary.json").read_text())


def test_summarize_only_picks_up_stock_ref(tmp_path, capsys):
    out = tmp_path / "cut"
    r = _noise_records()
    _write_run(out, r, meta=META_REF)
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["noise_ref"]["backend"] == "none" and s["parity"]["within_noise"] is False
    assert s["runs"]["stock_ref"]["wall_s"] is None
    rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert [r["run"] for r in rows].count("stock_ref") == 20
    assert "HyScale within bf16 noise: no" in (out / "summary.md").read_text()
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert compare.main(["--out", str(out), "--summarize-only", "--require-parity"]) == 3
    assert "not within bf16 noise" in capsys.readouterr().err
    assert compare.main(["--out", str(out), "--summarize-only", "--require-parity", "--noise-slack", "2"]) == 0
    # --noise-ref must agree with meta.json
    assert compare.main(["--out", str(out), "--summarize-only", "--noise-ref", "cudnn"]) == 2
    assert "contradicts" in capsys.readouterr().err
    # a reference run cut short: all three cut to the shortest
    _write_run(out, {"stock_ref": r["stock_ref"][:15]}, meta=META_REF)
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert "(stock 20, hyscale 20, stock_ref 15); all cut to the first 15" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["runs"]["hyscale"]["iterations"] == 15


def test_summarize_only_stock_ref_meta_cases(tmp_path, capsys):
    out = tmp_path / "cut"
    r = _noise_records()
    # meta.json of a comparison without a reference run: a stock_ref.jsonl left from an earlier one is ignored
    _write_run(out, r, meta=dict(META, noise_ref=None))
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert "note: ignoring" in capsys.readouterr().out
    assert "parity" not in json.loads((out / "summary.json").read_text())
    # ... unless --noise-ref names its backend
    assert compare.main(["--out", str(out), "--summarize-only", "--noise-ref", "none"]) == 0
    assert json.loads((out / "summary.json").read_text())["noise_ref"]["backend"] == "none"
    # a hand-written meta.json without noise_ref: picked up, backend unknown
    (out / "meta.json").write_text(json.dumps({"device": "cuda", "stock_backend": "tilelang"}))
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert json.loads((out / "summary.json").read_text())["noise_ref"]["backend"] == "unknown"
    # --require-parity / --noise-ref without the reference's metrics: exit 2
    (out / "stock_ref.jsonl").unlink()
    for extra in (["--require-parity"], ["--noise-ref", "none"]):
        assert compare.main(["--out", str(out), "--summarize-only", *extra]) == 2
        assert "stock_ref.jsonl" in capsys.readouterr().err


def test_runs_split_over_calls(tmp_path, monkeypatch, capsys):
    """--runs trains a subset now and summarizes once every run's metrics file is in --out (the slow
    noise reference in its own device call); other flags in a reused --out, or unknown runs, are refused."""
    out = tmp_path / "out"
    recs = _noise_records()
    seen = []

    def fake_run_one(name, cmd, out_dir):
        seen.append(name)
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[name]))
        return 2.0

    monkeypatch.setattr(compare, "run_one", fake_run_one)
    base = ["--out", str(out), TINY, "--iters", "20", "--stock-backend", "tilelang", "--noise-ref", "none"]
    assert compare.main([*base, "--runs", "stock,hyscale"]) == 0
    assert seen == ["stock", "hyscale"] and not (out / "summary.json").exists()
    assert "stock_ref still to run" in capsys.readouterr().out
    assert compare.main([*base, "--runs", "stock_ref"]) == 0
    assert seen == ["stock", "hyscale", "stock_ref"]
    s = json.loads((out / "summary.json").read_text())
    assert set(s["runs"]) == {"stock", "hyscale", "stock_ref"} and "parity" in s
    capsys.readouterr()
    assert compare.main(["--out", str(out), TINY, "--iters", "30", "--stock-backend", "tilelang",
                         "--noise-ref", "none", "--runs", "stock_ref"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert compare.main([*base, "--runs", "stock,bogus"]) == 2
    assert "choose from stock, hyscale, stock_ref" in capsys.readouterr().err
    assert compare.main(["--out", str(tmp_path / "o2"), TINY, "--runs", "stock_ref"]) == 2
    assert "stock_ref needs --noise-ref" in capsys.readouterr().err
    assert seen == ["stock", "hyscale", "stock_ref"]  # nothing trained by the refused calls
