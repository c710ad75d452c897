#!/usr/bin/env bash
# Offline install of the [serve] extra and ray[serve] for an air-gapped GPU host (x86-64, Python 3.12), so that
# `flashvlm serve`, `flashvlm serve --ray` and `flashvlm bench serve` run there: download the wheels on a machine
# with internet, carry them over in parts of at most LIMIT bytes (default 28,000,000: the link moves 64 MiB per
# transfer, the repository's tree of about 34 MB included), install them there into a folder on PYTHONPATH. Only
# what the host's image lacks travels (HOST below); the ray wheel (79 MB) travels split across parts.
#
#   bash scripts/serve_bundle.sh            # with internet, in the repository: fills .serve/p1, .serve/p2, ...
#                                           # and checks that the wheels plus HOST close every requirement
#   then on the GPU host, in a copy of the repository, one call per part, in order (/tmp there lasts between
#   calls only while they follow each other closely):
#     bash scripts/serve_bundle.sh install .serve/p1      # ... up to the last part, which joins the ray wheel,
#                                                         # checks every wheel's sha256 and installs them all
#     export PYTHONPATH=$PWD:$(bash scripts/serve_bundle.sh path)
#
# Versions: pyproject.toml's [serve] ranges and ray[serve]==2.60.0 (inside the [ray] extra's range), as pip picks
# them for CPython 3.12 on manylinux x86-64. .serve/ stays out of git (.gitignore). KEEP="name ..." carries host
# packages too, for when the install's check says the host's version doesn't fit (default "aiohttp grpcio": ray
# 2.60 needs aiohttp>=3.14.4 and, through grpcio-reflection, grpcio>=1.85.1; the host has 3.14.3 and 1.84.0).
# CHECK=0 skips the install's version check and imports (for a dry run of `install` on another Python).
set -euo pipefail
OUTDIR=.serve DL=/tmp/servedl PARTS=/tmp/serveparts SITE=/tmp/servesite LIMIT=${LIMIT:-28000000} RAY='ray[serve]==2.60.0'
KEEP=${KEEP-aiohttp grpcio}
# The GPU host image's own packages (its documented list); their versions there: `pip show NAME`.
HOST="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp"

