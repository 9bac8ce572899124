#!/usr/bin/env bash
# Create a Python 3.12 virtualenv with hyscale-megatron installed editable plus test extras.
#   bash scripts/setup.sh           .venv         the pinned versions (constraints.txt: the oldest supported)
#   bash scripts/setup.sh --latest  .venv-latest  the newest supported releases (constraints-latest.txt)
# Idempotent: a second run only re-installs the project itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
CONSTRAINTS=constraints.txt
case "${1:-}" in
  "") ;;
  --latest) VENV=.venv-latest; CONSTRAINTS=constraints-latest.txt ;;
  *) echo "usage: bash scripts/setup.sh [--latest]" >&2; exit 2 ;;
esac

find_python() {
  for cand in "${HYSCALE_PYTHON:-}" python3.12; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$cand"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V | tail -n 1)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return; fi
  fi
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  echo "error: Python 3.12 not found (megatron-core 0.19 needs it); set HYSCALE_PYTHON=/path/to/python3.12" >&2
  exit 1
}

# A new .venv takes ~5 GB (torch's CUDA build and its libraries) plus pip's downloads: fail early with
# a clear message instead of pip's "[Errno 28] No space left on device" half way through.
need_disk() {
  local dir="$1" need_gb="$2" free_kb
  free_kb=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "error: setup needs ~${need_gb} GB free in $dir, only $((free_kb / 1024)) MB left" \
         "(free some space, or point TMPDIR / PIP_CACHE_DIR elsewhere)" >&2
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  need_disk . 6
  need_disk "${TMPDIR:-/tmp}" 1
  PY=$(find_python)
  echo "setup: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e ".[test]"
"$VENV/bin/python" -c "import torch, triton, megatron.core, hyscale_megatron; print('setup: ok ($VENV): torch', torch.__version__, '| triton', triton.__version__, '| megatron-core', getattr(megatron.core, '__version__', '?'))"
