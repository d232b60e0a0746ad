"""``tgdist plan --profile`` and ``tgdist plan --from-profile``: the advisor on the command line
(docs/advisor.md).

    tgdist plan --profile data=wikipedia --quick --cluster cpu-2-eth10     # the first step: ~3 min here
    tgdist plan --profile data=wikipedia --out wiki.json                    # the full profile
    tgdist plan --from-profile wiki.json --cluster my.yaml --top 5 --sweep advice/ --png top.png

``--profile`` always writes its profile (``--out``, default ``profile.json``) before it advises, so
another cluster reuses it with ``--from-profile``. Every input is checked before any measuring (the
cluster, the output paths, the overrides), each error one line; no existing file is replaced without
``--overwrite``. Prints the ranked table, the refused combinations with their reasons, and the best
candidate as a ``tgdist launch`` line and an sbatch line; ``--json`` prints every candidate as one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tgdist.errors import ConfigError
from tgdist.launcher.advisor import cluster as clusters
from tgdist.launcher.advisor import profile as profiles
from tgdist.launcher.advisor import report
from tgdist.launcher.advisor import model
from tgdist.launcher.advisor.model import predict

__all__ = ["main", "wants_advisor"]


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


# the profile's settings: the full one (the defaults) and --quick's (at most 3 minutes on a 2-core CPU for
# Wikipedia; docs/advisor.md gives its error against the full profile)
FULL = {"batch_sizes": [200, 600, 1200], "iterations": 30, "warmup": 10, "parts": [2, 4],
        "methods": ["range", "interval", "reflexbicut"]}
QUICK = {"batch_sizes": [300, 1200], "iterations": 10, "warmup": 3, "parts": [2, 4], "methods": ["reflexbicut"]}
QUICK_MEASURE = {"accuracy": False, "spread": 20, "collective_repeats": 10, "sharing_rounds": 1, "sharing_work": 600,
                 "paid": False}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tgdist plan --profile",
        description="Profile the data on this machine, then predict every layout's epoch time and memory on a "
                    "cluster and rank them (DistTGL 3.2.4, Sven eq. (7)-(12), MSPipe's staleness bound). "
                    "Start with --quick.",
        epilog=f"clusters: {', '.join(clusters.PRESETS)}, or a YAML file. The guide: docs/advisor.md")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", nargs="*", metavar="OVERRIDE",
                     help="take a profile of the data these Hydra overrides name (e.g. data=wikipedia model=tgn)")
    src.add_argument("--from-profile", metavar="FILE", help="advise from a profile taken before")
    ap.add_argument("--quick", action="store_true",
                    help=f"a short profile (batches {' '.join(map(str, QUICK['batch_sizes']))}, "
                         f"{QUICK['iterations']} iterations, one placement method, collectives idle only, no accuracy "
                         "sweep for L): the first step, under 3 min on 2 cores for Wikipedia; the flags below still "
                         "apply")
    ap.add_argument("--out", metavar="FILE",
                    help="where --profile writes the profile, always, before any advice (default: profile.json)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace files --out, --png and --sweep would write that exist already (refused otherwise)")
    ap.add_argument("--batch-sizes", type=_positive, nargs="+", metavar="B",
                    help=f"local batch sizes to profile (default: {' '.join(map(str, FULL['batch_sizes']))})")
    ap.add_argument("--iterations", type=_positive, help=f"timed iterations per batch size (default {FULL['iterations']})")
    ap.add_argument("--warmup", type=_positive, help=f"iterations before the timed ones (default {FULL['warmup']})")
    ap.add_argument("--parts", type=_positive, nargs="*", metavar="M",
                    help=f"trainer counts at which to measure each placement (default: "
                         f"{' '.join(map(str, FULL['parts']))})")
    ap.add_argument("--methods", nargs="+",
                    help=f"partition methods to measure (default: {' '.join(FULL['methods'])})")
    ap.add_argument("--threads", type=_positive, default=1, help="threads of the profiled trainer (default 1, as a "
                    "rank of a parallel run on this machine)")
    ap.add_argument("--largest-batch", type=_positive, metavar="L",
                    help="DistTGL's L (largest global batch without accuracy loss); default: a short sweep of "
                         "validation AP (none with --quick)")
    ap.add_argument("--accuracy-events", type=_positive, metavar="N",
                    help="training events of each accuracy-sweep run (default: one whole pass)")
    ap.add_argument("--ap-tolerance", type=float, default=0.01, help="L: AP within this of the best (default 0.01)")
    ap.add_argument("--no-collectives", action="store_true",
                    help="skip timing collectives between two processes (idle, and as two trainers of a partitioned "
                         "store pay them) and the sharing of the cores")
    ap.add_argument("--cluster", metavar="NAME|FILE", help="the cluster to advise for (a preset or a YAML file)")
    ap.add_argument("--batch", type=_positive, nargs="+", metavar="B",
                    help="local batch sizes of the candidates (default: the profile's saturation batch S)")
    ap.add_argument("--backends", nargs="+", metavar="STORE",
                    help="memory stores to consider (default: every registered one, extensions included)")
    ap.add_argument("--pipelines", nargs="+", metavar="PIPELINE",
                    help="pipelines to consider: presets of configs/pipeline/ and registered strategies without "
                         "one (default: all)")
    ap.add_argument("--placements", nargs="+", help="partition methods for the partitioned stores (default: the profile's)")
    ap.add_argument("--epochs", type=_positive, default=report.DEFAULT_EPOCHS,
                    help="epochs of the launch lines (rounded up to a multiple of j*k)")
    ap.add_argument("--top", type=_positive, default=10, help="rows of the table, candidates of --sweep (default 10)")
    ap.add_argument("--sweep", metavar="DIR", help="write the Hydra multirun over the top candidates into DIR "
                                                   "(DIR/sweep.sh, DIR/experiment/advice_NN.yaml)")
    ap.add_argument("--png", metavar="FILE", help="draw the top candidates' stacked stage times")
    ap.add_argument("--json", action="store_true", help="print every candidate as one JSON object (no table)")
    return ap


def _check_file(path: str, option: str, overwrite: bool) -> Path:
    """An output file ``option`` names: its folder exists and takes files, and it is not there
    already (unless ``overwrite``); else one line."""
    from tgdist.data.graph import unwritable

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {path}: a folder; give a file name")
    folder = p.parent
    if not folder.exists():
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist")
    if (why := unwritable(folder)) is not None:
        raise ConfigError(f"{option} {path}: cannot write in {folder} ({why})")
    if p.exists() and not overwrite:
        raise ConfigError(f"{option} {path} exists: give another name, or --overwrite to replace it")
    return p


def _check_sweep(path: str, overwrite: bool) -> None:
    """``--sweep DIR``: DIR can be made or written, and holds no sweep of before (unless ``overwrite``)."""
    from tgdist.data.graph import unwritable

    d = Path(path)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"--sweep {path}: a file, not a folder")
    if (why := unwritable(d)) is not None:
        raise ConfigError(f"--sweep {path}: cannot write there ({why})")
    there = [f for f in (d / "sweep.sh", *sorted((d / "experiment").glob("advice_*.yaml"))) if f.exists()]
    if there and not overwrite:
        raise ConfigError(f"--sweep {path} holds {there[0].relative_to(d)}{' and more' if len(there) > 1 else ''} "
                          f"already: give another folder, or --overwrite to replace the sweep's files")


def _check_png(path: str, overwrite: bool) -> None:
    _check_file(path, "--png", overwrite)
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install 'tgdist[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in kinds:
        raise ConfigError(f"--png {path}: give a file name ending in .png (or another of matplotlib's: "
                          f"{', '.join(sorted(kinds))})")


def _settings(args) -> dict:
    """The profile's settings: the flags given, else --quick's or the full profile's."""
    preset = QUICK if args.quick else FULL
    return {key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in FULL}


