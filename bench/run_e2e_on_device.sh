#!/usr/bin/env bash
# The vLLM end-to-end proof on the GPU box, in one command (after the bundle parts p0, p1
# were copied to /tmp/parts by earlier commands; p2 and p3 travel with this one):
#   install the slim vLLM 0.26.0 bundle (.devbundle/, see bench/_device_vllm.sh), install this package (so vLLM
#   finds the plugin's entry point), run bench/e2e_vllm.py. Everything lands in $OUT.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
T0=$SECONDS
source bench/_device_vllm.sh
device_vllm_setup
case $? in
  1) exit 1 ;;
  2) echo "pip install -e . failed (the bench registers the plugin by hand)" ;;
esac
LEFT=$(( ${E2E_SECONDS:-560} - (SECONDS - T0) ))
timeout "$LEFT" python3 bench/e2e_vllm.py --out "$OUT" --budget-s $((LEFT - 40)) \
  --arm-timeout-s "${ARM_TIMEOUT:-240}" "$@" 2>&1 | tail -80
# few files come back from the device: everything else travels in one archive
tar czf /tmp/e2e.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.md -delete \
  && mv /tmp/e2e.tgz "$OUT/"
