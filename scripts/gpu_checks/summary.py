"""The summary table of a ``scripts/gpu_checks.sh`` run: every check of ``$OUT/checks.jsonl`` with
its status, seconds and headline figure, then each part's wall time (``$OUT/parts.tsv``, written by
the shell). Printed on stderr and written to ``$OUT/summary.txt``; exit 1 when a check failed or
none was recorded, else 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared import out_dir

PART_NAMES = {0: "tests/gpu under pytest", 1: "two ranks, CUDA compute + gloo, vs CPU",
              2: "world of one (NCCL), backends, pipelines, resume", 3: "single-device epoch speed vs PyG",
              4: "pipelines where they matter"}


def headline(line: dict) -> str:
    f = line.get("figures") or {}
    c = line["check"]
    if line["status"] != "pass":  # why, in short (the whole error is in checks.jsonl)
        rows = [x.strip() for x in (line.get("error") or "").strip().splitlines() if x.strip()] or [""]
        err = rows[-1] if rows[0].startswith("Traceback") else rows[0]  # a traceback's exception line
        return err[:160] + ("..." if len(err) > 160 else "")
    if isinstance(f.get("headline"), str):  # a line that words its own (part 3)
        return f["headline"]
    if c == "gpu_tests":
        return f"{f.get('passed')} passed, {f.get('failed')} failed, {f.get('skipped')} skipped"
    if c.startswith("two_ranks:"):
        per = [max(x) for x in zip(*f["memory_max_abs_diff_per_iteration"])] if f.get("memory_max_abs_diff_per_iteration") else []
        return (f"loss rel {_g(f.get('loss_max_rel_diff'))}, memory by iteration {'/'.join(_g(x) for x in per) or '-'}, "
                f"metrics {_g(f.get('worst_metric_gap'))}")
    if c == "nccl_smoke":
        return f"{f.get('backend')}: {len(f.get('ops') or [])} ops"
    if c.startswith("world_one:"):
        gap = f.get("worst_metric_gap")
        return f"{f.get('comm_backend')}, test AP {_g(f.get('test_ap'))}" + (f", gap {_g(gap)}" if gap is not None else "")
    if c.startswith("exact:"):
        return (f"deterministic, test AP {_g((f.get('scores') or {}).get('test_ap'))}"
                + ("" if c == "exact:local" else ", scores equal to local memory's"))
    if c.startswith("resume:"):
        return f"stopped at {f.get('stop_after_batches')}, resumed scores {'equal' if line['status'] == 'pass' else 'differ'}"
    if c == "speed:pyg_tgn":
        if f.get("pyg", 0) is None:
            return "PyG not installed"
        return f"{_g(f.get('epoch_seconds'))} s/epoch, test AP {_g(f.get('test_ap'))}"
    if c.startswith("speed:"):
        extra = (f", goal <= 3 s met: {f['goal_met']} (TGLite's A100 epoch / this: x{_g(f.get('vs_tglite_a100'))}, "
                 f"TGL's: x{_g(f.get('vs_tgl'))})" if f.get("goal_met") is not None else "")
        return f"{_g(f.get('epoch_seconds'))} s/epoch, test AP {_g(f.get('test_ap'))}{extra}"
    if c in ("pipelines:sven_ladder", "pipelines:mspipe_2x1x1"):
        r = f.get("speedup_vs_baseline") or {}
        return ", ".join(f"{k} x{_g(v)}" for k, v in r.items())
    if c == "pipelines:mspipe_1proc":
        return f"x{_g(f.get('speedup_vs_plain'))} vs plain"
    if c == "pipelines:freshgnn_tgat2":
        return f"median step x{_g(f.get('median_speedup'))}, hit rate {_g(f.get('hit_rate'))}"
    return ""


def _g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def main() -> int:
    out = out_dir()
    path = out / "checks.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    rows = [("part", "check", "status", "seconds", "figures")]
    for ln in lines:
        rows.append((str(ln["part"]), ln["check"], ln["status"].upper(), f"{ln['seconds']:.1f}", headline(ln)))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    where = f"{lines[0]['device']} ({lines[0]['device_name']})" if lines else "?"
    text = [f"gpu_checks summary: device {where}"]
    for r in rows:
        text.append("  ".join(r[i].ljust(width[i]) for i in range(4)) + "  " + r[4])
    parts = out / "parts.tsv"
    if parts.exists():
        text.append("")
        text.append("part  seconds  exit  what")
        total = 0.0
        for row in parts.read_text().splitlines():
            part, secs, rc = row.split("\t")[:3]
            total += float(secs)
            text.append(f"{part:<4}  {float(secs):7.1f}  {rc:>4}  {PART_NAMES.get(int(part), '')}")
        text.append(f"all   {total:7.1f}")
    failed = [ln["check"] for ln in lines if ln["status"] != "pass"]
    text.append("")
    text.append(f"{len(lines) - len(failed)}/{len(lines)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    body = "\n".join(text) + "\n"
    (out / "summary.txt").write_text(body)
    print(body, file=sys.stderr, end="")
    return 1 if failed or not lines else 0


if __name__ == "__main__":
    sys.exit(main())
