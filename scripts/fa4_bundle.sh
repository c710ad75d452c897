#!/usr/bin/env bash
# Pack FlashAttention-4 and its dependencies for a GPU machine with no internet whose calls carry at most 64 MiB:
# the big nvidia-cutlass-dsl-libs-cu13 wheel (92 MB) travels as an xz tarball of its files in two halves.
#
#   bash scripts/fa4_bundle.sh            # here: fills .fa4/a (half 1) and .fa4/b (half 2 + small wheels), ~3 min
#   device call 1, carry [".fa4/a"]:      mkdir -p /tmp/fa4parts && cp .fa4/a/* /tmp/fa4parts/
#   device call 2, carry [".fa4/b"], within the machine's idle window:
#                                         bash scripts/fa4_bundle.sh install && export PYTHONPATH=$(bash scripts/fa4_bundle.sh path)
# Add `/.fa4/` to .git/info/exclude first. Versions: the ones docs/BENCHMARKS.md (session 7) measured.
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
  install)  # on the device, in call 2
    cat /tmp/fa4parts/cu13.tar.xz.aa .fa4/b/cu13.tar.xz.ab > /tmp/cu13.tar.xz
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .fa4/b/*.whl
    python3 -c "import tarfile, sys; tarfile.open('/tmp/cu13.tar.xz').extractall(sys.argv[1])" "$SITE"
    ;;
  path)  # what PYTHONPATH needs (the package's .pth file is not read from a --target folder)
    echo "$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
    ;;
esac