def _check(args) -> "clusters.Cluster | None":
    """Every input of the call, before any measuring (one line each): what goes with what, the
    cluster, the partition methods, the output files, the overrides the profile would train with."""
    from tgdist.partition.methods import METHODS

    if args.from_profile is not None:
        for flag, given in (("--quick", args.quick), ("--out", args.out is not None)):
            if given:
                raise ConfigError(f"{flag} goes with --profile (a profile taken now); --from-profile reads one")
        if args.cluster is None:
            raise ConfigError("--from-profile needs --cluster NAME|FILE: the cluster to advise for")
    if args.cluster is None:
        for flag, given in (("--png", args.png is not None), ("--sweep", args.sweep is not None),
                            ("--json", args.json), ("--batch", args.batch is not None)):
            if given:
                raise ConfigError(f"{flag} needs --cluster NAME|FILE: it shows the advice for a cluster")
    cl = clusters.cluster_of(args.cluster) if args.cluster is not None else None
    for flag, names in (("--placements", args.placements), ("--methods", args.methods)):
        for name in names or []:
            if name not in METHODS:
                raise ConfigError(f"{flag} {name}: not a partition method; choose from {', '.join(METHODS)}")
    if args.backends:
        stores = model.store_names()
        for name in args.backends:
            if name not in stores:
                raise ConfigError(f"--backends {name}: not a registered memory store; choose from {', '.join(stores)}")
    if args.pipelines:
        options = model.pipeline_options()
        for name in args.pipelines:
            if name not in options:
                raise ConfigError(f"--pipelines {name}: not a pipeline preset or strategy; choose from "
                                  f"{', '.join(options)}")
    if args.profile is not None:
        if not 0 < args.ap_tolerance < 1:
            raise ConfigError(f"--ap-tolerance {args.ap_tolerance}: give an AP difference in (0, 1)")
        args.out = args.out or "profile.json"
        _check_file(args.out, "--out", args.overwrite)
    if args.png is not None:
        _check_png(args.png, args.overwrite)
    if args.sweep is not None:
        _check_sweep(args.sweep, args.overwrite)
    if args.profile is not None:
        from tgdist.launcher.advisor.measure import check_overrides

        check_overrides(args.profile, args.threads)
    return cl


