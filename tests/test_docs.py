"""The README says what the code does: its configuration table is the config's, its Python example runs as
written, and every repository path it names exists."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_config_table_is_current():
    from hyscale_megatron.config import config_table_markdown

    assert config_table_markdown() in README, "README's configuration table differs from config_table_markdown()"


def test_python_example_runs_as_written():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no Python example"
    env = dict(os.environ, TRITON_INTERPRET="0")  # a user's CPU: the PyTorch references
    for code in blocks:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"README example failed:\n{code}\n{r.stderr[-3000:]}"


def test_named_paths_exist():
    names = set(re.findall(r"(?<![\w/.-])((?:bench|docs|configs|examples|scripts|tests|kernels|patches|"
                           r"hyscale_megatron)/[\w./-]+\w)", README))
    missing = sorted(n for n in names if not os.path.exists(os.path.join(ROOT, n)))
    assert not missing, f"README names paths that do not exist: {missing}"
