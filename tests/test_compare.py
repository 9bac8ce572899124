"""hyscale-compare: bad commands answered with one line before anything runs, like-for-like run
commands, the outputs it writes from the runs' metrics (summary, CSV, plot, bf16-noise verdict),
rebuilding them (--summarize-only, --runs), and one real stock-vs-HyScale comparison on CPU."""

import csv
import json
import math

import pytest
import torch
from _tools import META_CPU, META_GPU, PNG_MAGIC, TINY, error_lines, fake_records, write_metrics, write_run

from hyscale_megatron.tools import compare

# fp32, same top-k sets: stock and HyScale compute the same function (16 index heads: exact ReLU ties rare)
LM_RTOL = 1e-4


@pytest.fixture
def no_runs(monkeypatch):
    """Fail the test if a training subprocess would start."""
    def never(*a, **k):
        raise AssertionError("nothing may run for a refused command")

    monkeypatch.setattr(compare, "run_process", never)


@pytest.fixture
def fake_runs(monkeypatch):
    """Replace the training subprocesses by metrics files (HyScale twice as fast); records what ran."""
    seen = []
    recs = {}

    def fake_run_one(name, cmd, out_dir):
        seen.append((name, cmd))
        write_metrics(out_dir / f"{name}.jsonl", recs.get(name) or fake_records(name, 3, step_ms=20.0 if name ==
                                                                                 "stock" else 10.0))
        return 1.5

    monkeypatch.setattr(compare, "run_one", fake_run_one)
    fake_run_one.seen, fake_run_one.records = seen, recs
    return fake_run_one


# ----------------------------------------------------------------------------- bad commands: one line, nothing run
@pytest.mark.parametrize("argv,msg", [
    ([TINY, "--no-hyscale"], "needs HyScale in one of the two runs"),
    ([TINY, "--spec", "hyscale_megatron.specs", "stock_block_spec"], "chooses the layer spec"),
    ([TINY, "--dsa-kernel-backend", "tilelang"], "--stock-backend"),
    ([TINY, "--hyscale-args", "--seed 7"], "refusing --seed in --hyscale-args"),
    ([TINY, "--hyscale-args", "--recompute-granularity selective"], "recompute must be the same"),
    ([TINY, "--experimental-attention-variant", "gated_delta_net"], "without DSA layers"),
    (["--num-layers", "2", "--hidden-size", "64"], "without DSA layers"),
    (["@/does/not/exist.args"], "does not exist"),
    ([TINY, "--hyscale-args", "--hyscale-topk-impl bogus"], "topk_impl='bogus' is invalid; choose one of"),
    ([TINY, "--hyscale-topk-impl", "bogus"], "topk_impl='bogus' is invalid"),
    ([TINY, "--seq-lenght", "97"], "unrecognized arguments: --seq-lenght 97"),
    ([TINY, "--train-iters", "0"], "--train-iters must be >= 1"),
    ([TINY, "--iters", "0"], "argument --iters: must be an integer >= 1, got '0'"),
    ([TINY, "--max-loss-rtol", "-1"], "argument --max-loss-rtol: must be a finite number >= 0"),
    ([TINY, "--hyscale-args", "--hyscale-replay 'unclosed"], "--hyscale-args"),
    ([TINY, "--stock-backend", "none", "--noise-ref", "none"], "refusing --noise-ref none: the stock run already uses"),
    ([TINY, "--stock-backend", "tilelang", "--noise-ref", "tilelang"], "must be stock with a DIFFERENT backend"),
    ([TINY, "--noise-ref", compare.stock_backend("auto")], "(--stock-backend auto)"),  # auto resolved first
    ([TINY, "--require-parity"], "refusing --require-parity without --noise-ref"),
    ([TINY, "--runs", "stock,bogus"], "choose from stock, hyscale"),
    ([TINY, "--runs", "stock_ref"], "stock_ref needs --noise-ref"),
    *[([TINY, "--noise-ref", "cudnn", "--noise-slack", v], "--noise-slack: must be a finite number > 0")
      for v in ("0", "-1", "nan", "inf", "x")],
])
def test_bad_command_is_one_line_and_runs_nothing(argv, msg, capsys, tmp_path, no_runs):
    assert compare.main(["--out", str(tmp_path / "out"), *argv]) == 2
    captured = capsys.readouterr()
    lines = error_lines(captured.err, "hyscale-compare")
    assert len(lines) == 1 and msg in lines[0], captured.err
    assert "Traceback" not in captured.err and "usage:" not in captured.err
    assert not (tmp_path / "out").exists(), "nothing may be written for a refused command"


