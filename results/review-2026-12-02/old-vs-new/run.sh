#!/usr/bin/env bash
# Issue 12: the data path of 7d7cec0 (before 3c22541/3eac3ce) against HEAD, same session,
# alternating, 3 rounds: bex-perf lat+tput+rate (--quick sizes, 500 iters) and ps-bench
# Pull 1000x64 and 100x64, 1 outstanding, warm.
set -euo pipefail
out=/tmp/cmp; mkdir -p $out
declare -A tree=([old]=/tmp/wt-7d7 [new]=/work/main)
for r in 1 2 3; do
  for t in old new; do
    b=${tree[$t]}/target/release
    $b/bex-perf run --quick -t lat,tput,rate -n 500 --out $out/perf-$t-$r > $out/perf-$t-$r.txt 2>/dev/null
    $b/ps-bench --keys 100,1000 --outstanding 1 --ops pull --modes warm --seconds 2 --quiet \
        --json $out/ps-$t-$r.json > $out/ps-$t-$r.txt
    echo "round $r $t done"
  done
done
