#!/usr/bin/env bash
# The third study's seed runs (docs/STUDY.md), resumable across machines that keep no disk: trains in a
# clone of this repository at the tuning's commit, with its own .venv, after putting back the runs this
# folder already holds; every run that finishes is archived here and committed at once. When the primary
# arms' runs are in, the verdict and the report's tables are written here and committed, and again when
# the secondary arm's are.
#   bash docs/results/study3/run.sh [CLONE]      # CLONE: where the clone goes (default ../study3)
# Stop it by ending its process group; run it again to go on.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
clone="${1:-$repo/../study3}"
commit=2ae6efd  # the tuning ran here (docs/results/study3/tune_*.csv)
study="The third study"
here=docs/results/study3
declare -A archives=([$here/runs]="$clone/outputs/study3")
source "$repo/docs/results/study_runner.sh"
prepare_clone
restore_runs
watch_and_archive

# Whether the runs finished is read from their done.json, not from compare's exit status: at commit
# 2ae6efd compare's closing report raises on runs restored from the archive (their answers keep no text).
finished() {  # finished ALGORITHMS SEEDS: every run has its done.json
  local algorithm seed
  for algorithm in ${1//,/ }; do for seed in ${2//,/ }; do
    [[ -f "outputs/study3/$algorithm/seed$seed/done.json" ]] || { echo "run.sh: $algorithm/seed$seed unfinished; run again" >&2; return 1; }
  done; done
}
# The verdict at the budget and the report's tables (per step, per run with seconds by phase and trained
# tokens, per arm, the final table), its page and the plots it shows, of the runs in: kept here, committed.
close_study() {  # close_study WHICH-RUNS
  (cd "$repo"
   "$python" -m spo_workbench.study.verdict --output-dir "$here/runs" --budget 16000 --level 0.975 --training-budget 18000 \
     --compare spo_tree_cutpoint-grpo_prob_mask,spo_tree_cutpoint-grpo --csv "$here/at_budget.csv" \
     --plot "$here/paired_differences.png" > "$here/verdict.txt"
   "$python" -m spo_workbench.study.compare --report-only --task steps4 \
     --algorithms spo_tree_cutpoint,grpo_prob_mask,grpo,spo_chain --seeds 0,1,2,3,4,5,6,7 --output-dir "$clone/outputs/study3")
  keep_report "$clone/outputs/study3/report" "$here" "${REPORT_FILES[@]}"
  commit_paths "$study: $1; the verdict at 16,000 tokens and the report's tables" \
    "$here"/{at_budget.csv,verdict.txt,paired_differences.png} "${kept[@]}"
}

cd "$clone"
primary=spo_tree_cutpoint,grpo_prob_mask,grpo
bash scripts/compare.sh --task steps4 --algorithms "$primary" --seeds 0,1,2,3,4,5,6,7 \
  --lr spo_tree_cutpoint=5e-6,grpo_prob_mask=5e-6,grpo=5e-6 --token-budget 18000 --max-steps 40 --val-every 5 \
  --sampled-validation 4 --output-dir outputs/study3 || true
finished "$primary" 0,1,2,3,4,5,6,7
archive_finished
# The declared comparisons need only the primary arms: their verdict is kept before SPO-chain's runs.
if [[ ! -f "$repo/$here/verdict.txt" ]]; then close_study "the primary arms' runs in"; fi
bash scripts/compare.sh --task steps4 --algorithms spo_chain --seeds 0,1,2 --lr 1e-5 --token-budget 18000 \
  --max-steps 40 --val-every 5 --sampled-validation 4 --output-dir outputs/study3 || true
finished spo_chain 0,1,2
archive_finished
close_study "every run in"
