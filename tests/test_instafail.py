"""tests/_instafail.py: a failure's report reaches stderr while the run goes on (HYSCALE_TEST_INSTAFAIL=1), and
nothing is written without the variable."""

from __future__ import annotations

pytest_plugins = ["pytester"]

_TESTS = """
def test_fails():
    assert 1 + 1 == 3, "instafail-marker"

def test_passes():
    pass
"""


def _run(pytester, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("HYSCALE_TEST_INSTAFAIL", raising=False)
    else:
        monkeypatch.setenv("HYSCALE_TEST_INSTAFAIL", value)
    pytester.makepyfile(test_inner=_TESTS)
    res = pytester.runpytest("-p", "_instafail", "-q", "--no-summary")
    res.assert_outcomes(failed=1, passed=1)
    return res


def test_failure_reported_at_once(pytester, monkeypatch, capsys):
    res = _run(pytester, monkeypatch, "1")
    err = capsys.readouterr().err + "\n".join(res.errlines)
    assert "[instafail] test_inner.py::test_fails (call)" in err
    assert "instafail-marker" in err
    assert "test_passes" not in err


def test_silent_without_the_variable(pytester, monkeypatch, capsys):
    res = _run(pytester, monkeypatch, None)
    assert "[instafail]" not in capsys.readouterr().err + "\n".join(res.errlines)
