"""A data format registered from outside tgdist, as a lab would add one (tests/extending/
test_readers.py): a text file whose first line is ``TOY``, then one event a line,
``SRC > DST @ TIME``. Imported through ``TGDIST_PLUGINS=tests.extending.toy_reader``; it notes
each file it parses in the file ``$TOY_READER_LOG`` (when set), so a test can tell it was used."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tgdist.data.readers import ReadOptions, Reader, register
from tgdist.errors import DataError

MAGIC = b"TOY\n"


@register
class ToyReader(Reader):
    name = "toy"
    describes = "a toy event list"

    def sniff(self, path: Path) -> bool:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC

    def parse(self, path: Path, options: ReadOptions) -> dict:
        if os.environ.get("TOY_READER_LOG"):
            with open(os.environ["TOY_READER_LOG"], "a") as f:
                f.write(f"parsed {path}\n")
        src, dst, t = [], [], []
        for number, line in enumerate(path.read_text().splitlines()[1:], start=2):
            if not line.strip():
                continue
            try:
                pair, when = line.split("@")
                a, b = pair.split(">")
                src.append(int(a)), dst.append(int(b)), t.append(int(when))
            except ValueError:
                raise DataError(f"{path}:{number}: expected SRC > DST @ TIME, found {line.strip()!r}") from None
        return {"src": np.array(src, np.int64), "dst": np.array(dst, np.int64), "t": np.array(t, np.int64)}
