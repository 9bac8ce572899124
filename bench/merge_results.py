"""Append a GPU run's CSV (written with the csv module's CRLF line ends, no commit column) to a repo results CSV
that has a trailing "commit" column: `python3 bench/merge_results.py SRC DST [--commit HASH]` (default: git's short
HEAD). Rows are re-written field by field, so a CR at a line end never ends up inside a row (appending ",commit"
to each text line would put it after the CR and split the row in two)."""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--commit", default=None, help="value of the commit column (default: git rev-parse --short HEAD)")
    a = p.parse_args(argv)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True).stdout.strip()
    with open(a.dst, newline="") as f:
        head = next(csv.reader(f))
    with open(a.src, newline="") as f:
        rd = csv.reader(f)
        src_head = next(rd)
        rows = list(rd)
    if head[-1] != "commit" or src_head != head[:-1]:
        sys.exit(f"merge_results: {a.src}'s header must be {a.dst}'s without its last column 'commit'; got "
                 f"{src_head} vs {head}")
    bad = [i for i, r in enumerate(rows, 2) if len(r) != len(src_head)]
    if bad:
        sys.exit(f"merge_results: {a.src} lines {bad[:5]} have a field count other than {len(src_head)}")
    with open(a.dst, "a", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        for r in rows:
            w.writerow(r + [commit])
    print(f"merge_results: {len(rows)} rows -> {a.dst} (commit {commit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
