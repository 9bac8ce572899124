# Sourced by the device-call scripts (bench/*_session*.sh): unpacks the carried stock Megatron + TileLang
# bundle (.whl-tl, from ../shared/tools/stock-tilelang-bundle.sh) into /tmp/site, seeds TileLang's
# kernel cache from .tlcache when carried, and exposes kernels/ and patches/ under their package names.
mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl-tl/site.tar.xz
[ -d .tlcache ] && mkdir -p /tmp/tlcache && cp -r .tlcache/. /tmp/tlcache/
ln -sfn "$PWD/kernels" /tmp/site/hyscale_kernels && ln -sfn "$PWD/patches" /tmp/site/hyscale_patches
export PYTHONPATH=/tmp/site:$PWD TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1
export HYSCALE_TEST_INSTAFAIL=1  # tests/_instafail.py: a failing test reported when it fails (calls have a hard limit)
