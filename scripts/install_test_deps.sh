#!/usr/bin/env bash
# Installs what the launcher's SLURM and MPI tests need, when it is missing:
#   Debian packages slurmctld, slurmd, slurm-client and munge (a one-node test cluster), and
#   pip packages mpi4py and mpich (the mpich wheel ships mpiexec), and py-tgb (TGB's loaders and
#   Evaluator, which the data=tgb and train.eval=tgb tests check against; also in the dev extra).
# Idempotent and quiet; safe to call from CI on every run. Needs root (or sudo) for apt-get.
# Tests skip with a reason when these are absent, so a failure here is reported but not fatal.
set -u

PYTHON="${PYTHON:-python3}"
log() { echo "install_test_deps: $*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"; else return 1; fi
}

missing_debs=()
command -v slurmctld >/dev/null 2>&1 || missing_debs+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || missing_debs+=(slurmd)
command -v sbatch >/dev/null 2>&1 || missing_debs+=(slurm-client)
command -v munged >/dev/null 2>&1 || missing_debs+=(munge)
if [ "${#missing_debs[@]}" -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
        log "apt-get install ${missing_debs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        # The packages' own services must not start here: the tests run their own daemons on
        # private ports. A temporary policy-rc.d (exit 101 = "do not start") does that; it is
        # removed again unless one was there before.
        own_policy=0
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            as_root sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d' && own_policy=1
        fi
        { as_root apt-get update -qq && as_root apt-get install -y -qq --no-install-recommends "${missing_debs[@]}"; } >/dev/null 2>&1 \
            || log "apt-get failed; the SLURM tests will be skipped"
        [ "$own_policy" = 1 ] && as_root rm -f /usr/sbin/policy-rc.d
    else
        log "no apt-get: SLURM tests will be skipped"
    fi
fi

if ! "$PYTHON" -c "import mpi4py" >/dev/null 2>&1 || ! command -v mpiexec >/dev/null 2>&1; then
    log "pip install mpi4py mpich"
    "$PYTHON" -m pip install -q mpi4py mpich >/dev/null 2>&1 || log "pip install failed; the MPI tests will be skipped"
fi
if ! "$PYTHON" -c "import tgb" >/dev/null 2>&1; then
    log "pip install py-tgb==2.3.0"
    "$PYTHON" -m pip install -q "py-tgb==2.3.0" >/dev/null 2>&1 || log "pip install failed; the py-tgb cross-checks will be skipped"
fi
exit 0
