#!/usr/bin/env bash
# Runs CI (.ci/run) the way the CI machine does: on a fresh clone of a commit (default HEAD), in a temporary
# directory that is removed afterwards whatever happens. Each clone grows to ~13 GB (two venvs with PyPI's CUDA
# build of torch), so clones left behind fill the disk: that once made CI itself fail with "No space left on device".
#   scripts/ci_fresh_clone.sh [COMMIT]      # prints CI's output and the wall time; exits with CI's status
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
rev=$(git -C "$repo" rev-parse "${1:-HEAD}")
dir=$(mktemp -d "${TMPDIR:-/tmp}/qwen36-ci.XXXXXX")
trap 'rm -rf "$dir"' EXIT
git clone -q "$repo" "$dir/clone"
git -C "$dir/clone" checkout -q "$rev"
echo "[ci_fresh_clone] $rev in $dir/clone (removed on exit)"
start=$(date +%s)
status=0
"$dir/clone/.ci/run" || status=$?
echo "[ci_fresh_clone] exit $status after $(( $(date +%s) - start )) s"
exit "$status"
