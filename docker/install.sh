#!/bin/sh
# The one install step of both images: a fresh virtual environment with batchpilot and one extra.
#
#   sh docker/install.sh operator|runtime VENV_DIR      (run from the source root)
#
# Runtime only: VARIANT=cpu|cuda picks the torch build; TORCH_VERSION pins it. TORCH_INDEX_URL
# overrides the index torch comes from (set it empty to use pip's own configuration, e.g. a local
# wheel directory, as tests/deploy/test_docker.py does).
set -eu

target=${1:?usage: install.sh operator|runtime VENV_DIR}
venv=${2:?usage: install.sh operator|runtime VENV_DIR}
variant=${VARIANT:-cpu}
torch_version=${TORCH_VERSION:-2.13.0}

python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
# No bytecode at install time: the images run with PYTHONDONTWRITEBYTECODE and a read-only root,
# and compiling every module of torch would only make the image larger. (The images also set
# PIP_NO_CACHE_DIR; a test run keeps pip's cache so that a second run installs from it.)
opts="--no-compile"

case "$target" in
  operator)
    $pip install $opts ".[operator]"
    ;;
  runtime)
    case "$variant" in
      # The CPU wheel is a fraction of the size of the default (CUDA) one.
      cpu) default_index=https://download.pytorch.org/whl/cpu ;;
      # PyPI's Linux torch wheel is the CUDA build; it brings its CUDA libraries as packages,
      # so the base image needs no CUDA toolkit, only the driver the node provides.
      cuda) default_index=https://pypi.org/simple ;;
      *) echo "install.sh: VARIANT must be cpu or cuda, got '$variant'" >&2; exit 2 ;;
    esac
    index=${TORCH_INDEX_URL-$default_index}
    if [ -n "$index" ]; then
      $pip install $opts --index-url "$index" "torch==$torch_version"
    else
      $pip install $opts "torch==$torch_version"
    fi
    # torch is already there at the pinned version, so the extra's looser torch range pulls nothing more.
    # The model extra reads GGUF checkpoints (--checkpoint FILE.gguf, mounted like any checkpoint).
    $pip install $opts ".[runtime,model]"
    ;;
  *)
    echo "install.sh: target must be operator or runtime, got '$target'" >&2
    exit 2
    ;;
esac
"$venv/bin/python" -m pip check
