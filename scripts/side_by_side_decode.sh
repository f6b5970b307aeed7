#!/usr/bin/env bash
# Decode only, interleaved, on the side-by-side kit's GGUF files: llama-bench tg64 (depth 0, 2 threads) with each
# llama.cpp build given, then `tandem generate --no-draft` on the same file (the kit's 128-token prompt, 64 new
# tokens). For builds whose multi-row paths cannot run: llama.cpp built with GGML_NATIVE=ON on an AMX CPU
# repacks quantized weights for AMX and decodes with them, but its prompt and batch paths stop with SIGILL on
# a tile instruction (the tile configuration bug of llama.cpp PR #26954, open), so side_by_side_quant.py cannot
# run it.
#
# usage: scripts/side_by_side_decode.sh TANDEM_BIN REPS FORMAT[,FORMAT...] BUILD_DIR[,BUILD_DIR...]
# env:   A (the kit's directory, default ~/anchors) with gguf/e2b10-FORMAT.gguf and prompt128.txt;
#        TANDEM_OPTS (e.g. --huge-pages): also run tandem with these global options, as engine tandem<OPTS>
# prints one line per measurement: REP FORMAT ENGINE TOKENS_PER_S (ENGINE: tandem[OPTS] or the build's directory name)
set -euo pipefail
T=$1; REPS=$2; FORMATS=${3//,/ }; BUILDS=${4//,/ }
A=${A:-$HOME/anchors}; P="$(cat "$A/prompt128.txt")"
for rep in $(seq "$REPS"); do
  for fmt in $FORMATS; do
    for b in $BUILDS; do
      v=$("$b/bin/llama-bench" -m "$A/gguf/e2b10-$fmt.gguf" -t 2 -p 0 -n 64 -r 1 -o csv 2>/dev/null | tail -1 |
          awk -F, '{print $(NF-1)}' | tr -d '"')
      echo "$rep $fmt $(basename "$b") $v"
    done
    for opts in "" ${TANDEM_OPTS:+"$TANDEM_OPTS"}; do
      # shellcheck disable=SC2086 # the options are words
      v=$("$T" --threads 2 $opts generate --model "$A/gguf/e2b10-$fmt.gguf" --prompt "$P" --max-new-tokens 64 \
          --ignore-eos --no-draft --json 2>/dev/null |
          python3 -c "import json,sys; print(json.load(sys.stdin)['stats']['decode_tokens_per_s'])")
      echo "$rep $fmt tandem${opts// /} $v"
    done
  done
done
