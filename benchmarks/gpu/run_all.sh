#!/usr/bin/env bash
# Run every GPU check in one go, each under its own time limit, logging to $OUT (or ./gpu-logs).
#
# Why one script: a lent GPU machine is short-lived and its time is counted from start-up, so
# all checks travel together and a slow one cannot starve the others (each has a timeout).
#
# On a machine whose python lacks the project's pure-Python dependencies, carry them as wheels
# in .whl/ (hydra-core, omegaconf, antlr4-python3-runtime and the project's own wheel, built
# with `pip wheel --no-deps -w .whl . hydra-core==1.3.2 omegaconf==2.3.0
# antlr4-python3-runtime==4.9.3`); this script installs them into /tmp/site first.
#
#     bash benchmarks/gpu/run_all.sh            # all checks
#     bash benchmarks/gpu/run_all.sh salus tictac
#     bash benchmarks/gpu/run_all.sh --force     # write over an earlier run's logs in $OUT
set -u
force=""
if [ "${1:-}" = "--force" ]; then force=1; shift; fi
# name:seconds, in order of what matters most if time runs short
CHECKS="salus:120 cluster:120 cli:200 tictac:60 kernels:150 offload:120 slide:120"
if [ $# -gt 0 ]; then  # the names asked for, checked before anything runs
    sel=""
    for want in "$@"; do
        found=""
        for c in $CHECKS; do [ "${c%%:*}" = "$want" ] && found="$c"; done
        if [ -z "$found" ]; then
            names=""
            for c in $CHECKS; do names="$names ${c%%:*}"; done
            echo "run_all.sh: error: unknown check '$want' (checks:$names)" >&2
            exit 2
        fi
        sel="$sel $found"
    done
    CHECKS="$sel"
fi

OUT_DIR="${OUT:-gpu-logs}"
if [ -e "$OUT_DIR/summary.txt" ] && [ -z "$force" ]; then  # never overwrite a user's results
    echo "run_all.sh: error: $OUT_DIR/summary.txt exists; not overwriting results (pass --force to regenerate them)" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
: >"$OUT_DIR/summary.txt"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    print("pynvml:", pynvml.nvmlDeviceGetName(h), "total", mem.total, "free", mem.free)
except Exception as exc:  # noqa: BLE001 - a report line, not control flow
    print("pynvml unavailable:", exc)
EOF
} 2>&1 | tee "$OUT_DIR/env.txt"

status=0
for c in $CHECKS; do
    name="${c%%:*}"; limit="${c##*:}"
    echo "=== $name (limit ${limit}s) ===" | tee -a "$OUT_DIR/summary.txt"
    start=$(date +%s)
    # SIGTERM at the limit (a check then stops its child processes and removes its temporary
    # directories), SIGKILL 30 s later if it has not ended
    timeout -k 30 "$limit" "$PY" "benchmarks/gpu/${name}_check.py" >"$OUT_DIR/${name}.log" 2>&1
    rc=$?
    end=$(date +%s)
    tail -n 25 "$OUT_DIR/${name}.log"
    echo "--- $name rc=$rc in $((end - start))s" | tee -a "$OUT_DIR/summary.txt"
    [ $rc -ne 0 ] && status=1
done
exit $status
