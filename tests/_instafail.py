"""pytest plugin (loaded by conftest.py): with HYSCALE_TEST_INSTAFAIL=1 a failing test's report is written to stderr
as soon as it fails, not only in the end-of-run summary. Device calls run under a hard time limit (bench/device_env.sh
sets the variable): a run cut off by it never reaches the summary, so its failures would be lost."""

from __future__ import annotations

import os
import sys


def pytest_runtest_logreport(report):
    if report.failed and os.environ.get("HYSCALE_TEST_INSTAFAIL") == "1":
        sys.stderr.write(f"\n[instafail] {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()
