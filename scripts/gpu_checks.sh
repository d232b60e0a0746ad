#!/usr/bin/env bash
# Every CUDA check of tgdist in one command (issues 3 and 41), for a session lent a GPU machine.
#
#   scripts/gpu_checks.sh --prepare   here, once: gathers into .gpu/ (git-ignored; GPU_CHECKS_DIR
#                                     names another folder) what the GPU image lacks: hydra-core,
#                                     omegaconf and antlr4 (pure Python, copied from this
#                                     environment; antlr4 4.9.3 has no wheel to download) and the
#                                     shared Wikipedia data the checks read
#   then the device tool's run, with command "bash scripts/gpu_checks.sh" and carry [".gpu"]
#   (--quick: parts 1 and 2 only, the rerun after a fix; --parts 0,3: the parts named)
#
# Parts (helpers in scripts/gpu_checks/, each check ONE JSON line on stdout and in $OUT/checks.jsonl:
# check, part, device, status pass|fail, figures, seconds; then a summary table, $OUT/summary.txt):
#   0  tests/gpu under pytest (a step against the CPU's torch formulation, every model, resume)
#   1  two ranks sharing the GPU (torchrun --nproc-per-node 2, CUDA compute, gloo communication as
#      parallel.comm_backend=auto resolves it):
#      depcache, depcomm, sven, daemon, sven with pipeline=sven, MSPipe with depcache, each at
#      2x1x1 against the same run on the CPU (tolerances: TOL in scripts/gpu_checks/shared.py)
#   2  a world of one under torchrun (NCCL): an NCCL smoke, every backend, every pipeline, every
#      backend again deterministic (local memory's scores exactly), and checkpoint + resume equal
#      to the uninterrupted run
#   3  speed, measured (issue 53; scripts/gpu_checks/speed.py says how): on all of Wikipedia the
#      bare loop's epoch of TGN, JODIE and APAN and `tgdist train`'s warm epoch of each, as a user
#      runs it; torch.profiler's busy fraction (CUDA kernel time / wall) and op tables over a warm
#      epoch; `tgdist train` at batch 200; PyG's TGN; a 1M-event synthetic stream's val + test
#      (49 negatives) against its training epoch; at most 240 s on a GPU, run it alone first:
#      --parts 3 (the tables: $OUT/part3_profile_*.txt, each run's metrics and log: $OUT/part3/)
#   4  Sven's pipelining ladder and MSPipe against the plain loop under the simulated link, MSPipe
#      in one process, and FreshGNN's cache for tgat2: ratios from the same run
# Everything goes to $OUT (the device tool's folder that comes back), else ./gpu-results. Each
# part is timed and bounded: the whole run stays within GPU_CHECKS_BUDGET seconds (460 on a GPU,
# 170 with --quick); data sizes come from the device (scripts/gpu_checks/shared.py, sizes(), each
# overridable, e.g. GPU_CHECKS_EVENTS=10000). Exit 1 when any check failed, 2 for a bad argument.
# GPU_CHECKS_DEVICE=cpu runs the whole flow on the CPU with tiny data (the dry run: "NCCL" is gloo
# there and says so; the two-rank parts compare the CPU with itself), with .gpu/ if prepared,
# else with this environment's packages and data.
set -uo pipefail
cd "$(dirname "$0")/.."

prep="${GPU_CHECKS_DIR:-.gpu}"
parts="0 1 2 3 4"
quick=0
while [ "$#" -gt 0 ]; do
    case "$1" in
        --prepare)
            set -e
            rm -rf "$prep"
            mkdir -p "$prep/site" "$prep/datasets"
            site=$(python3 -c "import omegaconf, os; print(os.path.dirname(os.path.dirname(omegaconf.__file__)))")
            for pkg in hydra omegaconf antlr4; do
                cp -r "$site/$pkg" "$prep/site/"
            done
            find "$prep/site" -name __pycache__ -prune -exec rm -rf {} +
            data=$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c "from tgdist.config import datasets_dir; print(datasets_dir())")
            cp -r "$data/wikipedia" "$prep/datasets/"
            echo "gpu_checks: $prep/ ready ($(du -sh "$prep" | cut -f1)); run 'bash scripts/gpu_checks.sh' with carry ['$prep']" >&2
            exit 0 ;;
        --quick) quick=1; parts="1 2"; shift ;;
        --parts)
            if ! [[ "${2:-}" =~ ^[0-4](,[0-4])*$ ]]; then
                echo "gpu_checks: --parts takes a list of 0-4, e.g. --parts 1,2 (got '${2:-}')" >&2
                exit 2
            fi
            parts="${2//,/ }"; shift 2 ;;
        *)
            echo "gpu_checks: unknown argument $1 (use --prepare, --quick or --parts 0,1,2,3,4)" >&2
            exit 2 ;;
    esac
