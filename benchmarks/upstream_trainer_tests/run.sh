#!/usr/bin/env bash
# Repeat the measurement: transformers' Trainer tests with plain Trainer, then the same passing tests with
# hf_acco.ACCOTrainer/ACCOConfig (acco_schedule "acco", then "sync"), in the Python environment active now.
# Needs transformers' tests/trainer/ beside this script (see README.md: they are not part of this repository).
set -uo pipefail
cd "$(dirname "$0")"
test -d tests/trainer || { echo "tests/trainer/ is missing: see README.md" >&2; exit 2; }
export CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
PYTEST=(python -m pytest -q -p no:randomly -p no:cacheprovider --timeout 300 -rA)
mkdir -p results

# 1. plain Trainer, full set (GPU / Hub / DeepSpeed / FSDP / optional-package tests skip or fail by themselves)
"${PYTEST[@]}" tests/trainer --junitxml=results/plain.xml > results/plain.log 2>&1
grep '^PASSED ' results/plain.log | sed 's/^PASSED //' | sort > results/plain_passed.txt
echo "plain: $(wc -l < results/plain_passed.txt) passed; $(tail -1 results/plain.log)"

# 2. swapped copy: tests/trainer_acco/, Trainer -> ACCOTrainer, TrainingArguments -> ACCOConfig (acco_swap.py)
python make_swapped.py
sed 's#^tests/trainer/#tests/trainer_acco/#' results/plain_passed.txt > results/selection.txt

# 3. exactly the tests that passed with plain Trainer, once per schedule
for sched in acco sync; do
  ACCO_SWAP_SCHEDULE=$sched "${PYTEST[@]}" $(cat results/selection.txt) --junitxml=results/$sched.xml \
    > results/$sched.log 2>&1
  echo "$sched: $(grep -c '^PASSED ' results/$sched.log) of $(wc -l < results/selection.txt) passed; $(tail -1 results/$sched.log)"
done
python summarize.py
