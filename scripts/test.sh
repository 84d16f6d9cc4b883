#!/usr/bin/env bash
# The whole check: bootstrap, lint (ruff), format check, mypy --strict, then
# pytest over tests/ (unit, contract, integration, fault). Extra arguments go
# to pytest: ./scripts/test.sh tests/unit -k lease
#
# Every step runs even when an earlier one failed, so one run shows all the
# problems; the exit status is non-zero if any step failed or if pytest ran
# no test at all.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/bootstrap.sh

BIN="$ROOT/.venv/bin"
failed=()

step() {
    local name=$1
    shift
    printf '\n== %s: %s\n' "$name" "$*"
    if ! "$@"; then
        failed+=("$name")
    fi
}

step ruff "$BIN/ruff" check .
step format "$BIN/ruff" format --check .
step mypy "$BIN/mypy" --strict celery_sched

# The JUnit report tells how many tests really ran; exit codes alone do not
# catch a run whose every test was deselected or skipped.
report="$(mktemp "${TMPDIR:-/tmp}/celery_sched-junit.XXXXXX")"
trap 'rm -f "$report"' EXIT

printf '\n== pytest: pytest -p no:cacheprovider %s\n' "$*"
set +e
# No path given means pyproject's testpaths, i.e. tests/.
"$BIN/python" -m pytest -p no:cacheprovider --junitxml="$report" "$@"
status=$?
set -e
if ((status == 5)); then
    echo "test.sh: pytest collected no tests" >&2
    failed+=(pytest-no-tests)
elif ((status != 0)); then
    failed+=(pytest)
else
    executed="$("$BIN/python" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
PY
)"
    if ((executed == 0)); then
        echo "test.sh: pytest executed no tests (all deselected or skipped)" >&2
        failed+=(pytest-no-tests)
    fi
fi

if ((${#failed[@]})); then
    echo "test.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test.sh: all checks passed" >&2
