# Sourced by bench/suite.sh on a GPU machine without megatron installed: unpacks the carried stock Megatron +
# TileLang bundle (.whl-tl, from ../shared/tools/stock-tilelang-bundle.sh) into /tmp/site, seeds TileLang's
# kernel cache from .tlcache when present, and exposes kernels/ and patches/ under their package names.
if [ -f .whl-tl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl-tl/site.tar.xz
  ln -sfn "$PWD/kernels" /tmp/site/hyscale_kernels && ln -sfn "$PWD/patches" /tmp/site/hyscale_patches
  export PYTHONPATH=/tmp/site:$PWD
fi
[ -d .tlcache ] && mkdir -p /tmp/tlcache && cp -r .tlcache/. /tmp/tlcache/
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache} PYTHONUNBUFFERED=1
export HYSCALE_TEST_INSTAFAIL=1  # tests/_instafail.py: a failing test is reported when it fails (runs have a time limit)
