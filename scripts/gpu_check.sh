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
#   pages      book pages 05 and 06 side by side (each <= 10 minutes)
#   notebooks  every other notebook, several at a time
#   translate  chapter 5's full training run (test BLEU >= 40), then its step benchmark
#
# Stages run one after another; STAGE+STAGE runs them side by side (`timed cuda+pages`). Each
# command's output goes to $OUT/NAME.log (OUT defaults to gpu-logs) and a line with its exit
# status and seconds to $OUT/summary.txt: ten files at most. A failing command is reported and
# the next one runs. On an offline machine, make the pack first (../shared/gpu/pack.sh --book):
# .gpu/env.sh, when present, is sourced. The profile is `full` unless COURSE_PROFILE says otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = --dry-run ] && { dry=1; shift; }
[ $# -gt 0 ] || { sed -n '2,18p' "$0"; exit 2; }
[ -f .gpu/env.sh ] && [ $dry = 0 ] && . .gpu/env.sh
export COURSE_PROFILE=${COURSE_PROFILE:-full} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-gpu-logs}
# --nbval-lax compares no stored output (those are the CPU `quick` ones); every claim a page makes
# is an assert in its cell, so it still runs, with the `full` bounds (book/maintainers.md).
nbval=(python3 -m pytest -p no:cacheprovider --nbval-lax --nbval-current-env --durations=0)

run() {  # run NAME COMMAND...: the command's output to $out/NAME.log, its status to summary.txt
  local name=$1 start=$SECONDS status
  shift
  echo "::: $name: $*"
  [ $dry = 1 ] && return 0
  "$@" >"$out/$name.log" 2>&1
  status=$?
  printf '%-10s exit %-3s %5s s  %s\n' "$name" "$status" "$((SECONDS - start))" "$*" |
    tee -a "$out/summary.txt"
}

stage() {  # stage NAME: run one stage's commands
  case $1 in
    timed)
      run char python3 scripts/train_gpt2.py --profile full --compile
      run step python3 benchmarks/gpt2.py --size small --compile ;;
    cuda)
      run cuda python3 -m pytest -p no:cacheprovider tests/test_cuda.py -n 4 -rs --durations=10
      run flash python3 benchmarks/flash_attention.py ;;
    pages)
      run page05 "${nbval[@]}" -p no:xdist book/05_translation.ipynb &
      run page06 "${nbval[@]}" -p no:xdist book/06_gpt2.ipynb &
      wait ;;
    notebooks)
      # shellcheck disable=SC2046
      run notebooks "${nbval[@]}" -n 6 $(ls book/0[!56]*.ipynb exercises/*.ipynb solutions/*.ipynb) ;;
    translate)
      run translate python3 -m transformer_course.translation --profile full
      run t-bench python3 benchmarks/translation.py --batch-sizes 256 1024 ;;
  esac
}

for group in "$@"; do  # check every name first, so a typo costs no GPU time
  for name in ${group//+/ }; do
    case $name in
      timed | cuda | pages | notebooks | translate) ;;
      *) echo "gpu_check.sh: unknown stage '$name' (timed cuda pages notebooks translate)" >&2
         exit 2 ;;
    esac
  done
done
[ $dry = 1 ] || mkdir -p "$out"
for group in "$@"; do
  for name in ${group//+/ }; do
    stage "$name" &
  done
  wait
done
