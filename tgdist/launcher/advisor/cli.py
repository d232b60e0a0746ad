"""``tgdist plan --profile`` and ``tgdist plan --from-profile``: the advisor on the command line.

    tgdist plan --profile data=wikipedia --out wiki.json                    # measure, write the profile
    tgdist plan --profile data=wikipedia --cluster gpu-4x8-ib100 --top 5     # measure, then advise
    tgdist plan --from-profile wiki.json --cluster my.yaml --top 5 --sweep advice/ --png top.png

Prints the ranked table, the refused combinations with their reasons, and the best candidate as a
``tgdist launch`` line and an sbatch line; ``--json`` prints every candidate as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from tgdist.errors import ConfigError
from tgdist.launcher.advisor import cluster as clusters
from tgdist.launcher.advisor import profile as profiles
from tgdist.launcher.advisor import report
from tgdist.launcher.advisor.model import PIPELINES, predict

__all__ = ["main", "wants_advisor"]

BACKENDS = ("local", "daemon", "depcache", "depcomm", "sven")


def wants_advisor(argv: list[str]) -> bool:
    """Whether ``tgdist plan``'s arguments are the advisor's (``--profile`` or ``--from-profile``)."""
    return any(a in ("--profile", "--from-profile") or a.startswith("--from-profile=") for a in argv)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: give a positive integer")
    return v


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tgdist plan --profile",
        description="Profile the data on this machine, then predict every layout's epoch time and memory on a "
                    "cluster and rank them (DistTGL 3.2.4, Sven eq. (7)-(12), MSPipe's staleness bound).",
        epilog=f"clusters: {', '.join(clusters.PRESETS)}, or a YAML file (docs/advisor.md)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", nargs="*", metavar="OVERRIDE",
                     help="take a profile of the data these Hydra overrides name (e.g. data=wikipedia model=tgn)")
    src.add_argument("--from-profile", metavar="FILE", help="advise from a profile taken before")
    ap.add_argument("--out", metavar="FILE", help="where --profile writes the profile (default: profile.json)")
    ap.add_argument("--batch-sizes", type=_positive, nargs="+", default=[200, 600, 1200], metavar="B",
                    help="local batch sizes to profile (default: 200 600 1200)")
    ap.add_argument("--iterations", type=_positive, default=30, help="timed iterations per batch size (default 30)")
    ap.add_argument("--warmup", type=_positive, default=10, help="iterations before the timed ones (default 10)")
    ap.add_argument("--parts", type=_positive, nargs="*", default=[2, 4], metavar="M",
                    help="trainer counts at which to measure each placement (default: 2 4)")
    ap.add_argument("--methods", nargs="+", default=["range", "interval", "reflexbicut"],
                    help="partition methods to measure (default: range interval reflexbicut)")
    ap.add_argument("--threads", type=_positive, default=1, help="threads of the profiled trainer (default 1, as a "
                    "rank of a parallel run on this machine)")
    ap.add_argument("--largest-batch", type=_positive, metavar="L",
                    help="DistTGL's L (largest global batch without accuracy loss); default: a short sweep of "
                         "validation AP")
    ap.add_argument("--accuracy-events", type=_positive, metavar="N",
                    help="training events of each accuracy-sweep run (default: one whole pass)")
    ap.add_argument("--ap-tolerance", type=float, default=0.01, help="L: AP within this of the best (default 0.01)")
    ap.add_argument("--no-collectives", action="store_true",
                    help="skip timing collectives between two processes (idle, and as two sven trainers pay them) "
                         "and the sharing of the cores")
    ap.add_argument("--cluster", metavar="NAME|FILE", help="the cluster to advise for (a preset or a YAML file)")
    ap.add_argument("--batch", type=_positive, nargs="+", metavar="B",
                    help="local batch sizes of the candidates (default: the profile's saturation batch S)")
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="memory stores to consider")
    ap.add_argument("--pipelines", nargs="+", choices=list(PIPELINES), default=list(PIPELINES),
                    help="pipeline levels to consider")
    ap.add_argument("--placements", nargs="+", help="partition methods for sven / depcomm (default: the profile's)")
    ap.add_argument("--epochs", type=_positive, default=report.DEFAULT_EPOCHS,
                    help="epochs of the launch lines (rounded up to a multiple of j*k)")
    ap.add_argument("--top", type=_positive, default=10, help="rows of the table, candidates of --sweep (default 10)")
    ap.add_argument("--sweep", metavar="DIR", help="write the Hydra multirun over the top candidates into DIR")
    ap.add_argument("--png", metavar="FILE", help="draw the top candidates' stacked stage times")
    ap.add_argument("--json", action="store_true", help="print every candidate as one JSON object (no table)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.profile is not None:
        if args.out is None and args.cluster is None:
            args.out = "profile.json"
        if not 0 < args.ap_tolerance < 1:
            raise ConfigError(f"--ap-tolerance {args.ap_tolerance}: give an AP difference in (0, 1)")
        from tgdist.launcher.advisor.measure import measure

        prof = measure(args.profile, batch_sizes=args.batch_sizes, iterations=args.iterations, warmup=args.warmup,
                       parts=args.parts, methods=args.methods, threads=args.threads,
                       largest_batch=args.largest_batch, accuracy_events=args.accuracy_events,
                       ap_tolerance=args.ap_tolerance, collectives=not args.no_collectives)
        if args.out:
            profiles.write(prof, args.out)
            print(f"tgdist plan --profile: wrote {args.out} (S = {prof.saturation_batch}, L = {prof.largest_batch})",
                  file=sys.stderr)
    else:
        prof = profiles.read(args.from_profile)
    if args.cluster is None:
        if args.from_profile:
            raise ConfigError("--from-profile needs --cluster NAME|FILE: the cluster to advise for")
        return 0
    cl = clusters.cluster_of(args.cluster)
    ranked = predict(prof, cl, batch_sizes=args.batch, backends=args.backends, pipelines=args.pipelines,
                     placements=args.placements)
    data = list(prof.data.get("overrides", []))
    top = report.best(ranked)
    if args.json:
        print(json.dumps({"cluster": cl.as_json(), "profile": {"S": prof.saturation_batch, "L": prof.largest_batch},
                          "best": None if top is None else report.launch_lines(top, cl, data, args.epochs),
                          "candidates": [c.as_json() for c in ranked]}, default=str))
    else:
        print(f"{cl.name}: {cl.machines} machine(s) x {cl.trainers_per_machine} trainer(s), links "
              f"{cl.intra_link} / {cl.inter_link}; profile of {prof.data.get('name')} ({prof.machine}), "
              f"S = {prof.saturation_batch}, L = {prof.largest_batch} ({prof.accuracy_source})")
        took = prof.data.get("device")
        if took is not None and took != cl.device:
            print(f"note: the profile was taken on {took}, the cluster's trainers are {cl.device}: its stage times do "
                  f"not carry over; take the profile on one of the cluster's devices (train.device={cl.device})")
        print(report.table(ranked, args.top))
        if text := report.refusals(ranked):
            print(text)
    if top is None:
        raise ConfigError(f"no combination runs on {cl.name}: every one is refused (see the reasons above)")
    lines = report.launch_lines(top, cl, data, args.epochs)
    if not args.json:
        beyond = " (every candidate's global batch is beyond L: give a smaller --batch)" if top.risk_level >= 2 else ""
        print(f"best: {top.label()}: {top.epoch_s:.2f} s per epoch predicted{beyond}")
        print(f"  {lines['launch']}")
        print(f"  {lines['sbatch']}")
    if args.png:
        report.draw(ranked, args.png, min(args.top, 12), title=f"{prof.data.get('name')} on {cl.name}")
        print(f"tgdist plan: wrote {args.png}", file=sys.stderr)
    if args.sweep:
        cmd = report.write_sweep(ranked, cl, data, args.sweep, args.top, args.epochs)
        print(f"sweep over the top {args.top}: {cmd}")
    return 0
