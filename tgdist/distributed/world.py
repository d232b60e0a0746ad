"""Where this process runs, the checks of the layout against it, and the named process groups.

The one place that reads the launcher's environment (STYLE.md item 2): ``detect()`` returns a
``WorldInfo`` for torchrun, ``srun`` (SLURM without torchrun), an MPI launcher (``mpiexec`` /
``mpirun``, through mpi4py) or a plain single process. Every other module takes the ``WorldInfo``
or asks ``ProcessGroups`` for a group by name; none reads ``RANK`` or ``SLURM_*`` itself.

Which launcher, in this order (the first that matches):

1. torchrun: ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set (also under ``srun torchrun``, where
   the SLURM variables describe the agents, not the trainers);
2. MPI: ``OMPI_COMM_WORLD_SIZE`` (Open MPI), or ``PMI_SIZE`` / ``PMI_RANK`` / ``PMIX_RANK`` /
   ``MPI_LOCALNRANKS`` (MPICH's Hydra, PMIx) outside a SLURM job step; rank and size then come from
   mpi4py's ``COMM_WORLD``, which needs the ``mpi`` extra;
3. SLURM: inside a job step (``SLURM_PROCID`` with ``SLURM_STEP_ID``), i.e. ``srun python ...``. Under
   ``srun --mpi=pmix`` the PMI variables are present too, and SLURM's own ranks are used (they agree);
4. single: none of these; one process. The batch script of an sbatch job is a single process too,
   even though ``SLURM_NTASKS`` says more: only ``srun`` starts the tasks.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import socket
import threading
import time
import weakref
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

from tgdist.distributed.schedule import Layout, num_global_batches, passes_per_group, segment_bounds
from tgdist.errors import ConfigError, RunFailure, first_line

log = logging.getLogger(__name__)

__all__ = [
    "WorldInfo",
    "LAUNCHERS",
    "PLACEMENTS",
    "detect",
    "which_launcher",
    "parse_torchrun",
    "parse_slurm",
    "parse_mpi",
    "expand_hostlist",
    "parse_tasks_per_node",
    "slurm_port",
    "validate",
    "ProcessGroups",
    "GROUP_NAMES",
    "get_group",
]

LAUNCHERS = ("torchrun", "slurm", "mpi", "single")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job. ``node_rank`` in ``[0, num_nodes)``; ``local_rank`` in
    ``[0, local_world_size)`` among the processes of this machine. ``master_addr:master_port`` is
    where rank 0 hosts the rendezvous store (torchrun: its agent's store)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "single"

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher {self.launcher!r} is not one of {LAUNCHERS}")
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size
                and 0 <= self.node_rank < self.num_nodes):
            raise ConfigError(f"inconsistent world from the {self.launcher} environment: {self}")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# ---------------------------------------------------------------- small parsers


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
    if default is None:
        raise ConfigError(f"environment variable {' or '.join(names)} is not set")
    return default


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ']' in SLURM host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"unbalanced '[' in SLURM host list {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, text: str) -> list[str]:
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise ConfigError(f"cannot read range {item!r} in SLURM host list {text!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)  # "01-03" keeps its zero padding
        if int(hi) < int(lo):
            raise ConfigError(f"descending range {item!r} in SLURM host list {text!r}")
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, e.g. ``"node[01-03,07],gpu5"`` -> ``["node01", "node02",
    "node03", "node07", "gpu5"]``; several brackets in one name give their product in order
    (``"r[1-2]n[1-2]"`` -> ``r1n1, r1n2, r2n1, r2n2``)."""
    hosts: list[str] = []
    for part in _split_top_level(text):
        names = [""]
        for m in re.finditer(r"([^\[]+)|\[([^\]]*)\]", part):
            if m.group(1) is not None:
                names = [n + m.group(1) for n in names]
            else:
                names = [n + suffix for n in names for suffix in _expand_range(m.group(2), text)]
        hosts += names
    if not hosts:
        raise ConfigError(f"empty SLURM host list {text!r}")
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` such as ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ConfigError(f"cannot read SLURM tasks per node {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """A port in [20000, 40000) that every task of a job step derives alike (a stable hash of the
    job and step ids: Python's ``hash`` differs between processes)."""
    return 20000 + zlib.crc32(f"{job_id}.{step_id}".encode()) % 20000


# ---------------------------------------------------------------- per-launcher parsing (pure)


def which_launcher(env: Mapping[str, str]) -> str:
    """The launcher that started this process, from the environment (see the module docstring)."""
    if all(env.get(v) not in (None, "") for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return "torchrun"
    in_slurm_step = env.get("SLURM_PROCID") not in (None, "") and env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) not in (None, "")
    if env.get("OMPI_COMM_WORLD_SIZE"):
        return "mpi"
    if not in_slurm_step and any(env.get(v) for v in ("PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS")):
        return "mpi"
    if in_slurm_step:
        return "slurm"
    return "single"


def parse_torchrun(env: Mapping[str, str]) -> WorldInfo:
    """torchrun (torch.distributed.run) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK (node), GROUP_WORLD_SIZE (nodes), MASTER_ADDR, MASTER_PORT."""
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", default=world)
    return WorldInfo(
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK"),
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", default=0),
        num_nodes=_int(env, "GROUP_WORLD_SIZE", default=max(1, world // local_world)),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", default=DEFAULT_PORT),
        launcher="torchrun",
    )


def parse_slurm(env: Mapping[str, str]) -> WorldInfo:
    """``srun`` tasks: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES; tasks
    per node from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (``"2(x3)"``) or
    SLURM_NTASKS_PER_NODE; the master is the first host of the step's node list (rank 0 runs there)
    unless MASTER_ADDR is set; the port is MASTER_PORT or a hash of the job and step ids."""
    world = _int(env, "SLURM_NTASKS", "SLURM_NPROCS")
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
    node_rank = _int(env, "SLURM_NODEID", default=0)
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_text:
        per_node = parse_tasks_per_node(per_node_text)
        local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    else:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", default=max(1, world // num_nodes))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    master = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    else:
        port = slurm_port(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0",
                          env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0")
    return WorldInfo(
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID", default=0),
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=master,
        master_port=port,
        launcher="slurm",
    )


@dataclass(frozen=True)
class MpiFacts:
    """What the MPI communicator says (``_mpi_facts``); kept apart so ``parse_mpi`` stays pure."""

    rank: int
    world_size: int
    hosts: list[str] = field(default_factory=list)  # hostname of every rank, by rank
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT


def parse_mpi(env: Mapping[str, str], facts: MpiFacts) -> WorldInfo:
    """MPI: rank and size from COMM_WORLD; the node layout from every rank's host name (nodes
    numbered by first appearance, so node 0 holds rank 0), falling back to the launcher's local
    variables (OMPI_COMM_WORLD_LOCAL_RANK/SIZE, MPI_LOCALRANKID/MPI_LOCALNRANKS)."""
    if facts.hosts:
        nodes = list(dict.fromkeys(facts.hosts))
        me = facts.hosts[facts.rank]
        local_ranks = [r for r, h in enumerate(facts.hosts) if h == me]
        local_rank, local_world = local_ranks.index(facts.rank), len(local_ranks)
        node_rank, num_nodes = nodes.index(me), len(nodes)
    else:
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", default=0)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=1)
        num_nodes = max(1, facts.world_size // local_world)
        node_rank = facts.rank // local_world
    return WorldInfo(
        rank=facts.rank,
        world_size=facts.world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=facts.master_addr,
        master_port=facts.master_port,
        launcher="mpi",
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_address() -> str:
    """An address other machines can reach this one by: the host name's IP when it resolves."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def _mpi_facts(env: Mapping[str, str]) -> MpiFacts:
    """Ask MPI: rank 0 picks its address and a free port (or MASTER_ADDR / MASTER_PORT) and
    broadcasts them, so every rank agrees on the rendezvous without shared files."""
    try:
        from mpi4py import MPI  # lazy: optional extra "mpi"
    except ImportError as e:
        raise ConfigError(
            "started by an MPI launcher but mpi4py is not installed: pip install 'tgdist[mpi]' "
            f"(or mpi4py) ({e})"
        ) from None
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    hosts = comm.allgather(socket.gethostname())
    master = None
    if rank == 0:
        master = (env.get("MASTER_ADDR") or _my_address(),
                  int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else _free_port())
    addr, port = comm.bcast(master, root=0)
    return MpiFacts(rank=rank, world_size=comm.Get_size(), hosts=hosts, master_addr=addr, master_port=port)


def detect(env: Mapping[str, str] | None = None) -> WorldInfo:
    """This process's ``WorldInfo``; reads the environment once (``os.environ`` by default)."""
    env = os.environ if env is None else env
    launcher = which_launcher(env)
    if launcher == "torchrun":
        return parse_torchrun(env)
    if launcher == "mpi":
        return parse_mpi(env, _mpi_facts(env))
    if launcher == "slurm":
        return parse_slurm(env)
    return WorldInfo(
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", default=DEFAULT_PORT),
    )


# ---------------------------------------------------------------- validation

# Where a memory store keeps node memory (its class's ``placement``, tgdist.memory.store), which
# decides how a memory group may be placed:
#   process:     inside one trainer process, so a memory group must be a single trainer (i*j == 1)
#   host_shared: in host shared memory served by a daemon per group (DistTGL 3.3): a group must sit
#                on one machine, and every machine needs a group of its own (k >= machines)
#   collective:  spread over / replicated in the trainers and exchanged by collectives (Sven,
#                DepCache, DepComm): no placement constraint
PLACEMENTS = ("process", "host_shared", "collective")


def _start_hint(world: WorldInfo, n: int) -> str:
    if world.launcher == "torchrun":
        return f"torchrun --nproc-per-node {n} (x nodes), or tgdist launch --nproc {n}"
    if world.launcher == "slurm":
        return f"sbatch/srun --ntasks {n}, e.g. --nodes N --ntasks-per-node {n}/N"
    if world.launcher == "mpi":
        return f"mpiexec -n {n}"
    return f"start {n} processes: tgdist launch --nproc {n} -- ..., or srun / mpiexec -n {n}"


def _check_world_size(layout: Layout, world: WorldInfo) -> None:
    if layout.world_size != world.world_size:
        raise ConfigError(
            f"parallel.i x parallel.j x parallel.k = {layout.i} x {layout.j} x {layout.k} = "
            f"{layout.world_size} but the world has {world.world_size} "
            f"process{'es' if world.world_size != 1 else ''} ({_start_hint(world, layout.world_size)})"
        )


def validate(
    layout: Layout,
    world: WorldInfo,
    memory_backend: str = "auto",
    *,
    placement: str = "host_shared",
    num_train_events: int | None = None,
    batch_size: int | None = None,
    epochs: int | None = None,
    device: str = "cpu",
    num_devices: int | None = None,
) -> None:
    """Check an ``i x j x k`` layout against the world before any training; raise ``ConfigError``
    with one line naming the problem. ``memory_backend``: the store's name (for the messages);
    ``placement``: where it keeps memory (``PLACEMENTS``, its class's ``placement``). Data-size
    checks run when the sizes are given."""
    i, j, k = layout.i, layout.j, layout.k
    _check_world_size(layout, world)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: one of {', '.join(PLACEMENTS)}")
    kind = placement
    if kind == "process" and layout.group_size > 1:
        raise ConfigError(
            f"memory.backend={memory_backend} keeps node memory inside one process, but parallel.i x parallel.j "
            f"= {i} x {j} trainers share each memory copy; leave memory.backend=auto, which picks a store for a "
            f"group, or name one that keeps a copy for several trainers"
        )
    if kind == "host_shared":
        if k < world.num_nodes:
            raise ConfigError(
                f"parallel.k = {k} memory copies for {world.num_nodes} machines: with memory.backend="
                f"{memory_backend} the memory lives in host shared memory, so every machine needs its "
                f"own copy (k >= machines, DistTGL 3.2.4); use parallel.k >= {world.num_nodes}"
            )
        if world.local_world_size % layout.group_size:
            raise ConfigError(
                f"a memory group of parallel.i x parallel.j = {i} x {j} = {layout.group_size} trainers "
                f"would span machines with {world.local_world_size} processes per machine; with "
                f"memory.backend={memory_backend} i*j must divide the processes per machine"
            )
    if device.startswith("cuda") and num_devices is not None and world.local_world_size > num_devices:
        raise ConfigError(
            f"{world.local_world_size} processes on this machine but {num_devices} GPU"
            f"{'s' if num_devices != 1 else ''}: one trainer per GPU"
        )
    if epochs is not None:
        passes_per_group(layout, epochs)
    if num_train_events is not None and batch_size is not None:
        nb = num_global_batches(num_train_events, i, batch_size)
        segment_bounds(nb, k)  # raises: fewer global batches than memory groups


# ---------------------------------------------------------------- process groups

# The named groups (every rank creates every group, in this order, as torch requires):
#   world:     all i*j*k ranks; gradient averaging (every rank is a replica of one model)
#   memory:    the i*j ranks sharing my memory copy (DistTGL's trainer group of one memory daemon);
#              memory resets, depcache/sven exchanges within a copy
#   minibatch: the i ranks that split my positive global batch (3.2.1); the barrier between all
#              reads and any write of a global batch (write-after-read hazard)
#   epoch:     the j ranks with my (ii, kk), one per subgroup, that train the same local slice with
#              different negatives (3.2.2); hand-over of prepared positive inputs
#   leaders:   rank (ii=0, jj=0) of every memory group, the writer of each copy; evaluation and
#              checkpoints of the k memory copies
GROUP_NAMES = ("world", "memory", "minibatch", "epoch", "leaders")


def _families(layout: Layout) -> dict[str, list[list[int]]]:
    return {
        "memory": layout.memory_groups(),
        "minibatch": layout.subgroups(),
        "epoch": layout.epoch_peer_groups(),
        "leaders": [[layout.memory_group_ranks(kk)[0] for kk in range(layout.k)]],
    }


def _check_resolves(host: str) -> None:
    """A ConfigError when ``host`` (the master's name) does not resolve: the ranks would retry
    for ten minutes, printing a warning every few seconds."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise ConfigError(f"the master address {host!r} (MASTER_ADDR, or the first host of SLURM's node list) does "
                          f"not resolve ({e.strerror or e}); set MASTER_ADDR to the host of rank 0") from None


@contextmanager
def _waiting_notice(rank: int, world_size: int, where: str, timeout: timedelta, first: float = 30.0):
    """While the ranks meet (``init_process_group`` blocks until all have come), rank 0 says after
    30 s, and then every minute, that it is still waiting and for how long it will: a machine
    that was never started looked like a hang, silent for the whole timeout."""
    done = threading.Event()

    def notice() -> None:
        start, interval = time.monotonic(), first
        while not done.wait(interval):
            log.warning("rank %d: still waiting for the other ranks (%d in all) to meet at %s after %.0f s; gives "
                        "up after %.0f s", rank, world_size, where, time.monotonic() - start,
                        timeout.total_seconds())
            interval = 60.0

    if rank == 0:
        threading.Thread(target=notice, name="tgdist-meeting-notice", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def disagreement(values: list[dict], what: str) -> str | None:
    """One line naming the keys in which a rank's ``values`` entry differs from rank 0's (the first
    such rank, and how many differ), or None when all agree. Ranks started by hand on several
    machines can be given other overrides; they would meet in collectives of other shapes."""
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if not differing:
        return None
    first, ref = differing[0], values[0]
    keys = sorted(k for k in set(ref) | set(values[first]) if ref.get(k) != values[first].get(k))
    shown = ", ".join(f"{k}: rank 0 {ref.get(k, '<unset>')} vs rank {first} {values[first].get(k, '<unset>')}"
                      for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    others = f" ({len(differing)} ranks differ from rank 0)" if len(differing) > 1 else ""
    return f"the ranks of this run were started with other {what}: {shown}{others}; start every rank with the same ones"


def _restart_store(world: WorldInfo, timeout: timedelta):
    """Under a torchrun restart (``--max-restarts``), the agent's store with a prefix of this
    attempt, else None (``env://``). The agent keeps its store across restarts, and the keys the
    dead attempt's ranks left (their gloo addresses) would have the new ranks wait to connect to
    them for the whole timeout."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if world.launcher != "torchrun" or attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(world.master_addr, int(world.master_port), world.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"tgdist/attempt_{attempt}/", agent)


class ProcessGroups:
    """The process groups of one run, built once by ``ProcessGroups.init`` and looked up by name
    (``get``) from every other module; ``destroy`` tears them down (idempotent)."""

    _current: "ProcessGroups | None" = None

    def __init__(self, world: WorldInfo, layout: Layout, backend: str, groups: dict,
                 members: dict[str, list[int]], initialised_dist: bool):
        self.world = world
        self.layout = layout
        self.backend = backend
        self._groups = groups
        self._members = members
        self._initialised_dist = initialised_dist
        self._destroyed = False
        self.leaked: list[str] = []  # groups still referenced after destroy (see there)

    @staticmethod
    def resolve_backend(backend: str = "auto", world: WorldInfo | None = None) -> str:
        """``auto``: nccl when CUDA is available and each process of a machine (``world``) can have
        a GPU of its own, gloo otherwise: NCCL refuses two ranks on one GPU ("Duplicate GPU
        detected"), while gloo lets them share it (collectives then pass through the CPU)."""
        backend = str(getattr(backend, "value", backend))
        if backend == "auto":
            import torch

            if not torch.cuda.is_available():
                return "gloo"
            per_machine = world.local_world_size if world is not None else 1
            if per_machine > torch.cuda.device_count():
                log.warning("%d processes on this machine share %d GPU(s): NCCL refuses that, so the process groups "
                            "use gloo (parallel.comm_backend=auto)", per_machine, torch.cuda.device_count())
                return "gloo"
            return "nccl"
        if backend not in ("gloo", "nccl", "mpi"):
            raise ConfigError(f"parallel.comm_backend={backend}: choose one of auto, gloo, nccl, mpi")
        return backend

    @classmethod
    def init(cls, world: WorldInfo, layout: Layout, backend: str = "auto",
             timeout: timedelta | float = timedelta(minutes=10), agree: dict | None = None,
             device: str | None = None) -> "ProcessGroups":
        """Initialise torch.distributed for ``world`` and create the named groups. ``agree``: what
        every rank must hold alike (the run's config), compared once the world group exists and
        before the named groups, which ranks of other layouts would make differently and hang on;
        a difference is a ``ConfigError`` on every rank (``disagreement``).

        torchrun: ``env://`` (workers join the agent's store that torchrun's c10d rendezvous set up);
        SLURM / MPI: ``tcp://master_addr:master_port`` with rank 0 hosting the store.
        With one process nothing is initialised, every group is the world of one (``get`` returns
        None) and the collective helpers of ``tgdist.distributed.collectives`` return their input.
        ``device``: the run's compute device; a CUDA one (or NCCL) makes the local rank's GPU
        (``local_rank % device_count``) the current device, also under gloo.
        """
        import torch
        import torch.distributed as dist

        if cls._current is not None and not cls._current._destroyed:
            raise RuntimeError("process groups are already initialised; call destroy() first")
        _check_world_size(layout, world)
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        backend = cls.resolve_backend(backend, world)
        if backend == "nccl" or (device is not None and str(device).startswith("cuda") and torch.cuda.is_available()):
            torch.cuda.set_device(world.local_rank % max(1, torch.cuda.device_count()))
        members = {"world": list(range(world.world_size))}
        groups: dict = {}
        if world.world_size == 1:  # nothing to talk to: no store, no port
            for name, family in _families(layout).items():
                members[name] = family[0]
                groups[name] = None
            groups["world"] = None
            pg = cls(world, layout, backend, groups, members, initialised_dist=False)
            cls._current = pg
            return pg
        # torch._dynamo (imported by the first optimizer) keeps ten references to the default group
        # when it is first imported after init_process_group; destroy() could then never free it.
        import torch._dynamo  # noqa: F401

        init_method = "env://" if world.launcher == "torchrun" else f"tcp://{world.master_addr}:{world.master_port}"
        if world.launcher != "torchrun":  # torchrun's rendezvous has found the master already
            _check_resolves(world.master_addr)
        where = f"{world.master_addr}:{world.master_port}" if world.launcher != "torchrun" else "torchrun's store"
        with _waiting_notice(world.rank, world.world_size, where, timeout):
            try:
                if (store := _restart_store(world, timeout)) is not None:
                    dist.init_process_group(backend=backend, store=store, rank=world.rank,
                                            world_size=world.world_size, timeout=timeout)
                else:
                    dist.init_process_group(backend=backend, init_method=init_method, rank=world.rank,
                                            world_size=world.world_size, timeout=timeout)
            except (dist.DistError, RuntimeError) as e:  # a rank that never came, a port another program holds
                raise RunFailure(f"rank {world.rank}: the {world.world_size} ranks did not meet at {where} within "
                                 f"{timeout.total_seconds():.0f} s ({first_line(e)[:200]}); check that every rank was "
                                 f"started and that nothing else listens on that port") from None
        groups["world"] = dist.group.WORLD
        if agree is not None:
            everyone: list = [None] * world.world_size
            dist.all_gather_object(everyone, agree)
            if (why := disagreement(everyone, "configs")) is not None:
                dist.destroy_process_group()
                raise ConfigError(why)
        for name, family in _families(layout).items():
            for ranks in family:  # every rank creates every group, in the same order
                g = dist.new_group(ranks=ranks, timeout=timeout, backend=backend)
                if world.rank in ranks:
                    groups[name], members[name] = g, ranks
            if name not in groups:  # not a member (only "leaders" has non-members)
                groups[name], members[name] = None, []
        pg = cls(world, layout, backend, groups, members, initialised_dist=True)
        cls._current = pg
        return pg

    @classmethod
    def current(cls) -> "ProcessGroups":
        if cls._current is None or cls._current._destroyed:
            raise RuntimeError("process groups are not initialised (ProcessGroups.init)")
        return cls._current

    @classmethod
    def release_single(cls) -> None:
        """Destroy the current groups if they are a world of one's, which hold nothing (a run of
        one process made and never trained, say): a new run of one process may start."""
        if cls._current is not None and not cls._current._initialised_dist:
            cls._current.destroy()

    def get(self, name: str):
        """The torch process group ``name`` (``None`` stands for the whole world of a single
        process, which the collective helpers accept)."""
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown process group {name!r}; groups: {', '.join(GROUP_NAMES)}")
        if self._destroyed:
            raise RuntimeError("process groups were destroyed")
        if not self._members[name]:
            raise ValueError(f"rank {self.world.rank} is not in process group {name!r}")
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of my group ``name`` (empty if I am not a member)."""
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown process group {name!r}; groups: {', '.join(GROUP_NAMES)}")
        return list(self._members[name])

    def is_member(self, name: str) -> bool:
        return bool(self._members.get(name))

    def destroy(self) -> None:
        """Destroy every group once and free them, so their threads are joined now (a group that
        is still referenced elsewhere is named in ``leaked`` and a warning); later calls do nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        if ProcessGroups._current is self:
            ProcessGroups._current = None
        if not self._initialised_dist:
            return
        import torch.distributed as dist

        alive = {name: weakref.ref(g) for name, g in self._groups.items() if g is not None}
        if dist.is_initialized():
            dist.destroy_process_group()
        # Gloo's shutdown is a no-op: a group's worker and socket threads stop only when the group
        # object is freed. One still referenced at interpreter exit keeps them running into
        # finalization, where they can abort the process ("terminate called without an active
        # exception") after a run that succeeded. So drop our references and collect now; whoever
        # kept a group of their own must drop it before calling destroy.
        self._groups = dict.fromkeys(self._groups)
        gc.collect()
        self.leaked = sorted(name for name, ref in alive.items() if ref() is not None)
        if self.leaked:
            log.warning("process groups %s are still referenced after destroy; their threads run until "
                        "exit", ", ".join(self.leaked))

    def __enter__(self) -> "ProcessGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def get_group(name: str):
    """The current run's process group ``name`` (see ``GROUP_NAMES``)."""
    return ProcessGroups.current().get(name)
