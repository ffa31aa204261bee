#!/usr/bin/env bash
# Print the path of a Python that ttnn 0.81.1 has wheels for (3.12 or 3.10), or fail loudly.
# Usage: find_python.sh [VERSION]   (VERSION 3.12 or 3.10 asks for that one only; default: 3.12, else 3.10)
# Looks at PATH first, then at pyenv-installed interpreters (pyenv shims need PYENV_VERSION).
set -euo pipefail
wanted="${1:-3.12 3.10}"
for v in $wanted; do
  case "$v" in 3.12|3.10) ;; *) echo "error: Python $v requested; ttnn 0.81.1 has wheels for 3.12 and 3.10 only" >&2; exit 1;; esac
done
for v in $wanted; do
  for cand in "python$v" ; do
    if p=$(command -v "$cand" 2>/dev/null) && "$p" -c 'import sys' >/dev/null 2>&1; then
      real=$("$p" -c 'import sys; print(sys.executable)')
      echo "$real"; exit 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for full in $(pyenv versions --bare 2>/dev/null | grep -E "^${v//./\\.}\.[0-9]+$" | sort -t. -k3 -n -r); do
      p="$(pyenv root)/versions/$full/bin/python$v"
      if [ -x "$p" ]; then echo "$p"; exit 0; fi
    done
  fi
  for root in "$HOME/.pyenv/versions" /root/.pyenv/versions; do
    for p in "$root"/$v.*/bin/python$v; do
      if [ -x "$p" ]; then echo "$p"; exit 0; fi
    done
  done
done
echo "error: no Python ${wanted// / or } found (ttnn 0.81.1 has wheels for 3.12 and 3.10 only). Install one (e.g. 'pyenv install 3.12') and retry." >&2
exit 1
