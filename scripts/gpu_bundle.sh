#!/usr/bin/env bash
# Build the folder to bring to a bare GPU machine for scripts/gpu_check_bare.py, and check that it fits.
#
# The machine (the borrowed H200: Python 3.12 with torch, transformers 5.17, accelerate, peft, pandas, pyarrow
# preinstalled, no network, at most 64 MiB brought in) lacks a few wheels the check imports; they are listed
# once, in gpu_check_bare.py's BUNDLE, and downloaded here at the versions installed in the pipeline's venv
# (the project's pins): transformers (the image's 5.17 predates the `cache=` keyword the library passes), trl,
# datasets, dill, multiprocess. The bundle:
#   OUT/wheels/*.whl                 the wheels (pip download --no-deps --only-binary=:all: --python-version 3.12)
#   OUT/src/tandem/, OUT/src/scripts/gpu_check_bare.py    the library and the check, from this source tree
#   OUT/run.sh                       on the machine: installs the wheels into a private folder (--target, so the
#                                    image's own packages stay as they are) and runs the check from src/
# It prints the bundle's size and refuses (exit 1) when it is over 64 MiB; it also prints what the device tool
# would send (this checkout's tracked and untracked-not-ignored files plus the bundle, 64 MiB in all).
#
# Usage: scripts/gpu_bundle.sh [OUT]     (default .whl/gpu-bundle, ignored by git)
#   then, on the machine:  bash OUT/run.sh            (writes OUT/results/gpu_check_bare.json, or $OUT/ when set)
#   with the device tool:  run(command="bash .whl/gpu-bundle/run.sh", carry=[".whl/gpu-bundle"], timeout_s=600)
#   a dry run of the bundle here (CPU): bash OUT/run.sh --dry   (needs a Python 3.12 with torch: PYTHON=...)
# PYTHON=... names the pipeline's Python (default .venv/bin/python); PyPI must be reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.whl/gpu-bundle}
LIMIT_MIB=64

mapfile -t pins < <("$PY" scripts/gpu_check_bare.py --bundle-list)
[ "${#pins[@]}" -gt 0 ] || { echo "gpu_bundle: no wheels listed by gpu_check_bare.py --bundle-list" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/src"
echo "gpu_bundle: downloading ${pins[*]} (Python 3.12, manylinux x86_64)"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$OUT/wheels" "${pins[@]}"
tar --exclude=__pycache__ --exclude='*.pyc' -cf - tandem scripts/gpu_check_bare.py | tar -xf - -C "$OUT/src"

cat > "$OUT/run.sh" <<'EOF'
#!/usr/bin/env bash
# On the bare GPU machine: the bundled wheels go into a private folder first on PYTHONPATH (the image's own
# packages stay installed and serve everything else), then the check runs from the bundled source.
# Usage: bash run.sh [--dry] [--out DIR]   (results: $OUT/gpu_check_bare.json when OUT is set, else results/)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$site" "$here"/wheels/*.whl || { echo "run.sh: installing the bundled wheels failed" >&2; exit 3; }
export PYTHONPATH="$site:$here/src" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" "$here/src/scripts/gpu_check_bare.py" --out "${OUT:-$here/results}" "$@"
EOF
chmod +x "$OUT/run.sh"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
wheels=$(du -cb "$OUT"/wheels/*.whl | tail -1 | cut -f1)
total=$(du -sb "$OUT" | cut -f1)
echo "gpu_bundle: wheels:"
for w in "$OUT"/wheels/*.whl; do printf '  %8s MiB  %s\n' "$(mib "$(stat -c %s "$w")")" "$(basename "$w")"; done
echo "gpu_bundle: $OUT is $(mib "$total") MiB (wheels $(mib "$wheels") MiB, source $(mib $((total - wheels))) MiB), limit ${LIMIT_MIB} MiB"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
  echo "gpu_bundle: with the device tool the checkout travels too: $(mib "$tree") MiB + bundle $(mib "$total") MiB = $(mib $((tree + total))) MiB of ${LIMIT_MIB} MiB"
  [ $((tree + total)) -le $((LIMIT_MIB * 1048576)) ] || echo "gpu_bundle: warning: over the device tool's limit; carry only $OUT/wheels and $OUT/run.sh, or ignore more of the checkout" >&2
fi
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_bundle: refused: the bundle is over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
echo "gpu_bundle: on the machine: bash $OUT/run.sh      (device tool: run(command=\"bash $OUT/run.sh\", carry=[\"$OUT\"], timeout_s=600))"
