#!/usr/bin/env bash
# The vLLM end-to-end proof on the GPU box, in one command (after the bundle parts p0, p1
# were copied to /tmp/parts by earlier commands; p2 and p3 travel with this one):
#   install the slim vLLM 0.26.0 bundle (../shared/device), install this package (so vLLM
#   finds the plugin's entry point), run bench/e2e_vllm.py. Everything lands in $OUT.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
T0=$SECONDS
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  mkdir -p /tmp/parts
  for p in .devbundle/p*; do cp "$p"/* /tmp/parts/ 2>/dev/null; done
  ls -la /tmp/parts > "$OUT/parts.txt"
  if ! (cd /tmp/parts && SKIP_SMOKE=1 bash install.sh) > "$OUT/install.log" 2>&1; then
    tail -30 "$OUT/install.log"; exit 1
  fi
fi
echo "install: $((SECONDS - T0)) s"
export PYTHONPATH="/tmp/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
export XDG_CACHE_HOME=/tmp/ec-cache
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 \
  || echo "pip install -e . failed (the bench registers the plugin by hand)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
  2>&1 | tail -1 | tee -a "$OUT/env.txt"
LEFT=$(( ${E2E_SECONDS:-560} - (SECONDS - T0) ))
timeout "$LEFT" python3 bench/e2e_vllm.py --out "$OUT" --budget-s $((LEFT - 40)) \
  --arm-timeout-s "${ARM_TIMEOUT:-240}" "$@" 2>&1 | tail -80
# few files come back from the device: everything else travels in one archive
tar czf /tmp/e2e.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.md -delete \
  && mv /tmp/e2e.tgz "$OUT/"
