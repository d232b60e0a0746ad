"""What the advisor prints and writes: the ranked table, a PNG of the top candidates' stage times,
the best candidate as a ``tgdist launch`` line and an sbatch line, and the Hydra multirun over the
top N (``--top N --sweep DIR``): one experiment file per candidate under ``DIR/experiment/`` and the
one command that runs them all, so the prediction can be checked with real runs."""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

from tgdist.errors import ConfigError
from tgdist.launcher.advisor.cluster import Cluster
from tgdist.launcher.advisor.model import Candidate, pipeline_options

__all__ = ["TIE", "table", "refusals", "launch_lines", "write_sweep", "draw", "run_overrides", "best"]

DEFAULT_EPOCHS = 5  # TrainConfig.epochs: the launch line's epochs are the fewest multiple of j*k at least this


def _epochs(c: Candidate, epochs: int) -> int:
    m = c.j * c.k
    return -(-epochs // m) * m


def run_overrides(c: Candidate, cluster: Cluster, data: list[str], epochs: int = DEFAULT_EPOCHS) -> list[str]:
    """The full override list of a candidate's run: the data's (less the keys the candidate sets),
    the candidate's, the epochs."""
    own = [*c.overrides(cluster), f"train.epochs={_epochs(c, epochs)}"]
    keys = {o.split("=", 1)[0].lstrip("+") for o in own}
    return [*(d for d in data if d.split("=", 1)[0].lstrip("+") not in keys), *own]


TIE = 0.05  # predicted epochs this close to the fastest are not told apart: the least accuracy risk wins


def best(ranked: list[Candidate], tie: float = TIE) -> Candidate | None:
    """The candidate to run: among those predicted within ``tie`` of the fastest whose global batch
    is within L (``predict`` ranks those first), the one with the least accuracy risk (staleness,
    epoch parallelism), then the fastest. A gain the model cannot resolve is not worth a risk the
    papers measured."""
    ok = [c for c in ranked if c.refused is None]
    if not ok:
        return None
    first = ok[0]
    close = [c for c in ok if (c.risk_level >= 2) == (first.risk_level >= 2) and c.epoch_s <= first.epoch_s * (1 + tie)]
    return min(close, key=lambda c: (c.risk_level, c.epoch_s))


def _gb(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def table(ranked: list[Candidate], top: int = 10) -> str:
    ok = [c for c in ranked if c.refused is None][:top]
    head = (f"{'#':>3} {'i x j x k':<9} {'memory':<20} {'pipeline':<15} {'batch':>5} {'epoch s':>8} {'iter ms':>8} "
            f"{'GiB/rank':>8} {'GiB/host':>8} {'MB/epoch':>9} {'n':>2} {'K':>2}  accuracy risk")
    rows = [head, "-" * len(head)]
    for r, c in enumerate(ok, 1):
        mem = c.backend + (f"/{c.placement}" if c.placement else "")
        risk = "; ".join(c.risk) if c.risk else "-"
        rows.append(f"{r:>3} {c.layout:<9} {mem:<20} {c.pipeline:<15} {c.batch_size:>5} {c.epoch_s:>8.2f} "
                    f"{1e3 * c.iteration_s:>8.2f} {_gb(c.memory_per_rank_gb):>8} {_gb(c.host_per_machine_gb):>8} "
                    f"{c.bytes_per_epoch / 1e6:>9.1f} {c.micro_batches:>2} {c.staleness:>2}  {risk}")
    return "\n".join(rows)


def refusals(ranked: list[Candidate], limit: int = 8) -> str:
    """The refused combinations, grouped by reason (the most frequent first)."""
    why = Counter(c.refused for c in ranked if c.refused)
    if not why:
        return ""
    lines = [f"refused: {sum(why.values())} combination(s)"]
    for reason, n in why.most_common(limit):
        example = next(c for c in ranked if c.refused == reason)
        lines.append(f"  {n:>3} x  e.g. {example.label()}: {reason}")
    if len(why) > limit:
        lines.append(f"  ... and {len(why) - limit} other reason(s) (--json lists every one)")
    return "\n".join(lines)


def launch_lines(c: Candidate, cluster: Cluster, data: list[str], epochs: int = DEFAULT_EPOCHS) -> dict:
    """The candidate as a ``tgdist launch`` line (on each machine) and as an sbatch line."""
    ov = " ".join(shlex.quote(o) for o in run_overrides(c, cluster, data, epochs))
    Q, P = cluster.trainers_per_machine, cluster.machines
    if P == 1:
        launch = f"tgdist launch --nproc {Q} -- {ov}"
    else:
        launch = f"tgdist launch --nproc {Q} --nnodes {P} --node-rank R --master-addr FIRST_NODE -- {ov}"
    gpus = (f" --gpus-per-node {Q}" if cluster.device == "cuda"
            else f" --ntasks-per-node 1 --export ALL,NPROC_PER_NODE={Q}")
    return {"launch": launch, "sbatch": f"sbatch --nodes {P}{gpus} slurm/multinode_gpu.sbatch {ov}"}


def _experiment_yaml(c: Candidate, cluster: Cluster, epochs: int, predicted: str) -> str:
    """One candidate as an experiment file (``# @package _global_``): its pipeline group as a default,
    the rest as keys."""
    group = next((o.split("=", 1)[1] for o in pipeline_options()[c.pipeline].overrides if o.startswith("pipeline=")),
                 None)  # a strategy without a preset of its own: its keys only, over the default preset
    keys: dict[str, dict] = {}
    for o in run_overrides(c, cluster, [], epochs):
        key, value = o.split("=", 1)
        if key == "pipeline":
            continue
        top, sub = key.split(".", 1)
        keys.setdefault(top, {})[sub] = value
    lines = ["# @package _global_", f"# tgdist plan's candidate {c.label()}: {predicted}",
             *(["defaults:", f"  - override /pipeline: {group}"] if group else [])]
    for top, sub in keys.items():
        lines.append(f"{top}:")
        lines += [f"  {k}: {v}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def write_sweep(ranked: list[Candidate], cluster: Cluster, data: list[str], out: str | Path, top: int,
                epochs: int = DEFAULT_EPOCHS, overwrite: bool = False) -> str:
    """``out/experiment/advice_NN.yaml`` for the top candidates and ``out/sweep.sh`` with the multirun
    that runs them (locally on one machine, on SLURM for several); returns that command. A sweep
    there already (``sweep.sh`` or an ``advice_NN.yaml``) is refused, or with ``overwrite`` removed
    first, so no file of an older sweep stays beside the new one."""
    out = Path(out).resolve()
    old = [f for f in (out / "sweep.sh", *sorted((out / "experiment").glob("advice_*.yaml"))) if f.exists()]
    if old and not overwrite:
        raise ConfigError(f"--sweep {out} holds {old[0].relative_to(out)} already: give another folder, or "
                          f"--overwrite to replace the sweep's files")
    for f in old:
        f.unlink()
    (out / "experiment").mkdir(parents=True, exist_ok=True)
    ok = [c for c in ranked if c.refused is None][:top]
    names = []
    for r, c in enumerate(ok, 1):
        name = f"advice_{r:02d}"
        predicted = f"predicted {c.epoch_s:.2f} s per epoch, {c.memory_per_rank_gb:.2f} GiB per rank"
        (out / "experiment" / f"{name}.yaml").write_text(_experiment_yaml(c, cluster, epochs, predicted))
        names.append(name)
    search = shlex.quote(f"hydra.searchpath=[file://{out}]")
    data_ov = " ".join(shlex.quote(d) for d in data)
    Q, P = cluster.trainers_per_machine, cluster.machines
    runs = shlex.quote(f"run_dir={out}/runs")
    if P == 1:
        cmd = f"tgdist launch --nproc {Q} -- -m {search} experiment={','.join(names)} {data_ov} {runs}"
    else:
        gpus = f" hydra.launcher.gpus_per_node={Q}" if cluster.device == "cuda" else f" hydra.launcher.nodes={P}"
        cmd = (f"tgdist launch -- -m {search} experiment={','.join(names)} {data_ov} {runs} "
               f"hydra/launcher=submitit_slurm{gpus}")
    (out / "sweep.sh").write_text("#!/bin/bash\n# the top candidates of tgdist plan, run to check its prediction\n"
                                  f"set -euo pipefail\n{cmd} \"$@\"\n")
    (out / "sweep.sh").chmod(0o755)
    return cmd


def draw(ranked: list[Candidate], path: str | Path, top: int = 8, title: str = "") -> None:
    """Stacked stage seconds per epoch (each stage as if alone on the critical path) of the top
    candidates, the predicted epoch (with the pipeline's overlap and shared cores) as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in ranked if c.refused is None][:top]
    stages = ["sample", "features", "memory_read", "dispatch", "compute", "memory_write", "aggregation", "allreduce",
              "collective_cpu", "straggler"]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(ok) + 1.8))
    colors = plt.get_cmap("tab10").colors
    for y, c in enumerate(ok):
        left = 0.0
        for s, col in zip(stages, colors):
            v = c.stages.get(s, 0.0)
            ax.barh(y, v, left=left, color=col, label=s if y == 0 else None, height=0.6)
            left += v
        ax.plot([c.epoch_s, c.epoch_s], [y - 0.4, y + 0.4], color="black", lw=2.5,
                label="predicted epoch" if y == 0 else None)
    ax.set_yticks(range(len(ok)), [c.label() for c in ok], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per epoch (stages unoverlapped; the tick is the prediction)")
    ax.set_title(title or "tgdist plan: top candidates", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
