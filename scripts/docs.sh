#!/usr/bin/env bash
# Builds the documentation site (docs/ -> build/docs/index.html) and runs every code block of its
# pages, so the docs cannot drift from the code. `bash scripts/docs.sh --site` builds and checks the site only
# (steps 1-3): scripts/test.sh runs that beside the suite, whose tests/docs/test_doc_pages.py runs step 4 a page per test.
#   1. the test venv (scripts/setup.sh), whose lock holds the docs tools of docs/requirements.txt;
#   2. Sphinx in strict mode (beside step 4): any warning fails (a broken internal link, a reference to something the
#      API reference does not document, a docstring that does not render), with -n (nitpicky);
#   3. docs/_tools/check_site.py: paratrain.__all__, every subcommand and every extra are covered;
#   4. docs/_tools/run_blocks.py: every code block of README.md and docs/**/*.md runs (python, shell;
#      each in its own process group with a hard time limit), or is parsed or skipped with its reason
#      printed (at most 10 such blocks).
set -euo pipefail
cd "$(dirname "$0")/.."
site_only=0
case "${1:-}" in --site) site_only=1 ;; "") ;; *) echo "usage: bash scripts/docs.sh [--site]" >&2; exit 2 ;; esac
bash scripts/setup.sh cpu  # the docs tools (docs/requirements.txt) are part of its lock, requirements/lock-cpu.txt
venv=${PARATRAIN_VENV:-.venv}
start=$SECONDS
rm -rf build/docs
# the site (one core, ~20 s) is built while the code blocks run; its output is printed after them
slog=$(mktemp)
trap 'rm -f "$slog"' EXIT
timeout --foreground -k 10 5m "$venv/bin/python" -m sphinx -b html -n -W --keep-going -q docs build/docs \
  >"$slog" 2>&1 </dev/null &
sphinx=$!
blocks_rc=0
if [ "$site_only" = 0 ]; then
  echo "== docs: run the code blocks (the site is built beside them)"
  timeout --foreground -k 30 15m "$venv/bin/python" docs/_tools/run_blocks.py </dev/null || blocks_rc=$?
fi
sphinx_rc=0
wait "$sphinx" || sphinx_rc=$?
echo "== docs: build the site (strict): exit $sphinx_rc"
cat "$slog"
[ "$blocks_rc" = 0 ] || exit "$blocks_rc"
[ "$sphinx_rc" = 0 ] || exit "$sphinx_rc"
"$venv/bin/python" docs/_tools/check_site.py build/docs
echo "docs: site in build/docs/index.html; $((SECONDS - start)) s"