done

device="${GPU_CHECKS_DEVICE:-cuda}"
if [ "$device" != cuda ] && [ "$device" != cpu ]; then
    echo "gpu_checks: GPU_CHECKS_DEVICE=$device: choose cuda (the default) or cpu (the dry run)" >&2
    exit 2
fi
out="${OUT:-gpu-results}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
rm -f "$out/checks.jsonl" "$out/parts.tsv" "$out/summary.txt"
exec 2> >(tee -a "$out/stderr.log" >&2)
if [ -d "$prep/site" ] && [ -d "$prep/datasets" ]; then
    export PYTHONPATH="$(cd "$prep" && pwd)/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export TGDIST_DATASETS="$(cd "$prep" && pwd)/datasets"
elif [ "$device" = cuda ]; then
    echo "gpu_checks: $prep/ is missing: run 'scripts/gpu_checks.sh --prepare' first, then carry $prep" >&2
    exit 2
else
    echo "gpu_checks: dry run without $prep/ (this environment's hydra and data; --prepare makes it)" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export GPU_CHECKS_DEVICE="$device" OUT="$out" PYTHONUNBUFFERED=1
if [ "$device" = cuda ]; then
    budget="${GPU_CHECKS_BUDGET:-$([ "$quick" = 1 ] && echo 170 || echo 460)}"
    caps=(90 150 120 240 170)   # seconds at most per part 0..4 (part 3: issue 53's 4 minutes)
    least=30                    # kept back for each later part
    python3 -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu_checks: no CUDA device visible')" || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/device.txt" >&2 || true
else
    budget="${GPU_CHECKS_BUDGET:-1800}"
    caps=(400 600 400 480 600)
    least=60
    echo "cpu dry run: $(nproc) cores, $(uname -m)" >"$out/device.txt"
fi
python3 -c "
import datetime, torch, numba, numpy, hydra
try:
    import torch_geometric as pyg; v = pyg.__version__
except ImportError:
    v = 'missing'
print('date', datetime.date.today().isoformat(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__,
      'numpy', numpy.__version__, 'hydra', hydra.__version__, 'pyg', v)" 2>&1 | tee -a "$out/device.txt" >&2

helper=(unit_tests two_ranks world_one speed pipelines)
started=$(date +%s.%N)
read -r -a todo <<<"$parts"
for idx in "${!todo[@]}"; do
    p="${todo[$idx]}"
    later=$(( ${#todo[@]} - idx - 1 ))
    spent=$(python3 -c "import time; print(int(time.time() - $started))")
    allowed=$(( budget - spent - later * least ))
    [ "$allowed" -gt "${caps[$p]}" ] && allowed="${caps[$p]}"
    if [ "$allowed" -lt 15 ]; then
        python3 scripts/gpu_checks/shared.py fail "$p" "part$p" "not run: the budget of $budget s was spent"
        printf '%s\t0\tskipped\n' "$p" >>"$out/parts.tsv"
        continue
    fi
    echo "gpu_checks: part $p (${helper[$p]}), at most $allowed s" >&2
    before=$(cat "$out/checks.jsonl" 2>/dev/null | wc -l)
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$allowed" python3 "scripts/gpu_checks/${helper[$p]}.py" --seconds "$((allowed - 10))"
    rc=$?
    t1=$(date +%s.%N)
    after=$(cat "$out/checks.jsonl" 2>/dev/null | wc -l)
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        python3 scripts/gpu_checks/shared.py fail "$p" "part$p" "timed out after $allowed s (its checks after the last line did not finish)"
    elif [ "$rc" != 0 ] && [ "$before" = "$after" ]; then
        python3 scripts/gpu_checks/shared.py fail "$p" "part$p" "the helper exited $rc without a line (see $out/stderr.log)"
    fi
    printf '%s\t%s\t%s\n' "$p" "$(python3 -c "print(round($t1 - $t0, 1))")" "$rc" >>"$out/parts.tsv"
done

python3 scripts/gpu_checks/summary.py
status=$?
echo "gpu_checks: exit $status; results in $out" >&2
exit "$status"