def _write_profile(prof, path: str) -> None:
    """The profile at ``path``; should that fail now (the folder removed meanwhile), it is kept in a
    temporary file the error names, not lost."""
    try:
        profiles.write(prof, path)
    except OSError as e:
        import tempfile

        fd, kept = tempfile.mkstemp(prefix="tgdist-profile-", suffix=".json")
        os.close(fd)
        profiles.write(prof, kept)
        raise ConfigError(f"--out {path}: cannot write the profile ({e.strerror or e}); it is kept in {kept}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    cl = _check(args)
    if args.profile is not None:
        from tgdist.launcher.advisor.measure import measure

        given = _settings(args)
        prof = measure(args.profile, **given, threads=args.threads, largest_batch=args.largest_batch,
                       accuracy_events=args.accuracy_events, ap_tolerance=args.ap_tolerance,
                       collectives=not args.no_collectives, **(QUICK_MEASURE if args.quick else {}))
        _write_profile(prof, args.out)
        print(f"tgdist plan --profile: wrote {args.out} (S = {prof.saturation_batch}, L = {prof.largest_batch}); "
              f"another cluster: tgdist plan --from-profile {args.out} --cluster NAME|FILE", file=sys.stderr)
    else:
        prof = profiles.read(args.from_profile)
    if cl is None:
        return 0
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
        if prof.largest_batch is None:
            print("note: L (the largest global batch without accuracy loss) was not measured (--quick): the ranking "
                  "does not weigh accuracy beyond a global batch; give --largest-batch, or take the full profile")
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
        cmd = report.write_sweep(ranked, cl, data, args.sweep, args.top, args.epochs, overwrite=args.overwrite)
        print(f"sweep over the top {args.top}: {cmd}")
    return 0