# check MODE WHEEL_DIR ROOT...: walks the requirements from ROOT through the wheels in WHEEL_DIR (their METADATA,
# markers read for CPython 3.12 on Linux x86-64, extras followed); each one must be a wheel there of a fitting
# version, or else (MODE bundle) named in HOST, or (MODE host) installed here in a fitting version.
check() {
  HOST="$HOST" KEEP="$KEEP" python3 - "$@" <<'EOF'
import importlib.metadata as md
import os
import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

mode, wheel_dir, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
host = {canonicalize_name(n) for n in os.environ["HOST"].split()} - {
    canonicalize_name(n) for n in os.environ["KEEP"].split()}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_version": "3.12.3",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "platform_release": "", "platform_version": ""}
wheels = {}
for f in sorted(os.listdir(wheel_dir)):
    if f.endswith(".whl"):
        name, version = f.split("-")[:2]
        wheels[canonicalize_name(name)] = (os.path.join(wheel_dir, f), version)


def requires(path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.split("\n\n")[0].splitlines()
            if line.startswith("Requires-Dist:")]


todo = [(Requirement(r), "the roots") for r in roots]
seen, problems, from_host = set(), [], {}
while todo:
    req, parent = todo.pop()
    name = canonicalize_name(req.name)
    if name in wheels:
        path, version = wheels[name]
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{parent} needs {req}; the bundled {name} is {version}")
        for extra in {"", *req.extras}:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            todo += [(r, name) for r in requires(path)
                     if r.marker is None or r.marker.evaluate({**env, "extra": extra})]
    elif mode == "bundle" and name in host:
        from_host.setdefault(name, set()).add(f"{req.specifier or 'any'} ({parent})")
    elif mode == "host":
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{parent} needs {req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{parent} needs {req}; installed {version}")
    else:
        problems.append(f"{parent} needs {req}: neither bundled nor on the host (HOST)")
if mode == "bundle":
    print("bundled:", " ".join(f"{n}=={v}" for n, (_, v) in wheels.items()))
    print("from the host:", "; ".join(f"{n} {', '.join(sorted(s))}" for n, s in sorted(from_host.items())))
unused = sorted(set(wheels) - {n for n, _ in seen})
if unused:
    print("bundled but required by nothing:", " ".join(unused))
if problems:
    sys.exit("MISSING OR MISMATCHED:\n  " + "\n  ".join(sorted(set(problems))))
print(f"closure complete ({mode}): {len(wheels)} wheels, {len(seen)} (package, extra) pairs walked")
EOF
}

case "${1:-bundle}" in
  bundle)
    mapfile -t ROOTS < <(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))
      ["project"]["optional-dependencies"]["serve"]))')
    ROOTS+=("$RAY")
    rm -rf "$OUTDIR" "$DL" && mkdir -p "$OUTDIR" "$DL/all" "$DL/host" "$DL/pieces"
    # This machine's pip config lists local indexes that lack most names: drop its "is ignored" warnings.
    { python3 -m pip download -q --python-version 3.12 --implementation cp --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform manylinux_2_5_x86_64 --platform linux_x86_64 -d "$DL/all" "${ROOTS[@]}" 2>&1; } \
      | { grep -v "^WARNING: Location '.*' is ignored" || true; }
    # What the host has stays behind (the check below proves the rest closes the requirements).
    norm() { tr '[:upper:]_.' '[:lower:]--' <<< " $* "; }  # names as " a b c ", canonical
    host=$(norm "${HOST//$'\n'/ }") keep=$(norm "$KEEP")
    for w in "$DL"/all/*.whl; do
      n=$(basename "$w" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')
      if [[ $host == *" $n "* && $keep != *" $n "* ]]; then mv "$w" "$DL/host/"; fi
    done
    echo "left to the host: $(find "$DL/host" -name '*.whl' -printf '%f\n' | sort | cut -d- -f1-2 | tr '\n' ' ')"
    check bundle "$DL/all" "${ROOTS[@]}"
    ray=$(ls "$DL"/all/ray-*.whl)
    split -b $((LIMIT - 100000)) -a 2 "$ray" "$DL/pieces/ray.whl."  # 100 kB left for each part's MANIFEST
    python3 - "$DL/all" "$DL/pieces" "$OUTDIR" "$LIMIT" "$(basename "$ray")" "${ROOTS[@]}" <<'EOF'
import hashlib
import os
import shutil
import sys

wheels, pieces, out, limit, ray, roots = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], \
    sys.argv[6:]
size = os.path.getsize
parts = [[os.path.join(pieces, p)] for p in sorted(os.listdir(pieces))]
small = sorted((os.path.join(wheels, w) for w in os.listdir(wheels) if w != ray), key=size, reverse=True)
for w in small:  # first fit, biggest first
    part = next((p for p in parts if sum(map(size, p)) + size(w) <= limit - 100000), None)
    if part is None:
        parts.append(part := [])
    part.append(w)
sums = []
for w in sorted(os.listdir(wheels)):
    with open(os.path.join(wheels, w), "rb") as f:
        sums.append(f"{hashlib.file_digest(f, 'sha256').hexdigest()}  {w}")
join = f"join {ray} " + " ".join(sorted(os.listdir(pieces)))
for k, files in enumerate(parts, 1):
    d = os.path.join(out, f"p{k}")
    os.makedirs(d)
    for f in files:
        shutil.copy(f, d)
    with open(os.path.join(d, "MANIFEST"), "w") as f:
        f.write("\n".join([f"part {k} of {len(parts)}", join, "roots " + " ".join(roots), *sums]) + "\n")
    total = sum(size(os.path.join(d, f)) for f in os.listdir(d))
    assert total <= limit, (d, total)
    print(f"{d}: {total} bytes, {len(os.listdir(d))} files")
EOF
    ;;
  install)  # on the GPU host: bash scripts/serve_bundle.sh install .serve/pK, K = 1, 2, ... in order
    src=${2:?usage: serve_bundle.sh install PART_DIR}
    read -r _ k _ n < "$src/MANIFEST"
    if [ "$k" = 1 ]; then rm -rf "$PARTS"; fi
    mkdir -p "$PARTS"
    for f in "$src"/*; do [ "$(basename "$f")" = MANIFEST ] || cp "$f" "$PARTS/"; done
    cp "$src/MANIFEST" "$PARTS/MANIFEST.$k"
    if ! cmp -s <(tail -n +2 "$PARTS/MANIFEST.1" 2>/dev/null) <(tail -n +2 "$src/MANIFEST"); then
      echo "part $k of $n is not from the bundle whose part 1 is in $PARTS (install part 1 first)" >&2; exit 1
    fi
    got=$(find "$PARTS" -maxdepth 1 -name 'MANIFEST.*' | wc -l)
    if [ "$got" -lt "$n" ]; then echo "part $k of $n in $PARTS; next: part $((k + 1))"; exit 0; fi
    read -r _ ray pieces < <(sed -n 2p "$PARTS/MANIFEST.1")
    read -ra roots < <(sed -n 3p "$PARTS/MANIFEST.1" | cut -d' ' -f2-)
    (cd "$PARTS" && read -ra p <<< "$pieces" && cat "${p[@]}" > "$ray" && rm "${p[@]}")
    (cd "$PARTS" && grep -E '^[0-9a-f]{64}  ' MANIFEST.1 | sha256sum -c --quiet --strict)
    echo "all $n parts in, sha256 of every wheel checked"
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$PARTS"/*.whl
    if [ "${CHECK:-1}" != 0 ]; then
      PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" check host "$PARTS" "${roots[@]}"
      PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import fastapi, uvicorn, pydantic, ray, ray.serve'
    fi
    echo "installed into $SITE"
    ;;
  path)  # what PYTHONPATH needs (with the repository's own folder before it)
    echo "$SITE"
    ;;
  *) echo "usage: serve_bundle.sh [bundle | install PART_DIR | path]" >&2; exit 2 ;;
esac
