"""``tgdist plan``: choose ``i x j x k`` for a cluster, following DistTGL section 3.2.4.

The heuristic, for P machines with Q GPUs each (``i * j * k = P * Q``):

1. i from the task: the largest global batch without accuracy loss (L events) over the batch that
   saturates one GPU (S events): ``i = floor(L / S)`` trainers, each with the local batch S (a larger
   local batch would only take longer per GPU), at least 1 (with ``L < S`` the local batch is L).
2. k from the hardware: memory parallelism is the only strategy that moves no memory between
   machines, so ``k >= P``, and each machine must hold ``k / P`` copies of node memory and mails.
   Prefer memory parallelism over epoch parallelism (better convergence, DistTGL Fig. 9b): the
   largest k allowed by host memory that divides ``P*Q / i``.
3. j is what is left: ``j = P*Q / (i*k)``.

One refinement keeps each memory group (i*j trainers and its daemon, 3.3) on one machine: with
contiguous ranks that holds when k is a multiple of P, so k = P*m with m copies per machine, m the
largest divisor of Q/i not above the copies a machine can hold; and i must divide Q (it is lowered
to the largest divisor of Q below L/S otherwise, and the explanation says so).

Worked example of the paper: 4 machines x 8 GPUs, L = 3200, S = 1600, two copies per machine ->
i = 2, k = 8, j = 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field

from tgdist.errors import ConfigError

__all__ = ["Plan", "plan", "main"]


@dataclass(frozen=True)
class Plan:
    machines: int
    gpus_per_machine: int
    i: int
    j: int
    k: int
    local_batch: int  # train.batch_size per trainer
    global_batch: int  # i * local_batch events per subgroup iteration
    copies_per_machine: int  # k / machines memory copies in each machine's host memory
    max_copies_per_machine: int  # what host memory allows
    epochs_multiple_of: int  # train.epochs must be a multiple of j*k
    reasons: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.i * self.j * self.k

    def overrides(self) -> list[str]:
        """The layout, and when j*k > 1 the fewest epochs of at least the default (5) that are a
        multiple of j*k, so that the printed launch line runs as it is."""
        out = [f"parallel.i={self.i}", f"parallel.j={self.j}", f"parallel.k={self.k}",
               f"train.batch_size={self.local_batch}"]
        if self.world_size > 1:  # DistTGL's memory daemon per group; one trainer keeps its memory local
            out.append(f"memory.backend={host_shared_store()}")
        m = self.epochs_multiple_of
        if m > 1:
            from tgdist.config import TrainConfig

            out.append(f"train.epochs={-(-TrainConfig.epochs // m) * m}")
        return out

    def as_json(self) -> dict:
        d = asdict(self)
        d.pop("reasons")
        d["world_size"] = self.world_size
        d["overrides"] = self.overrides()
        return d


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (pairs up to sqrt(n): a huge GPU count is instant)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _need_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def copies_from_memory(host_mem_gb: float, memory_gb_per_copy: float) -> int:
    """How many copies of node memory and mails fit in one machine's host memory."""
    if not (0 < host_mem_gb < math.inf and 0 < memory_gb_per_copy < math.inf):
        raise ConfigError(f"--host-mem-gb and --memory-gb-per-copy must be positive finite numbers, got {host_mem_gb} "
                          f"and {memory_gb_per_copy}")
    copies = host_mem_gb / memory_gb_per_copy + 1e-9
    return int(math.floor(copies)) if copies < 1e6 else 10**6  # more copies than any machine has GPUs