def test_out_must_not_be_a_file(capsys, tmp_path, no_runs):
    path = tmp_path / "taken"
    path.write_text("x")
    assert compare.main(["--out", str(path), TINY]) == 2
    assert error_lines(capsys.readouterr().err, "hyscale-compare") == [
        f"hyscale-compare: --out {path} is an existing file; give a directory (it is created when missing)."]


def test_failed_run_is_one_line_with_its_log(tmp_path, capsys, monkeypatch):
    def failing(name, cmd, out, prog):
        (out / f"{name}.log").write_text("boom\n")
        return 1, 0.5, ["ValueError: boom\n"]

    monkeypatch.setattr(compare, "run_process", failing)
    out = tmp_path / "out"
    assert compare.main(["--out", str(out), TINY, "--iters", "2"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: boom" in err, "the log's last lines are shown"
    assert error_lines(err, "hyscale-compare") == [
        f"hyscale-compare: the stock run failed with exit code 1; full log: {out / 'stock.log'}"]
    assert "Traceback" not in err


def test_topk_not_smaller_than_the_sequence_is_noted_once(tmp_path, capsys, fake_runs):
    assert compare.main(["--out", str(tmp_path), TINY, "--iters", "3", "--dsa-indexer-topk", "100000"]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "note: --dsa-indexer-topk" in ln]
    assert notes == ["hyscale-compare: note: --dsa-indexer-topk 100000 is not smaller than --seq-length 256: every "
                     "query selects all of its causal keys (dense attention through the sparse path)"]


# ----------------------------------------------------------------------------- like for like
def test_allows_hyscale_settings_per_run():
    shared = compare.expand_arg_files([TINY])
    compare.check_like_for_like(shared, ["--hyscale-topk-impl", "reference", "--no-hyscale-replay"])


def test_commands_differ_only_in_spec_and_hyscale_flags(tmp_path):
    opts, rest = compare._parser().parse_known_args(["--iters", "3", TINY])
    cmds = compare.run_commands(opts, rest, tmp_path)
    assert list(cmds) == ["stock", "hyscale"]
    st, hs = cmds["stock"], cmds["hyscale"]
    assert st[1:3] == ["-m", "hyscale_megatron.tools.train"]
    common = [t for t in st if t in hs]
    assert [t for t in st if t not in common] == ["stock_block_spec", "--no-hyscale", "stock",
                                                  str(tmp_path / "stock.jsonl")]
    assert [t for t in hs if t not in common] == ["hyscale_block_spec", "--hyscale", "hyscale",
                                                  str(tmp_path / "hyscale.jsonl")]
    assert st[st.index("--dsa-kernel-backend") + 1] == hs[hs.index("--dsa-kernel-backend") + 1]


def test_noise_ref_command_is_stock_with_the_reference_backend(tmp_path):
    opts, rest = compare._parser().parse_known_args(["--iters", "3", "--stock-backend", "tilelang",
                                                     "--noise-ref", "none", "--launcher", "torchrun --nproc 2", TINY])
    cmds = compare.run_commands(opts, rest, tmp_path)
    assert list(cmds) == ["stock", "hyscale", "stock_ref"]
    st, ref = cmds["stock"], cmds["stock_ref"]
    assert st[:5] == ["torchrun", "--nproc", "2", "-m", "hyscale_megatron.tools.train"]
    assert len(ref) == len(st)
    assert [(a, b) for a, b in zip(st, ref) if a != b] == [
        ("tilelang", "none"), ("stock", "stock_ref"),
        (str(tmp_path / "stock.jsonl"), str(tmp_path / "stock_ref.jsonl"))]


# ----------------------------------------------------------------------------- outputs from the runs' metrics
def test_gpu_summary_leads_with_speedup_and_shows_the_command(tmp_path):
    recs = {"stock": fake_records("stock", 3, step_ms=20.0), "hyscale": fake_records("hyscale", 3, step_ms=10.0)}
    meta = dict(META_GPU, command="hyscale-compare --out o @configs/x.args --seq-length 97",
                config="@configs/x.args --seq-length 97 --train-iters 3")
    s = compare.write_outputs(tmp_path, recs, {"stock": 1.0, "hyscale": 1.0}, meta)
    assert s["speedup"] == pytest.approx(2.0) and s["memory_ratio"] == pytest.approx(0.5)
    assert s["max_rel_lm_loss_diff"] == 0.0 and s["max_abs_lm_loss_diff"] == 0.0
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[2] == "- command: `hyscale-compare --out o @configs/x.args --seq-length 97`"
    assert md[3] == "- training flags of both runs: `@configs/x.args --seq-length 97 --train-iters 3`"
    assert "- **speedup (stock / HyScale median step time): 2.00x**" in md
    assert not any("not meaningful" in ln for ln in md)
    title = compare.plot_title(s)
    assert "--seq-length 97" in title and "NVIDIA H200" in title
    rows = list(csv.DictReader(open(tmp_path / "iterations.csv")))
    assert list(rows[0]) == list(compare.CSV_FIELDS) and len(rows) == 6
    assert rows[0]["replay_store_bytes"] == "0" and rows[3]["replay_store_bytes"] == "4096"
    assert (tmp_path / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(RuntimeError, match="different iteration counts"):
        compare.write_outputs(tmp_path, {"stock": recs["stock"], "hyscale": recs["hyscale"][:2]}, {}, meta)


def test_cpu_summary_leads_with_the_losses_and_marks_timings(tmp_path):
    st, hs = fake_records("stock", 4, step_ms=5.0), fake_records("hyscale", 4, step_ms=10.0)
    hs[2]["lm_loss"] += 2e-5
    s = compare.write_outputs(tmp_path, {"stock": st, "hyscale": hs}, {}, META_CPU)
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[2].startswith("**Same losses: over 4 iterations the LM losses of HyScale and stock differ by at "
                            "most 2e-05 (relative 5.26e-06"), md[2]
    assert md[4] == compare.CPU_TIMING_NOTE and "not meaningful" in md[4]
    assert "| run | median step (ms, CPU: not meaningful) |" in "\n".join(md)
    assert "- step time stock / HyScale: 0.50x (CPU: not a speedup measurement)" in md
    assert not any("**speedup" in ln for ln in md)
    assert "CPU: not meaningful" in compare.step_panel_title(s)
    hs[2]["lm_loss"] += 1.0  # beyond fp32 agreement: the headline says so
    compare.write_outputs(tmp_path, {"stock": st, "hyscale": hs}, {}, META_CPU)
    assert (tmp_path / "summary.md").read_text().splitlines()[2].startswith("**Different losses:")


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
    assert hs["max_rel_lm_loss_diff"] == pytest.approx(0.05) and hs["max_abs_lm_loss_diff"] == pytest.approx(0.1)
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
    s = compare.write_outputs(tmp_path, {"stock": r["stock"], "hyscale": r["hyscale"]}, {}, META_GPU)
    assert s["loss_window"] == 2 and s["max_rel_windowed_lm_diff"] == pytest.approx(0.025)
    assert s["max_rel_windowed_indexer_diff"] == pytest.approx(0.05) and s["first_divergence_iter"] == 5
    assert "noise_ref" not in s and "parity" not in s
    md = (tmp_path / "summary.md").read_text()
    assert "bf16 noise:" not in md and "windowed" not in md and "| stock_ref" not in md


META_REF = dict(META_GPU, stock_backend="tilelang", noise_ref="none")


def test_noise_ref_summary_and_verdict(tmp_path):
    r = _noise_records()
    s = compare.write_outputs(tmp_path, r, {}, META_REF)  # slack 1.5: 0.025 > 1.5 x 0.015
    assert s["noise_ref"]["backend"] == "none" and s["noise_ref"]["run"] == "stock_ref"
    par = s["parity"]
    assert par["hyscale_vs_stock"]["max_rel_windowed_lm_diff"] == pytest.approx(0.025)
    assert par["stock_ref_vs_stock"]["first_divergence_iter"] == 11
    assert par["slack"] == 1.5 and par["bound"] == pytest.approx(0.0225) and par["window"] == 2
    assert par["within_noise"] is False
    assert par["hyscale_vs_stock_ref"] == compare.divergence(r["hyscale"], r["stock_ref"])
    md = (tmp_path / "summary.md").read_text()
    assert "## bf16 noise: reference `stock_ref` = stock with `--dsa-kernel-backend none`" in md
    assert "| hyscale vs stock | 0.05 | 0.025 | 0.05 | 5 |" in md
    assert "| stock_ref (none) vs stock | 0.015 | 0.015 | 0 | 11 |" in md
    assert "| hyscale vs stock_ref (none) (information) |" in md
    assert "**HyScale within bf16 noise: no** (windowed LM-loss divergence 0.025 > 1.5 x reference's 0.015)" in md
    assert "| stock_ref | 10.0 |" in md
    rows = list(csv.DictReader(open(tmp_path / "iterations.csv")))
    assert [r["run"] for r in rows] == ["stock"] * 20 + ["hyscale"] * 20 + ["stock_ref"] * 20
    assert rows[-1]["replay_store_bytes"] == "0"
    assert "within bf16 noise: no" in compare.plot_title(s)
    s = compare.write_outputs(tmp_path, r, {}, META_REF, noise_slack=2.0)  # 0.025 <= 2 x 0.015
    assert s["parity"]["within_noise"] is True
    assert "**HyScale within bf16 noise: yes** (windowed LM-loss divergence 0.025 <= 2 x reference's 0.015)" \
        in (tmp_path / "summary.md").read_text()


# ----------------------------------------------------------------------------- the command with its runs replaced
def test_meta_written_first_and_exit_codes(tmp_path, capsys, fake_runs, monkeypatch):
    out = tmp_path / "out"
    seen_meta = []
    real = fake_runs

    def spy(name, cmd, out_dir):
        seen_meta.append(json.loads((out_dir / "meta.json").read_text()))  # already there
        return real(name, cmd, out_dir)

    monkeypatch.setattr(compare, "run_one", spy)
    argv = ["--out", str(out), TINY, "--iters", "3", "--seq-length", "97", "--max-position-embeddings", "97"]
    assert compare.main(argv) == 0
    assert [name for name, _ in real.seen] == ["stock", "hyscale"]
    meta = seen_meta[0]
    assert meta["config"] == f"{TINY} --seq-length 97 --max-position-embeddings 97 --train-iters 3"
    assert meta["command"].startswith("hyscale-compare --out") and meta["argv"][1:3] == ["--seq-length", "97"]
    assert set(compare.META_KEYS) <= set(meta) and meta["noise_ref"] is None
    s = json.loads((out / "summary.json").read_text())
    assert s["speedup"] == pytest.approx(2.0) and s["runs"]["stock"]["wall_s"] == 1.5
    assert "--seq-length 97" in (out / "summary.md").read_text()
    assert compare.main([*argv, "--max-loss-rtol", "0"]) == 0
    real.records["hyscale"] = [dict(r, lm_loss=r["lm_loss"] * 1.01) for r in fake_records("hyscale", 3)]
    capsys.readouterr()
    assert compare.main([*argv, "--max-loss-rtol", "1e-4"]) == 3
    assert "exceeds --max-loss-rtol" in capsys.readouterr().err


def test_noise_ref_run_with_fake_runs(tmp_path, capsys, fake_runs):
    out = tmp_path / "out"
    fake_runs.records.update(_noise_records())
    base = ["--out", str(out), TINY, "--iters", "20", "--stock-backend", "tilelang", "--noise-ref", "none"]
    assert compare.main(base) == 0  # no --require-parity: the verdict is reported, not enforced
    assert [name for name, _ in fake_runs.seen] == ["stock", "hyscale", "stock_ref"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["noise_ref"] == "none" and meta["stock_backend"] == "tilelang"
    s = json.loads((out / "summary.json").read_text())
    assert s["runs"]["stock_ref"]["wall_s"] == 1.5 and s["parity"]["within_noise"] is False
    assert "HyScale within bf16 noise: no" in capsys.readouterr().out
    assert compare.main([*base, "--require-parity"]) == 3
    assert "HyScale is not within bf16 noise" in capsys.readouterr().err
    assert compare.main([*base, "--require-parity", "--noise-slack", "2"]) == 0


def test_runs_split_over_calls(tmp_path, capsys, fake_runs):
    """--runs trains a subset now and summarizes once every run's metrics file is in --out; other flags in
    a reused --out are refused."""
    out = tmp_path / "out"
    fake_runs.records.update(_noise_records())
    base = ["--out", str(out), TINY, "--iters", "20", "--stock-backend", "tilelang", "--noise-ref", "none"]
    assert compare.main([*base, "--runs", "stock,hyscale"]) == 0
    assert not (out / "summary.json").exists()
    assert "stock_ref still to run" in capsys.readouterr().out
    assert compare.main([*base, "--runs", "stock_ref"]) == 0
    assert [name for name, _ in fake_runs.seen] == ["stock", "hyscale", "stock_ref"]
    s = json.loads((out / "summary.json").read_text())
    assert set(s["runs"]) == {"stock", "hyscale", "stock_ref"} and "parity" in s
    capsys.readouterr()
    assert compare.main(["--out", str(out), TINY, "--iters", "30", "--stock-backend", "tilelang",
                         "--noise-ref", "none", "--runs", "stock_ref"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert len(fake_runs.seen) == 3, "nothing trained by the refused call"


# ----------------------------------------------------------------------------- --summarize-only
def test_summarize_only_rebuilds_outputs(tmp_path, capsys):
    out = tmp_path / "cut"
    st, hs = fake_records("stock", 4), fake_records("hyscale", 4)
    for rec, ms in zip(st, (100.0, 21.0, 19.0, 23.0)):  # first iteration (warm-up) excluded from the medians
        rec["step_ms"] = ms
    for rec, ms in zip(hs, (90.0, 11.0, 9.0, 10.0)):
        rec["step_ms"] = ms
    hs[2]["lm_loss"] *= 1 + 1e-6
    write_run(out, {"stock": st, "hyscale": hs})
    assert compare.main(["--out", str(out), "--summarize-only", "--max-loss-rtol", "1e-4"]) == 0
    printed = capsys.readouterr().out
    assert "# Stock DSA vs HyScale" in printed and f"wrote {out}/iterations.csv" in printed
    rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert [float(r["step_ms"]) for r in rows] == [100.0, 21.0, 19.0, 23.0, 90.0, 11.0, 9.0, 10.0]
    s = json.loads((out / "summary.json").read_text())
    assert s["speedup"] == pytest.approx(21.0 / 10.0)  # median(21, 19, 23) / median(11, 9, 10)
    assert s["runs"]["stock"]["wall_s"] is None and s["max_rel_lm_loss_diff"] == pytest.approx(1e-6, rel=1e-3)
    assert (out / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    assert compare.main(["--out", str(out), "--summarize-only", "--max-loss-rtol", "1e-7"]) == 3
    assert "exceeds --max-loss-rtol" in capsys.readouterr().err
    # shared flags, when given, are still checked like for like
    assert compare.main(["--out", str(out), "--summarize-only", TINY, "--no-hyscale"]) == 2
    assert "needs HyScale in one of the two runs" in capsys.readouterr().err


def test_summarize_only_meta_json_and_unequal_runs(tmp_path, capsys):
    out = tmp_path / "cut"
    write_run(out, {"stock": fake_records("stock", 5), "hyscale": fake_records("hyscale", 3)}, meta=None)
    assert compare.main(["--out", str(out), "--summarize-only"]) == 2
    lines = error_lines(capsys.readouterr().err, "hyscale-compare")
    assert len(lines) == 1 and str(out / "meta.json") in lines[0] and "write it by hand" in lines[0]
    assert not (out / "summary.md").exists()
    # a hand-written meta.json with only some keys is enough; unequal runs are cut to the shorter
    (out / "meta.json").write_text(json.dumps({"device": "cuda", "stock_backend": "tilelang"}))
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert "(stock 5, hyscale 3); both cut to the first 3" in capsys.readouterr().out
    md = (out / "summary.md").read_text()
    assert "training flags of both runs: `unknown`" in md and "both cut to the first 3" in md
    assert json.loads((out / "summary.json").read_text())["truncated"]["used"] == 3
    (out / "hyscale.jsonl").write_text("{not json\n")
    assert compare.main(["--out", str(out), "--summarize-only"]) == 2
    assert "not a metrics file" in capsys.readouterr().err


def test_summarize_only_stock_ref(tmp_path, capsys):
    out = tmp_path / "cut"
    r = _noise_records()
    write_run(out, r, meta=META_REF)
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["noise_ref"]["backend"] == "none" and s["parity"]["within_noise"] is False
    assert compare.main(["--out", str(out), "--summarize-only", "--require-parity"]) == 3
    assert compare.main(["--out", str(out), "--summarize-only", "--require-parity", "--noise-slack", "2"]) == 0
    capsys.readouterr()
    assert compare.main(["--out", str(out), "--summarize-only", "--noise-ref", "cudnn"]) == 2
    assert "contradicts" in capsys.readouterr().err
    write_run(out, {"stock_ref": r["stock_ref"][:15]}, meta=META_REF)  # a reference run cut short
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert "(stock 20, hyscale 20, stock_ref 15); all cut to the first 15" in capsys.readouterr().out
    # meta.json of a comparison without a reference run: a stock_ref.jsonl from another one is ignored ...
    write_run(out, r, meta=dict(META_GPU, noise_ref=None))
    assert compare.main(["--out", str(out), "--summarize-only"]) == 0
    assert "note: ignoring" in capsys.readouterr().out
    assert "parity" not in json.loads((out / "summary.json").read_text())
    # ... unless --noise-ref names its backend
    assert compare.main(["--out", str(out), "--summarize-only", "--noise-ref", "none"]) == 0
    assert json.loads((out / "summary.json").read_text())["noise_ref"]["backend"] == "none"
    # --require-parity / --noise-ref without the reference's metrics: exit 2
    (out / "stock_ref.jsonl").unlink()
    for extra in (["--require-parity"], ["--noise-ref", "none"]):
        assert compare.main(["--out", str(out), "--summarize-only", *extra]) == 2
        assert "stock_ref.jsonl" in capsys.readouterr().err


# ----------------------------------------------------------------------------- one real comparison on CPU
@pytest.fixture(scope="module")
def tiny_comparison(tmp_path_factory):
    """hyscale-compare on the tiny config, 3 iterations at 128 tokens: two real training subprocesses."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("tiny")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = compare.main(["--out", str(out), TINY, "--iters", "3", "--seq-length", "128",
                           "--max-position-embeddings", "128", "--max-loss-rtol", str(LM_RTOL)])
    return rc, out, printed.getvalue()


def test_tiny_comparison_trains_stock_and_hyscale_alike(tiny_comparison):
    rc, out, printed = tiny_comparison
    assert rc == 0, printed[-3000:]
    rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert [(r["run"], int(r["iteration"])) for r in rows] == [(run, i) for run in ("stock", "hyscale")
                                                               for i in (1, 2, 3)]
    by = {run: [r for r in rows if r["run"] == run] for run in ("stock", "hyscale")}
    for run, rs in by.items():
        for r in rs:
            for key in ("lm_loss", "indexer_loss", "step_ms", "tokens_per_s", "peak_mem_bytes"):
                assert math.isfinite(float(r[key])), (run, key, r[key])
        losses = [float(r["lm_loss"]) for r in rs]
        assert losses[-1] < losses[0], f"{run}: loss did not decrease: {losses}"
    for s, h in zip(by["stock"], by["hyscale"]):
        assert abs(float(h["lm_loss"]) - float(s["lm_loss"])) <= LM_RTOL * abs(float(s["lm_loss"]))
        assert abs(float(h["indexer_loss"]) - float(s["indexer_loss"])) <= 1e-2 * abs(float(s["indexer_loss"]))
    assert all(int(r["replay_store_bytes"]) == 0 for r in by["stock"])
    assert all(int(r["replay_store_bytes"]) > 0 for r in by["hyscale"]), "full recompute: HyScale replays"
    assert "DSA cores {'DSAttention': 2}" in (out / "stock.log").read_text()
    assert "DSA cores {'HyScaleDSAttention': 2}" in (out / "hyscale.log").read_text()


def test_tiny_comparison_output(tiny_comparison):
    rc, out, printed = tiny_comparison
    for run in ("stock", "hyscale"):  # progress is visible: Megatron-format iteration lines, echoed per run
        lines = [ln for ln in printed.splitlines() if ln.startswith(f"[{run}]") and "| lm loss:" in ln]
        assert len(lines) == 3 and "elapsed time per iteration (ms)" in lines[0] and "| indexer loss:" in lines[0]
    for name in ("summary.json", "stock.log", "hyscale.log", "meta.json"):
        assert (out / name).is_file(), name
    assert (out / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    md = (out / "summary.md").read_text()
    assert "--seq-length 128" in md and "| stock |" in md and "| hyscale |" in md
    if torch.cuda.is_available():
        assert "**speedup (stock / HyScale median step time):" in md
    else:
        assert md.splitlines()[2].startswith("**Same losses: over 3 iterations"), md
        assert "CPU timings are not meaningful" in md
        assert "[hyscale] building" not in printed, "CPU runs never compile Megatron's share_storage extension"
