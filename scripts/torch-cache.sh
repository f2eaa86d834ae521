#!/usr/bin/env bash
# Install torch==VERSION once per machine into CACHE_DIR (outside any clone) and link it into the
# virtual environment of PYTHON with a .pth file.
#
# PyPI's torch build carries its CUDA libraries (about 4 GB installed), even where it only runs on
# the CPU; a copy in every clone's .venv fills a disk that CI clones a fresh checkout on. The cache
# is built in a temporary folder and renamed into place when complete, under a lock, so that two
# setups at once neither build it twice nor see half of it.
#
# usage: scripts/torch-cache.sh PYTHON VERSION CACHE_DIR
set -euo pipefail
python=$1 version=$2 cache=$3

mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
if [ ! -f "$cache/.complete" ]; then
  echo "torch-cache: installing torch==$version into $cache (once per machine; several GB from PyPI)"
  start=$(date +%s)
  rm -rf "$cache.partial"
  "$python" -m pip install --quiet --no-warn-script-location --target "$cache.partial" "torch==$version"
  touch "$cache.partial/.complete"
  rm -rf "$cache"
  mv "$cache.partial" "$cache"
  echo "torch-cache: done in $(( $(date +%s) - start )) s"
fi
flock -u 9

site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Appended after the venv's own site-packages: a package the project pins newer than torch's copy
# (installed into the venv by pip) wins over the cached one.
echo "$cache" >"$site/batchpilot_torch_cache.pth"
"$python" -c "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__" \
  || { echo "torch-cache: torch $version from $cache does not import; remove $cache and run again" >&2; exit 1; }
