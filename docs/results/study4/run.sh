#!/usr/bin/env bash
# The multi-turn study (docs/STUDY.md): its tuning sweep, the choice of each arm's rate by the declared
# rule, then the seed runs; resumable across machines that keep no disk. Trains in a clone of this
# repository at the declared commit, with its own .venv, after putting back the runs this folder already
# holds; every run that finishes is archived here and committed at once, as are the tuning's results,
# and when every run is in, the verdict and the report's tables.
#   bash docs/results/study4/run.sh [CLONE]      # CLONE: where the clone goes (default ../study4)
# Stop it by ending its process group; run it again to go on.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
clone="${1:-$repo/../study4}"
commit=46c084c  # the declared commit, amended before any run (docs/STUDY.md)
study="The multi-turn study"
here=docs/results/study4
arms=spo_tree,spo_chain,grpo_prob_mask,grpo
rates=(2.5e-6 5e-6 1e-5)
common=(--task dialogue2 --token-budget 10000 --max-steps 40)
# Validation every 5 steps, the chain's (about three times as many tokens a step) every 2: docs/STUDY.md.
five=(--algorithms spo_tree,grpo_prob_mask,grpo --val-every 5)
two=(--algorithms spo_chain --val-every 2)
declare -A archives=([$here/runs]="$clone/outputs/study4")
for lr in "${rates[@]}"; do archives[$here/tune/lr$lr]="$clone/outputs/study4-tune/lr$lr"; done
source "$repo/docs/results/study_runner.sh"
prepare_clone
restore_runs
watch_and_archive

cd "$clone"
for lr in "${rates[@]}"; do  # the sweep, on the tuning dialogues
  bash scripts/compare.sh "${common[@]}" "${five[@]}" --seeds 100 --lr "$lr" --validate-on tune --output-dir "outputs/study4-tune/lr$lr"
  bash scripts/compare.sh "${common[@]}" "${two[@]}" --seeds 100 --lr "$lr" --validate-on tune --output-dir "outputs/study4-tune/lr$lr"
done
archive_finished
if [[ ! -f "$repo/$here/chosen_rates.csv" ]]; then
  for lr in "${rates[@]}"; do
    "$python" -m spo_workbench.study.verdict --output-dir "outputs/study4-tune/lr$lr" --budget 8000 \
      --csv "$repo/$here/tune_lr$lr.csv"
  done
  "$python" -m spo_workbench.study.tuning $(for lr in "${rates[@]}"; do echo --rate "$lr=$repo/$here/tune_lr$lr.csv"; done) \
    --csv "$repo/$here/chosen_rates.csv"
  commit_paths "$study's tuning done: each arm's rate by the declared rule (chosen_rates.csv)" \
    "$here/chosen_rates.csv" $(for lr in "${rates[@]}"; do echo "$here/tune_lr$lr.csv"; done)
fi
rate_of() { grep "^$1," "$repo/$here/chosen_rates.csv" | cut -d, -f2; }
for seed in 0 1 2 3; do  # seed by seed: every finished seed a complete set of pairs
  bash scripts/compare.sh "${common[@]}" "${five[@]}" --seeds "$seed" --sampled-validation 4 --output-dir outputs/study4 \
    --lr "spo_tree=$(rate_of spo_tree),grpo_prob_mask=$(rate_of grpo_prob_mask),grpo=$(rate_of grpo)"
  bash scripts/compare.sh "${common[@]}" "${two[@]}" --seeds "$seed" --sampled-validation 4 --output-dir outputs/study4 \
    --lr "$(rate_of spo_chain)"
done
archive_finished

# Every run in (compare stops this script otherwise). Its answers named by dialogue first: the declared
# commit's dumps name a dialogue by its opening prompt, which 256 held-out dialogues share 169 ways
# (name_dialogues.py). Then the verdict at the budget, and the report's tables (per step, per run with
# seconds by phase, per arm, the final table) from the archive as restored, kept here and committed.
cd "$repo"
"$python" "$here/name_dialogues.py" "$clone/outputs"
"$python" -m spo_workbench.study.verdict --output-dir "$here/runs" --budget 8000 --level 0.975 --training-budget 10000 \
  --compare spo_tree-grpo_prob_mask,spo_chain-grpo_prob_mask --csv "$here/at_budget.csv" \
  --plot "$here/paired_differences.png" > "$here/verdict.txt"
restored="$(mktemp -d)"
"$python" -m spo_workbench.study.archive restore --archive "$here/runs" --output-dir "$restored"
"$python" -m spo_workbench.study.compare --report-only --task dialogue2 --algorithms "$arms" --seeds 0,1,2,3 \
  --output-dir "$restored"
keep_report "$restored/report" "$here" "${REPORT_FILES[@]}" turns.csv turns_credit.csv
commit_paths "$study: every run in; its answers named by dialogue, the verdict at 8,000 tokens and the report's tables" \
  "$here"/{at_budget.csv,verdict.txt,paired_differences.png,name_dialogues.py} "${kept[@]}" \
  "$here"/runs/*/seed*/answers.csv "$here"/tune/lr*/*/seed*/answers.csv
