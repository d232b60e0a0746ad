#!/usr/bin/env bash
# Issue 3's CUDA checks in one command, for a session that is lent a GPU machine (the device tool).
#
#   scripts/gpu_checks.sh --prepare   here, once: gathers into .gpu/ (git-ignored) what the GPU image
#                                     lacks: hydra-core, omegaconf and antlr4 (pure Python, copied
#                                     from this environment; antlr4 4.9.3 has no wheel to download)
#                                     and the shared data sets the checks read
#   then the device tool's run, with command "bash scripts/gpu_checks.sh" and carry [".gpu"]
#
# There it runs tests/gpu (a step on the GPU against the CPU's torch formulation, every model
# trained and evaluated there, deterministic runs and a resume), then benchmarks/vs_pyg_tgn.py
# --device cuda (both systems' training-epoch seconds on that GPU, and the accuracy comparison), and
# benchmarks/mspipe.py on all of Wikipedia (MSPipe's speed and AP against the plain loop, issue 26).
# Logs and JSON go to $OUT (the device tool's folder that comes back), else ./gpu-results.
# GPU_CHECKS_DEVICE=cpu runs the same flow on the CPU (a dry run of this script, with a 1-epoch
# benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --prepare ]; then
    rm -rf .gpu
    mkdir -p .gpu/site .gpu/datasets
    site=$(python3 -c "import omegaconf, os; print(os.path.dirname(os.path.dirname(omegaconf.__file__)))")
    for pkg in hydra omegaconf antlr4; do
        cp -r "$site/$pkg" .gpu/site/
    done
    find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
    data=$(python3 -c "from tgdist.config import datasets_dir; print(datasets_dir())")
    cp -r "$data/wikipedia" .gpu/datasets/
    echo "gpu_checks: .gpu/ ready ($(du -sh .gpu | cut -f1)); run 'bash scripts/gpu_checks.sh' with carry ['.gpu']" >&2
    exit 0
fi
if [ "$#" -gt 0 ]; then
    echo "gpu_checks: unknown argument $1 (only --prepare)" >&2
    exit 2
fi
if [ ! -d .gpu/site ] || [ ! -d .gpu/datasets ]; then
    echo "gpu_checks: .gpu/ is missing: run 'scripts/gpu_checks.sh --prepare' first, then carry .gpu" >&2
    exit 2
fi

out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/.gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TGDIST_DATASETS="$PWD/.gpu/datasets" PYTHONUNBUFFERED=1
device="${GPU_CHECKS_DEVICE:-cuda}"
epochs=5
if [ "$device" = cuda ]; then
    python3 -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu_checks: no CUDA device visible')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/device.txt" || true
else
    export TGDIST_TEST_DEVICE="$device"
    epochs=1
fi
# (a missing PyG fails the PyG comparison below, not the checks before and after it)
python3 -c "
import torch, numba, numpy, hydra
try:
    import torch_geometric as pyg; v = pyg.__version__
except ImportError:
    v = 'missing (benchmarks/vs_pyg_tgn.py will fail)'
print('torch', torch.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'hydra', hydra.__version__, 'pyg', v)" | tee -a "$out/device.txt"

status=0
python3 -m pytest -p no:cacheprovider tests/gpu -m "slow or not slow" -v -rs 2>&1 | tee "$out/gpu_tests.log" || status=1
python3 benchmarks/vs_pyg_tgn.py --device "$device" --epochs "$epochs" >"$out/vs_pyg_$device.json" \
    2>"$out/vs_pyg_$device.log" || status=1
tail -n 3 "$out/vs_pyg_$device.log" >&2
# issue 26: MSPipe (its stages on their own CUDA streams) against the plain loop, all of Wikipedia
mseeds="0 1 2"
[ "$device" = cuda ] || mseeds="0"
python3 benchmarks/mspipe.py --data wikipedia --models tgn apan --events 0 --epochs "$((epochs < 2 ? 1 : 2))" \
    --seeds $mseeds --points none K=1 auto --mitigation none --overrides "train.device=$device" \
    >"$out/mspipe_$device.json" 2>"$out/mspipe_$device.log" || status=1
tail -n 8 "$out/mspipe_$device.log" >&2
echo "gpu_checks: exit $status; results in $out" >&2
exit "$status"