def plan(machines: int, gpus_per_machine: int, largest_batch: int, saturation_batch: int,
         memory_copies_per_machine: int) -> Plan:
    """The (i, j, k) of DistTGL 3.2.4 for ``machines`` x ``gpus_per_machine`` GPUs; see the module
    docstring. Raises ``ConfigError`` when no layout fits."""
    P = _need_positive("--machines", machines)
    Q = _need_positive("--gpus-per-machine", gpus_per_machine)
    L = _need_positive("--largest-batch", largest_batch)
    S = _need_positive("--saturation-batch", saturation_batch)
    if isinstance(memory_copies_per_machine, bool) or not isinstance(memory_copies_per_machine, int):
        raise ConfigError(f"--memory-copies-per-machine must be an integer, got {memory_copies_per_machine!r}")
    C = memory_copies_per_machine
    if C < 1:
        raise ConfigError(
            f"host memory holds {C} copies of node memory per machine, but memory parallelism needs "
            f"k >= {_plural(P, 'machine')}, i.e. at least one copy per machine (DistTGL 3.2.4); use machines "
            "with more host memory or a smaller memory dimension"
        )
    reasons: list[str] = []

    # 1. i from the largest batch and the saturation batch
    i_task = max(1, L // S)
    local = S if L >= S else L
    if L < S:
        reasons.append(f"the largest batch without accuracy loss ({L}) is below GPU saturation ({S}): "
                       f"i = 1 with local batch {L}")
    else:
        reasons.append(f"i = floor(largest batch {L} / saturation batch {S}) = {i_task}: each trainer "
                       f"takes the saturating local batch {S}, global batch {i_task * S} <= {L}")
    i = max(d for d in _divisors(Q) if d <= i_task)
    if i != i_task:
        reasons.append(f"i lowered from {i_task} to {i}, the largest divisor of the {Q} GPUs per machine "
                       f"not above it: a memory group (i*j trainers sharing one copy) must stay on one machine")

    # 2. k: multiple of P (one or more whole groups per machine), within host memory, dividing P*Q/i
    m = max(d for d in _divisors(Q // i) if d <= C)
    k = P * m
    reasons.append(
        f"k = {k}: memory parallelism needs k >= {_plural(P, 'machine')} and host memory holds {C} "
        f"cop{'y' if C == 1 else 'ies'} per machine; the largest k = machines x copies that divides "
        f"P*Q/i = {P * Q // i} uses {m} cop{'y' if m == 1 else 'ies'} per machine"
        + (f" (not {C}: the {Q // i} subgroup slots of a machine cannot be split into {C} equal groups)"
           if m < C and Q // i >= C else "")
        + (f" (the {Q // i} subgroup slots of a machine leave no room for more)" if m < C and Q // i < C else "")
    )
    # 3. j is fixed by the rest
    j = P * Q // (i * k)
    reasons.append(f"j = P*Q / (i*k) = {P * Q} / ({i} x {k}) = {j}"
                   + (": epoch parallelism fills the GPUs that memory copies cannot" if j > 1 else ""))
    reasons.append(f"train.epochs must be a multiple of j*k = {j * k} (each memory group makes epochs/(j*k) passes)")
    return Plan(machines=P, gpus_per_machine=Q, i=i, j=j, k=k, local_batch=local, global_batch=i * local,
                copies_per_machine=m, max_copies_per_machine=C, epochs_multiple_of=j * k, reasons=reasons)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tgdist plan",
        description="Choose the DistTGL i x j x k (mini-batch x epoch x memory parallelism) for a cluster "
                    "(DistTGL section 3.2.4). Prints the reasoning, then one JSON line.",
        epilog="example: tgdist plan --machines 4 --gpus-per-machine 8 --largest-batch 3200 "
               "--saturation-batch 1600 --memory-copies-per-machine 2   ->  i=2 j=2 k=8. "
               "To predict and rank every layout, store and pipeline from a profile of the data instead: "
               "tgdist plan --profile data=NAME --quick --cluster PRESET|FILE (tgdist plan --profile --help; "
               "docs/advisor.md)",
    )
    ap.add_argument("--machines", "-P", type=int, required=True, help="number of machines (P)")
    ap.add_argument("--gpus-per-machine", "-Q", type=int, required=True, help="GPUs (trainers) per machine (Q)")
    ap.add_argument("--largest-batch", type=int, required=True,
                    help="largest global batch (events) without accuracy loss")
    ap.add_argument("--saturation-batch", type=int, required=True,
                    help="local batch (events) above which one GPU is saturated")
    mem = ap.add_mutually_exclusive_group(required=True)
    mem.add_argument("--memory-copies-per-machine", type=int,
                     help="copies of node memory + mails one machine's host memory holds")
    mem.add_argument("--host-mem-gb", type=float, help="host memory per machine (GB); with --memory-gb-per-copy")
    ap.add_argument("--memory-gb-per-copy", type=float, help="size of one copy of node memory + mails (GB)")
    ap.add_argument("--json-only", action="store_true", help="print only the JSON line")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from tgdist.launcher.advisor.cli import wants_advisor

    if wants_advisor(argv):  # the strategy advisor: a profile of the data instead of L, S and copies
        from tgdist.launcher.advisor.cli import main as advise

        return advise(argv)
    args = _parser().parse_args(argv)
    if args.memory_copies_per_machine is not None:
        _need_positive("--memory-copies-per-machine", args.memory_copies_per_machine)
        if args.memory_gb_per_copy is not None:  # it would be ignored
            raise ConfigError("--memory-gb-per-copy goes with --host-mem-gb; --memory-copies-per-machine gives the "
                              "copies directly")
        copies = args.memory_copies_per_machine
    else:
        if args.memory_gb_per_copy is None:
            raise ConfigError("--host-mem-gb needs --memory-gb-per-copy (or give --memory-copies-per-machine)")
        copies = copies_from_memory(args.host_mem_gb, args.memory_gb_per_copy)
    p = plan(args.machines, args.gpus_per_machine, args.largest_batch, args.saturation_batch, copies)
    if not args.json_only:
        print(f"{_plural(p.machines, 'machine')} x {_plural(p.gpus_per_machine, 'GPU')} -> "
              f"i x j x k = {p.i} x {p.j} x {p.k}")
        for r in p.reasons:
            print(f"  - {r}")
        print(f"  launch: sbatch --nodes {p.machines} --gpus-per-node {p.gpus_per_machine} "
              f"slurm/multinode_gpu.sbatch {' '.join(p.overrides())}")
    print(json.dumps(p.as_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def host_shared_store() -> str:
    """The registered store that keeps each copy in its machine's host memory for a group of
    trainers (the memory daemon, DistTGL 3.2.4): what the plan's copies per machine assume."""
    from tgdist import memory

    found = [n for n in memory.names() if memory.store_class(n).placement == "host_shared"]
    if not found:
        raise ConfigError("no registered memory store keeps its copy in host memory (placement host_shared)")
    return found[0]
