"""``tgdist partition [hydra overrides]``: pre-sample an epoch, assign node memory, write an artifact.

    tgdist partition data=wikipedia partition.method=reflexbicut partition.num_parts=8
    tgdist partition data=file data.path=events.csv partition=range partition.out_dir=parts/range

The artifact directory (``partition.out_dir``, default ``partitions/<data>-<method>-M<M>``) holds
the dual-hash maps, C, the measures (also of range and interval, for comparison), the residual
heatmap and metadata; see ``tgdist.partition.artifact``. Progress goes to stderr, the summary to
stdout. Errors are one line on stderr and exit status 2.
"""

from __future__ import annotations

import datetime
import platform
import sys
import time
from pathlib import Path

import hydra
import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import tgdist
from tgdist.config.overrides import ConfigSource, precheck_command, run_composed, run_sweep
from tgdist.config import PartitionConfig, PartitionJob, config_dir, register_schemas
from tgdist.data.load import load_data
from tgdist.errors import ConfigError, TgdistError, log_warnings_as_lines
from tgdist.partition import artifact, measures, methods
from tgdist.partition.access import WEIGHTS, build_access_graph
from tgdist.partition.idmap import DualHashMap
from tgdist.progress import Status

register_schemas()


def _say(enabled: bool):
    def say(msg: str) -> None:
        if enabled:
            print(f"tgdist partition: {msg}", file=sys.stderr, flush=True)
    return say


def validate(cfg: PartitionConfig) -> None:
    """Reject bad settings before any data is read."""
    if cfg.num_parts < 1:
        raise ConfigError(f"partition.num_parts must be >= 1, got {cfg.num_parts}")
    if cfg.batch_size < cfg.num_parts:
        raise ConfigError(f"partition.batch_size ({cfg.batch_size}) must be >= partition.num_parts ({cfg.num_parts})")
    if cfg.num_neg < 0:
        raise ConfigError(f"partition.num_neg must be >= 0, got {cfg.num_neg}")
    if not cfg.imbalance >= 0:
        raise ConfigError(f"partition.imbalance must be >= 0, got {cfg.imbalance}")
    if not 0 < cfg.tolerance < 1:
        raise ConfigError(f"partition.tolerance must lie in (0, 1), got {cfg.tolerance}")


def out_dir_of(job: PartitionJob) -> Path:
    p = job.partition
    return Path(p.out_dir) if p.out_dir else Path("partitions") / f"{job.data.name}-{p.method}-M{p.num_parts}"


