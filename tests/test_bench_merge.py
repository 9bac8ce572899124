"""bench/merge_results.py: GPU runs' CSVs (CRLF line ends) append to a repo results CSV with a commit column, row by
row; a header mismatch is refused."""

from __future__ import annotations

import csv
import importlib.util
import pathlib

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _merge():
    spec = importlib.util.spec_from_file_location("merge_results", _ROOT / "bench" / "merge_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_merge_crlf_rows_stay_whole(tmp_path):
    src, dst = tmp_path / "dev.csv", tmp_path / "repo.csv"
    with open(src, "w", newline="") as f:  # the csv module's default: \r\n
        w = csv.writer(f)
        w.writerow(["date", "shape", "note"])
        w.writerow(["2026-12-06", "profile default", 'a "quoted", note'])
        w.writerow(["2026-12-06", "profile x", "multi\nline"])
    dst.write_text("date,shape,note,commit\n2026-12-05,DSA H64,old,abc0000\n")
    assert _merge()([str(src), str(dst), "--commit", "1234567"]) == 0
    rows = list(csv.reader(open(dst, newline="")))
    assert [len(r) for r in rows] == [4, 4, 4, 4]
    assert rows[2] == ["2026-12-06", "profile default", 'a "quoted", note', "1234567"]
    assert rows[3][2] == "multi\nline" and rows[3][3] == "1234567"
    assert b"\r" not in dst.read_bytes()


def test_merge_refuses_other_header(tmp_path):
    src, dst = tmp_path / "dev.csv", tmp_path / "repo.csv"
    src.write_text("date,impl\n2026-12-06,hytopk\n")
    dst.write_text("date,shape,commit\n")
    with pytest.raises(SystemExit, match="header"):
        _merge()([str(src), str(dst), "--commit", "1234567"])
