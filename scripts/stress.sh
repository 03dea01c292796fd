#!/usr/bin/env bash
# Hunt flaky outcomes: the fault matrix N times in a row, then the whole suite (both tiers) M times on 3 pytest-xdist
# workers (more load than CI's 2 on a 2-core machine), on one torch release; prints each run's result
# and ends non-zero if any run failed. Arguments after M choose the suite's tests instead of both tiers whole:
#   bash scripts/stress.sh [torch version, default: .venv's] [N, default 10] [M, default 3] [pytest arguments]
#   bash scripts/stress.sh 2.14.1 0 5 -m slow tests/test_prepare_cluster.py   # one file's slow tests, 5 times
# A version other than .venv's runs in .venv-torch<V> (made by scripts/test_torch.sh if missing).
set -uo pipefail
cd "$(dirname "$0")/.."
version="${1:-}"
matrix_runs="${2:-10}"
suite_runs="${3:-3}"
shift $(($# < 3 ? $# : 3))
chosen=("$@")
[ ${#chosen[@]} -gt 0 ] || chosen=(-m "not harness")
python=.venv/bin/python
if [ -n "$version" ]; then
  python=".venv-torch${version}/bin/python"
  [ -x "$python" ] || bash scripts/test_torch.sh "$version" --collect-only -q >/dev/null
fi
logs=$(mktemp -d)
echo "torch $("$python" -c 'import torch; print(torch.__version__)'), logs in $logs"
failed=0
run() {  # name, pytest arguments...
  local name=$1
  shift
  if "$python" -m pytest -p no:cacheprovider "$@" >"$logs/$name.log" 2>&1; then
    echo "$name: $(tail -n 1 "$logs/$name.log")"
  else
    failed=$((failed + 1))
    echo "$name: FAILED: $(tail -n 1 "$logs/$name.log")"
    grep -E "^(FAILED|ERROR) " "$logs/$name.log" | sed 's/^/    /'
  fi
}
for i in $(seq 1 "$matrix_runs"); do
  run "matrix$i" -q -m slow tests/test_faults.py -k test_every_fault
done
for i in $(seq 1 "$suite_runs"); do
  run "suite$i" -q -n 3 --dist loadfile "${chosen[@]}"
done
echo "$failed failed of $((matrix_runs + suite_runs)) runs"
[ "$failed" = 0 ]
