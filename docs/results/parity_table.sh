#!/usr/bin/env bash
# Parity of every shipped model's artifacts for one target: `adaptex check` on 200 generated inputs
# (batches of 1 to 16, every length, a decoder's prefill and decode steps), one table row each.
#   bash docs/results/parity_table.sh onnx       # default export and --softmax-floor off, each run
#                                               # as adaptex runs it (a session per program) and
#                                               # as an app does (--one-session); the dense variant
#   bash docs/results/parity_table.sh coreml     # ML programs, MIL reference evaluation (Linux)
#   bash docs/results/parity_table.sh tensorrt   # TensorRT-bound ONNX: lint, then parity in ONNX Runtime
# Run from the repository root after `make install`; SAMPLES=50 for a shorter run.
set -u
target=${1:?usage: parity_table.sh onnx|coreml|tensorrt}
case $target in onnx|coreml|tensorrt) ;; *) echo "unknown target $target: onnx, coreml or tensorrt" >&2; exit 2;; esac
A=$(realpath "${ADAPTEX:-.venv/bin/adaptex}")
n=${SAMPLES:-200}
cd "$(mktemp -d)"

row() {  # row MODEL HOW FILE [check options...]: one line of the table from `adaptex check --json`
  local m=$1 how=$2 f=$3; shift 3
  local lint=""
  [ "$target" = tensorrt ] && lint=" $("$A" lint "$f" | tail -1 | sed 's/.*: //') |"
  "$A" check "$f" --samples "$n" --json "$@" 2>/dev/null | python3 -c "
import json, sys
try:
    r = json.load(sys.stdin)
except ValueError:
    print('| $m | $how | check failed | | | | |$lint'); sys.exit()
print(f\"| $m | $how | {r['passed']} | {r['max_abs_err']:.2e} | {r['decision_agreement']:.4f} | \"
      f\"{r['unexcused_flips']} | {r['samples']} |$lint\")"
}

export_row() {  # export_row MODEL VARIANT HOW [export options...], then its rows
  local m=$1 v=$2 how=$3; shift 3
  local ext=onnx
  [ "$target" = coreml ] && ext=mlpackage
  local f="$m.$v.${how// /_}.$ext"
  local opts=(--target "$target" --variant "$v")
  [ "$target" = tensorrt ] && opts+=(--onnx-only)
  if ! "$A" export "$m" "${opts[@]}" "$@" -o "$f" > /dev/null 2>&1; then
    echo "| $m | $how | export failed | | | | |"; return
  fi
  row "$m" "$how" "$f"
  [ "$target" = onnx ] && [ "$v" = sparse ] && row "$m" "$how, one session" "$f" --one-session
}

head="| model | artifact | passed | max abs error | decision agreement | unexcused flips | samples |"
[ "$target" = tensorrt ] && head="$head lint (10.0) |"
echo "$head"
echo "$head" | sed 's/[^|]*|/---|/g; s/^---//'
for m in budgetformer-graded tsa-charlm elastic-minilm charlm-dense elastic-charlm; do
  export_row "$m" sparse sparse
  [ "$target" = onnx ] && export_row "$m" sparse "sparse, floor off" --softmax-floor off
  [ "$m" = charlm-dense ] || export_row "$m" dense dense  # charlm-dense has no adaptive op: one graph
done