def run(job: PartitionJob) -> Path:
    """The whole command on a composed config; returns the artifact directory."""
    from tgdist.data.graph import chronological_split

    p = job.partition
    validate(p)
    say = _say(p.progress)
    out = out_dir_of(job)
    artifact.check_out_dir(out, p.overwrite)  # before the data is read and pre-sampled
    start = time.perf_counter()
    graph = load_data(job.data)
    split = chronological_split(graph, job.data.val_frac, job.data.test_frac)
    say(f"{graph.describe()}; pre-sampling {split.train_end:,} training events")
    if p.num_parts > graph.num_nodes:
        print(f"tgdist partition: warning: {p.num_parts} parts for {graph.num_nodes:,} nodes: at least "
              f"{p.num_parts - graph.num_nodes:,} parts will own no node memory", file=sys.stderr, flush=True)
    fanouts = tuple(job.sampler.fanouts) if p.neighbors else ()
    with Status("tgdist partition", enabled=p.progress) as status:  # on a terminal only
        access = build_access_graph(graph, num_parts=p.num_parts, batch_size=p.batch_size, train_end=split.train_end,
                                    fanouts=fanouts, strategy=job.sampler.strategy, num_neg=p.num_neg, seed=p.seed,
                                    both_directions=job.sampler.both_directions, num_threads=job.sampler.num_threads,
                                    per_batch=p.per_batch, progress=status.set)
    say(f"pre-sampled {access.num_batches:,} batches in {access.seconds:.1f} s")
    t0 = time.perf_counter()
    n, m = graph.num_nodes, p.num_parts
    w = access.weights(p.weights)
    if p.method == "reflexbicut":
        with Status("tgdist partition", enabled=p.progress) as status:
            res = methods.reflexbicut_search(w, imbalance=p.imbalance, seed=p.seed, tolerance=p.tolerance,
                                             progress=status.set)
        owner, info = res.owner, {"budget": res.budget, "searches": res.searches, "rounds": res.rounds,
                                  "moves": res.moves}
    else:
        with Status("tgdist partition", enabled=p.progress) as status:
            status.set(f"assigning {n:,} nodes ({p.method})")
            owner, info = methods.assign(access, p.method, weights=p.weights, imbalance=p.imbalance, seed=p.seed), {}
    assign_s = time.perf_counter() - t0
    owners = {p.method: owner}
    for base in ("range", "interval"):
        owners.setdefault(base, methods.assign(access, base))
    evals = {name: measures.evaluate(access, o) for name, o in owners.items()}
    cap = methods.capacity(n, m, p.imbalance)
    meas = {"method": p.method, "weights": p.weights, "capacity": cap,
            "lower_bound": {k: measures.lower_bound(access.weights(k), m, cap) for k in WEIGHTS},
            "measures": evals[p.method], "baselines": {k: v for k, v in evals.items() if k != p.method}, **info}
    chosen = evals[p.method]
    maps = DualHashMap.from_assignment(owner, m)
    meta = {
        "data": {"name": job.data.name, "source_hash": graph.source_hash, "num_nodes": n,
                 "num_events": graph.num_events, "train_events": split.train_end, "path": job.data.path},
        "num_parts": m, "method": p.method, "batch_size": p.batch_size, "fanouts": list(fanouts),
        "K": fanouts[0] if fanouts else 0, "L": len(fanouts), "strategy": job.sampler.strategy, "num_neg": p.num_neg,
        "seed": p.seed, "weights": p.weights, "imbalance": p.imbalance, "batch_split": "chronological",
        "seconds": {"access_graph": round(access.seconds, 3), "assign": round(assign_s, 3),
                    "total": round(time.perf_counter() - start, 3)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tgdist": tgdist.__version__, "python": platform.python_version(),
        "config": OmegaConf.to_container(OmegaConf.structured(job)),
    }
    arrays = {"owner": owner}
    for k in WEIGHTS:
        arrays[f"comm_{k}"] = np.asarray(chosen[k]["comm"], dtype=np.int64)
        arrays[f"residual_{k}"] = np.asarray(chosen[k]["residual"], dtype=np.int64)
    residuals = None
    if p.plot:
        shown = dict.fromkeys(["range", "interval", p.method])  # Sven Fig. 7's two, then ours
        residuals = {name: np.asarray(evals[name][p.weights]["residual"]) for name in shown}
    out = artifact.save(out, maps=maps, metadata=meta, measures=meas, arrays=arrays, residuals=residuals,
                        overwrite=p.overwrite, warn=say)
    cost = {name: e[p.weights]["balance_cost"] for name, e in evals.items()}
    others = ", ".join(f"{k} {v:,}" for k, v in cost.items() if k != p.method)
    print(f"wrote {out}: {p.method} balance cost {cost[p.method]:,} ({p.weights}; {others}; "
          f"lower bound {meas['lower_bound'][p.weights]:,}), sizes {min(chosen['sizes'])}..{max(chosen['sizes'])}")
    return out


def _job(cfg) -> None:
    """The partitioning, inside Hydra's job (a run, or a job of a sweep)."""
    from tgdist.kernels.interrupts import hold_interrupts_during_compiles
    from tgdist.kernels.jit import announce_compiles

    hold_interrupts_during_compiles("tgdist partition")  # Ctrl-C inside a numba compile crashes at exit
    announce_compiles("tgdist partition")
    log_warnings_as_lines("tgdist partition")  # this command's Hydra config sets up no logging
    try:
        try:
            job: PartitionJob = OmegaConf.to_object(cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        run(job)
    except TgdistError as e:
        print(f"tgdist partition: error: {e}", file=sys.stderr)
        sys.exit(2)


# Hydra's own flags (``--cfg job``, ``--info``, ``--help``): Hydra reads the command line itself
_hydra_main = hydra.main(version_base=None, config_path=config_dir(), config_name="partition_job")(_job)


def main() -> None:
    """The overrides checked and the config composed once, then the job started with it as
    Hydra's ``@hydra.main`` starts one (a sweep: its config and each job's composed once)."""
    args, full, sweep = precheck_command("tgdist partition", "partition_job", sys.argv[1:],
                                         lambda cfg: validate(cfg.partition), __file__, return_hydra_config=True)
    source = ConfigSource.of(args, "partition_job", __file__) if args is not None else None
    if sweep is not None:
        run_sweep(sweep, _job, source)
    elif full is not None:
        run_composed(full, _job, source)
    else:
        _hydra_main()


if __name__ == "__main__":
    main()
