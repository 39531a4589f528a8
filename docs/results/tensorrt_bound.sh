#!/usr/bin/env bash
# The TensorRT-bound ONNX of every shipped model: lint, and parity in ONNX Runtime on 200 inputs
# (the table in docs/tensorrt.md). Run from the repository root after `make install`.
set -u
A=$(realpath "${ADAPTEX:-.venv/bin/adaptex}")
cd "$(mktemp -d)"
echo "| model | variant | passed | max abs error | decision agreement | unexcused flips | samples | lint (10.0) |"
echo "|---|---|---|---|---|---|---|---|"
for m in budgetformer-graded tsa-charlm elastic-minilm charlm-dense elastic-charlm; do
  for v in sparse dense; do
    [ "$m" = charlm-dense ] && [ "$v" = dense ] && continue  # no adaptive op: one graph
    if ! "$A" export "$m" --target tensorrt --onnx-only --variant "$v" -o "$m.$v.onnx" > /dev/null 2>&1; then
      echo "| $m | $v | export failed | | | | | |"; continue
    fi
    lint=$("$A" lint "$m.$v.onnx" | tail -1 | sed 's/.*: //')
    "$A" check "$m.$v.onnx" --samples 200 --json 2>/dev/null | python3 -c "
import json, sys
r = json.load(sys.stdin)
print(f\"| $m | $v | {r['passed']} | {r['max_abs_err']:.2e} | {r['decision_agreement']:.4f} | {r['unexcused_flips']} | {r['samples']} | $lint |\")"
  done
done
