#!/usr/bin/env bash
# The long claim runs of issues 55-58, one after another (one heavy job at a time on a 2-core machine), finished
# steps first (rerunning one only checks its records), then MEG, then issue 58's cheaper steps before 57's. Every step
# is resumable: kill it at any point and rerun this script; records already written are kept and skipped. The
# studies of issues 57-58 have their dev steps only: read each dev table (and freeze any dev-tuned value in the
# claim file) before running its held-out split by hand (python -m recipes.claim NAME --threads 2).
#
#   bash bench/claims_queue.sh            # everything still to run, in order
#   bash bench/claims_queue.sh obcache    # from that step on
#
# Commit results/claims/ as it grows. CPU hours measured on 2 cores (see docs/results.md, Claims).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}  # the make venv when there is one
steps=(
  "prism:$PY -m recipes.claim prism --threads 2"
  "prophetkv_screen:$PY -m recipes.claim prophetkv_screen --threads 2"
  "prophetkv:$PY -m recipes.claim prophetkv --threads 2"
  "leaderboard:$PY -m recipes.leaderboard --threads 2"
  "obcache_dev:$PY -m recipes.claim obcache --dev --threads 2"
  "obcache:$PY -m recipes.claim obcache --threads 2"
  "dustin_dev:$PY -m recipes.claim dustin --dev --threads 2"
  "dustin:$PY -m recipes.claim dustin --threads 2"
  "composition_dev:$PY -m recipes.claim composition --dev --threads 2"
  "composition:$PY -m recipes.claim composition --threads 2"
  "meg_xl:$PY -m recipes.claim meg_xl --threads 2"
  "cdic_capacity:$PY -m recipes.claim cdic_capacity --threads 2"
  "l2a_dev:$PY -m recipes.claim l2a --dev --threads 2"
  "cdic_dev:$PY -m recipes.claim cdic --dev --threads 2"
  "l2a_tiny:$PY -m recipes.fit --recipe l2a_tiny_base run_dir=runs/l2a-tiny resume=auto then.overrides=[resume=auto]"
  "softplus_dev:$PY -m recipes.claim softplus --dev --threads 2"
  "repo_dev:$PY -m recipes.claim repo --dev --threads 2"
)
from=${1:-}
started=$([ -z "$from" ] && echo 1 || echo 0)
for step in "${steps[@]}"; do
  name=${step%%:*}
  [ "$name" = "$from" ] && started=1
  [ "$started" = 1 ] || continue
  echo "== $name: ${step#*:}"
  start=$(date +%s)
  ${step#*:}
  echo "== $name done in $(( $(date +%s) - start )) s"
done
