#!/usr/bin/env bash
# Refreshes the locks that scripts/setup.sh installs. One command, after editing an input or to take
# newer releases:
#   bash scripts/lock.sh             re-resolve the inputs; pins that still satisfy them are kept
#   bash scripts/lock.sh --upgrade   the newest release of everything the inputs allow
#   (other uv pip compile options pass through, e.g. --upgrade-package transformers)
#
#   input                                         lock                          venv (scripts/setup.sh)
#   requirements.txt + docs/requirements.txt   -> requirements/lock-cpu.txt     .venv        (cpu)
#   requirements-cuda.txt                      -> requirements/lock-cuda.txt    .venv-cuda   (cuda), the wheel step
#   requirements-floor.txt                     -> requirements/lock-floor.txt   .venv-floor  (floor)
#   uv==$UV_VERSION                            -> requirements/tools.txt        build/uv     (the resolver itself)
# (requirements.txt and requirements-cuda.txt include requirements-common.txt.)
#
# Every package of a lock is pinned with its sha256 hashes, resolved for what CI runs: CPython 3.11 on
# x86-64 Linux (glibc 2.28 or newer). Sources: PyPI, plus the find-links of pip's own configuration
# (`pip config list`), where this machine keeps the CPU build of torch (torch==2.13.0+cpu, as
# download.pytorch.org/whl/cpu serves it; add that index to pip's configuration on a machine without
# it). Commit the changed locks with their inputs: setup.sh rebuilds a venv whose lock changed.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
if ! grep -q "^uv==$UV_VERSION " requirements/tools.txt 2>/dev/null; then  # a new uv: pin it with a throwaway one first
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m venv "$tmp/venv" && "$tmp/venv/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } >&2
  echo "uv==$UV_VERSION" | "$tmp/venv/bin/uv" pip compile - --quiet --generate-hashes --no-header -o requirements/tools.txt
fi
bash scripts/setup.sh tools
uv=build/uv/bin/uv
mapfile -t sources < build/uv/sources  # option/value pairs, one per line
find_links=()
for ((i = 0; i + 1 < ${#sources[@]}; i += 2)); do
  [ "${sources[i]}" = --find-links ] && find_links+=(--find-links "${sources[i + 1]}")
done
common=(--quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
        --index-url https://pypi.org/simple ${find_links[@]+"${find_links[@]}"}
        --custom-compile-command "bash scripts/lock.sh")
lock() {  # output, inputs...
  local out=$1; shift
  "$uv" pip compile "${common[@]}" "$@" "${extra[@]+"${extra[@]}"}" -o "$out"
  echo "lock: $out: $(grep -c '^[A-Za-z0-9]' "$out") packages"
}
extra=("$@")
start=$SECONDS
lock requirements/lock-cpu.txt requirements.txt docs/requirements.txt
lock requirements/lock-cuda.txt requirements-cuda.txt
lock requirements/lock-floor.txt requirements-floor.txt
echo "lock: done in $((SECONDS - start)) s; 'git diff requirements/' shows what changed"
