# What the study runners (docs/results/study*/run.sh) share, sourced by them: a clone of this repository
# at the study's commit with its own .venv, its archived runs put back, and every run that finishes
# archived and committed while the study trains.
# The runner sets: repo (this repository), clone, commit, study (a name for commit messages) and
# archives (an associative array: archive folder, relative to repo -> the clone's output folder).

prepare_clone() {  # the clone at $commit with its .venv, and python: this repository's .venv
  if [[ ! -d "$clone/.git" ]]; then
    git clone -q "$repo" "$clone"
    git -C "$clone" checkout -q "$commit"
  fi
  [[ -x "$clone/.venv/bin/python" ]] || (cd "$clone" && bash scripts/setup_env.sh)
  python="$repo/.venv/bin/python"
  [[ -x "$python" ]] || (cd "$repo" && bash scripts/setup_env.sh)
}

commit_paths() {  # commit_paths MESSAGE PATH...: another git command may hold the index for a moment
  local message="$1"; shift
  for _ in 1 2 3 4 5; do
    if (cd "$repo" && git add "$@" && git commit -q -m "$message" -- "$@"); then return 0; fi
    sleep 5
  done
  echo "study_runner: could not commit $* (the files are in place; commit them by hand)" >&2
}

# What a study keeps of its report beside its archive: the tables, the page and the plots the page shows.
REPORT_FILES=(results.csv summary.csv groups.csv table.md heldout_answers.csv report.html
              accuracy_vs_generated_tokens.png accuracy_vs_wall_time.png reward_vs_generated_tokens.png
              blame_on_error_vs_generated_tokens.png blame_on_error_masked_vs_generated_tokens.png)

keep_report() {  # keep_report REPORT_DIR HERE FILE...: copy each file the report wrote into $repo/HERE; kept: their paths
  local report="$1" here="$2" file; shift 2
  kept=()
  for file in "$@"; do
    if [[ -f "$report/$file" ]]; then cp "$report/$file" "$repo/$here/"; kept+=("$here/$file")
    else echo "study_runner: the report wrote no $file" >&2; fi
  done
}

restore_runs() {
  local archive
  for archive in "${!archives[@]}"; do
    (cd "$repo" && "$python" -m spo_workbench.study.archive restore --archive "$archive" --output-dir "${archives[$archive]}")
  done
}

archive_finished() {  # archive and commit every run that finished since the last call, one commit a run
  local archive folder
  for archive in "${!archives[@]}"; do
    (cd "$repo" && "$python" -m spo_workbench.study.archive save --output-dir "${archives[$archive]}" --archive "$archive") |
      sed -n 's/^archive: saved //p' | while read -r folder; do
        commit_paths "$study: ${folder#docs/results/} finished (trained at $commit)" "$folder"
      done
  done
}

watch_and_archive() {  # archive_finished every 2 minutes until the runner exits
  (while sleep 120; do archive_finished; done) &
  watcher=$!
  trap 'kill $watcher 2>/dev/null || true' EXIT
}
