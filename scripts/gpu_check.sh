#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA PyTorch (README, "One H100"):
#
#   bash scripts/gpu_check.sh [--dry-run] STAGE...    # from the project root
#
#   timed      alone on the GPU, one after the other: shakespeare_char (best validation loss
#              <= 1.46 within 60 s of training), then GPT-2 small's training step against Hugging
#              Face's (<= 0.9x its step time, MFU >= 40%)
#   cuda       tests/test_cuda.py: every component on CUDA within its stated tolerance (the Triton
#              FlashAttention kernel included), then the kernel timed against SDPA's flash backend
#   pages      book pages 05 and 06 side by side (each <= 5 minutes)
#   notebooks  every other notebook, several at a time
#   translate  chapter 5's full training run (test BLEU >= 40), then its step benchmark
#   first      the first of the two calls that check everything: timed, then pages (<= 8 min)
#   second     the second: cuda and notebooks side by side (<= 4 min)
#
# Stages run one after another; STAGE+STAGE runs them side by side (`cuda+notebooks`). Each
# command has a time limit (its stage's share of the call) and writes its output to $OUT/NAME.log
# (OUT defaults to gpu-logs); $OUT/summary.txt gets the machine, then a line per command with its
# exit status (124: stopped at its limit) and seconds, and for `notebooks` each notebook's exit
# status and seconds. A failing command is reported and the next one runs. On an offline
# machine, make the pack first (../shared/gpu/pack.sh): .gpu/env.sh, when present, is sourced.
# The profile is `full` unless COURSE_PROFILE says otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = --dry-run ] && { dry=1; shift; }
[ $# -gt 0 ] || { sed -n '2,23p' "$0"; exit 2; }
[ -f .gpu/env.sh ] && [ $dry = 0 ] && . .gpu/env.sh
export COURSE_PROFILE=${COURSE_PROFILE:-full} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-gpu-logs}
# --nbval-lax compares no stored output (those are the CPU `quick` ones); every claim a page makes
# is an assert in its cell, so it still runs, with the `full` bounds (book/maintainers.md).
nbval=(python3 -m pytest -p no:cacheprovider --nbval-lax --nbval-current-env --durations=0)

run() {  # run NAME SECONDS COMMAND...: the command, stopped after SECONDS, logged to $out/NAME.log
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  echo "::: $name (<= $limit s): $*"
  [ $dry = 1 ] && return 0
  timeout -k 20 "$limit" "$@" >"$out/$name.log" 2>&1
  status=$?
  printf '%-10s exit %-3s %5s s  %s\n' "$name" "$status" "$((SECONDS - start))" "$*" >>"$out/summary.txt"
  grep '^=== ' "$out/$name.log" >>"$out/summary.txt"  # each notebook's line, from `notebooks`
}

# bash -c "$one_notebook" _ NOTEBOOK COMMAND...: the command's output on NOTEBOOK, then a line
# `=== NOTEBOOK: exit STATUS in SECONDS s`, all at once (several run side by side)
one_notebook='SECONDS=0; log=$("${@:2}" "$1" 2>&1); status=$?; '
one_notebook+='printf "%s\n=== %s: exit %s in %s s\n" "$log" "$1" "$status" "$SECONDS"'

longest_first() {  # every notebook but book 05 and 06, those that take longest in `full` first
  local first=(book/07_llama.ipynb solutions/06_gpt2.ipynb solutions/07_llama.ipynb
    solutions/05_translation.ipynb book/08_scaling.ipynb solutions/08_scaling.ipynb
    book/02_attention.ipynb book/01_tokenization.ipynb solutions/01_tokenization.ipynb)
  printf '%s\n' "${first[@]}"
  ls book/*.ipynb exercises/*.ipynb solutions/*.ipynb |
    grep -vxF -f <(printf '%s\n' "${first[@]}" book/05_translation.ipynb book/06_gpt2.ipynb)
}

stage() {  # stage NAME: run one stage's commands
  case $1 in
    timed)
      run char 120 python3 scripts/train_gpt2.py --profile full --compile
      run step 120 python3 benchmarks/gpt2.py --size small --compile --profile-steps 2 ;;
    cuda)
      run cuda 150 python3 -m pytest -p no:cacheprovider tests/test_cuda.py -n 4 -rs --durations=10
      run flash 60 python3 benchmarks/flash_attention.py ;;
    pages)
      run page05 300 "${nbval[@]}" -p no:xdist book/05_translation.ipynb &
      run page06 300 "${nbval[@]}" -p no:xdist book/06_gpt2.ipynb &
      wait ;;
    notebooks)  # each in its own process, 6 at a time, the longest first (under one pytest the
      # scheduler keeps the book pages, and the solutions, each on one worker: for CI's book
      # build and for the parts each solution passes to the next)
      if [ $dry = 1 ]; then longest_first | sed 's/^/    /'; else longest_first >"$out/notebooks.txt"; fi
      run notebooks 230 env OMP_NUM_THREADS=2 xargs -a "$out/notebooks.txt" -P 6 -I NB \
        bash -c "$one_notebook" _ NB "${nbval[@]}" -p no:xdist
      if [ $dry = 0 ]; then  # a notebook with no line ran out of time
        grep -vxF -f <(sed -n 's/^=== \(.*\): exit.*/\1/p' "$out/notebooks.log") "$out/notebooks.txt" |
          sed 's/^/=== /; s/$/: stopped at the limit/' >>"$out/summary.txt"
      fi ;;
    translate)
      run translate 600 python3 -m transformer_course.translation --profile full
      run t-bench 300 python3 benchmarks/translation.py --batch-sizes 256 1024 --compile ;;
  esac
}

set -- $(printf '%s\n' "$@" | sed 's/^first$/timed pages/; s/^second$/cuda+notebooks/')
for group in "$@"; do  # check every name first, so a typo costs no GPU time
  for name in ${group//+/ }; do
    case $name in
      timed | cuda | pages | notebooks | translate) ;;
      *) echo "gpu_check.sh: unknown stage '$name' (timed cuda pages notebooks translate," \
           "or the calls first and second)" >&2
         exit 2 ;;
    esac
  done
done
if [ $dry = 0 ]; then
  mkdir -p "$out"
  { date -u '+%F %T UTC'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
      echo "no nvidia-smi"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    echo "profile $COURSE_PROFILE; stages: $*"; } >>"$out/summary.txt"
fi
for group in "$@"; do
  for name in ${group//+/ }; do
    stage "$name" &
  done
  wait
done
[ $dry = 1 ] || cat "$out/summary.txt"
