#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ (or the ones named) for a while, on stable Rust.
#
# Usage: scripts/fuzz.sh [--smoke | SECONDS_PER_TARGET] [TARGET...]
#   SECONDS_PER_TARGET  libFuzzer's -max_total_time per target (default 60)
#   --smoke             the CI run: 10 s per target, fixed libFuzzer seed
#   TARGET              roce_packet transport_frame rpc_frame rpc_replies ps_wire ps_server
#                       config
#                       (default: all)
# Environment:
#   FUZZ_SANITIZER   none (default; works on stable) or address (sets RUSTC_BOOTSTRAP=1,
#                    since -Zsanitizer is unstable)
#   FUZZ_NICE        nice level of the build and the runs (default 10: the machine is shared)
#
# Corpora: fuzz/corpus/<target> keeps what libFuzzer finds between runs (not committed);
# fuzz/seeds/<target> is rewritten every run from bex_fuzz_targets::seeds (valid encodings);
# fuzz/dicts/<target>.dict, if present, is the target's libFuzzer dictionary.
# libFuzzer's output goes to fuzz/logs/<target>.log.
# A crash leaves its input in fuzz/artifacts/<target>/; reproduce it with
#   cargo fuzz run --sanitizer none -a <target> fuzz/artifacts/<target>/<file>
# or without cargo-fuzz (any toolchain, debug build, full backtrace):
#   cargo run -p bex-fuzz-targets --example replay -- <target> fuzz/artifacts/<target>/<file>
# Exits 1 if any target crashed or failed to run, 2 on bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL=(roce_packet transport_frame rpc_frame rpc_replies ps_wire ps_server config)
secs=60
smoke=0
targets=()
for a in "$@"; do
    case "$a" in
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        --smoke) smoke=1; secs=10 ;;
        ''|*[!0-9]*)
            if [[ " ${ALL[*]} " == *" $a "* ]]; then targets+=("$a")
            else echo "fuzz.sh: unknown target or option '$a' (see --help)" >&2; exit 2; fi ;;
        *) secs=$a ;;
    esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=("${ALL[@]}")
[[ $secs -gt 0 ]] || { echo "fuzz.sh: SECONDS_PER_TARGET must be > 0" >&2; exit 2; }

sanitizer=${FUZZ_SANITIZER:-none}
if [[ $sanitizer != none ]]; then export RUSTC_BOOTSTRAP=1; fi
nice=(nice -n "${FUZZ_NICE:-10}")

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    "${nice[@]}" cargo install cargo-fuzz --locked --version 0.13.2
fi

echo "==> seeds"
"${nice[@]}" cargo run -q --locked -p bex-fuzz-targets --example write_seeds -- fuzz/seeds >/dev/null

echo "==> building the targets (release, debug assertions, sanitizer: $sanitizer)"
(cd fuzz && "${nice[@]}" cargo fuzz build --sanitizer "$sanitizer" -a)

extra=()
[[ $smoke == 1 ]] && extra+=(-seed=1)
failed=()
summary=()
mkdir -p fuzz/logs
for t in "${targets[@]}"; do
    echo "==> $t for ${secs}s"
    mkdir -p "fuzz/corpus/$t"
    dict=()
    [[ -f fuzz/dicts/$t.dict ]] && dict=(-dict="dicts/$t.dict")
    log=fuzz/logs/$t.log
    # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a leak or a huge allocation.
    if (cd fuzz && "${nice[@]}" cargo fuzz run --sanitizer "$sanitizer" -a "$t" \
            "corpus/$t" "seeds/$t" -- -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
            -print_final_stats=1 "${extra[@]}" "${dict[@]}") >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed+=("$t")
        tail -n 60 "$log"
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 || true)
    corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
    summary+=("$(printf '%-16s %-6s runs=%-10s %-22s corpus=%s' "$t" "$status" "${runs:-?}" "${cov:-}" "$corpus")")
done

echo "==> summary (${secs}s per target)"
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "fuzz.sh: crashes or failures in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
