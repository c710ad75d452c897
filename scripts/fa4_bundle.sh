#!/usr/bin/env bash
# Offline install of FlashAttention-4 for an air-gapped GPU host (x86-64, Python 3.12, CUDA 13): download the
# wheels on a machine with internet, copy them over, install them there into a folder on PYTHONPATH. For links
# that move at most 64 MiB per transfer, the big nvidia-cutlass-dsl-libs-cu13 wheel (92 MB) travels as an xz
# tarball of its files in two halves.
#
#   bash scripts/fa4_bundle.sh        # with internet, in the repository: fills .fa4/a (half 1) and .fa4/b
#                                     # (half 2 + the small wheels), ~3 min
#   then on the GPU host, in a copy of the repository:
#     1. copy .fa4/a's files to /tmp/fa4parts/ there
#     2. copy .fa4/b into the repository there, then
#        bash scripts/fa4_bundle.sh install && export PYTHONPATH=$(bash scripts/fa4_bundle.sh path)
# Versions: the ones docs/BENCHMARKS.md measured (pyproject.toml's [fa4] extra). Keep .fa4/ out of git.
set -euo pipefail
FA4=flash-attn-4==4.0.0b36 DSL=4.8.1 SITE=/tmp/fa4site
case "${1:-bundle}" in
  bundle)
    P=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps --platform manylinux_2_28_x86_64
       --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64)
    rm -rf .fa4 /tmp/fa4dl && mkdir -p .fa4/a .fa4/b /tmp/fa4dl/cu13
    python3 -m pip download -q --pre "${P[@]}" -d .fa4/b "$FA4" "nvidia-cutlass-dsl==$DSL" \
      "nvidia-cutlass-dsl-libs-base==$DSL" "nvidia-cutlass-dsl-libs-core==$DSL" apache-tvm-ffi==0.1.15.post2 \
      torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
    python3 -m pip download -q "${P[@]}" -d /tmp/fa4dl "nvidia-cutlass-dsl-libs-cu13==$DSL"
    (cd /tmp/fa4dl/cu13 && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl && tar cf - . | xz -9e -T2 > ../cu13.tar.xz)
    split -b 31800000 /tmp/fa4dl/cu13.tar.xz /tmp/fa4dl/cu13.tar.xz.
    mv /tmp/fa4dl/cu13.tar.xz.aa .fa4/a/ && mv /tmp/fa4dl/cu13.tar.xz.ab .fa4/b/
    du -sh .fa4/a .fa4/b
    ;;
  install)  # on the GPU host
    cat /tmp/fa4parts/cu13.tar.xz.aa .fa4/b/cu13.tar.xz.ab > /tmp/cu13.tar.xz
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .fa4/b/*.whl
    python3 -c "import tarfile, sys; tarfile.open('/tmp/cu13.tar.xz').extractall(sys.argv[1])" "$SITE"
    ;;
  path)  # what PYTHONPATH needs (the package's .pth file is not read from a --target folder)
    echo "$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
    ;;
esac
