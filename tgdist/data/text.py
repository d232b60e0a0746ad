"""Text shared by the readers of text formats (edge lists, JODIE CSVs, TGL's ``edges.csv``): the
bytes of a file, decompressed; numeric tables with their file line numbers, so that every error
names ``FILE:LINE``; columns as node ids, times and integers, checked."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tgdist.errors import DataError


# Single-stream compressions by suffix: (name in messages, module with open() and decompress()).
COMPRESSED = {".gz": ("gzip", gzip), ".bz2": ("bzip2", bz2), ".xz": ("xz", lzma)}


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    """File contents, decompressed for .gz, .bz2, .xz and single-member .zip files, without a
    leading UTF-8 byte-order mark (Excel and pandas' ``utf-8-sig`` write one; left in place it
    would glue itself to the first header name or node id).

    ``limit``: read only about that many leading (decompressed) bytes, for format detection.
    """
    data = _read_raw(path, limit)
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:]
    if data.startswith(UTF16_BOMS):
        raise DataError(f"{path}: UTF-16 text (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    return data


def _read_raw(path: Path, limit: int | None) -> bytes:
    name = path.name.lower()
    kind, codec = next((v for k, v in COMPRESSED.items() if name.endswith(k)), (None, None))
    try:
        if limit is not None and not name.endswith(".zip"):
            with (codec.open if codec else open)(path, "rb") as f:
                return f.read(limit)
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        if (path / "edges.csv").exists():
            raise DataError(f"{path}: a TGL dataset directory, which format tgl (or auto) reads; this format reads "
                            f"a file") from None
        raise DataError(f"{path}: is a directory, expected a file (a TGL dataset directory needs edges.csv)") from None
    except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        if kind is None or isinstance(e, (PermissionError, FileNotFoundError)):
            raise DataError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        raise DataError(f"{path}: truncated or corrupt {kind} file ({e})") from None
    if codec is not None:
        try:
            return codec.decompress(raw)
        except (EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as e:
            raise DataError(f"{path}: truncated or corrupt {kind} file ({e})") from None
    if name.endswith(".zip"):
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                members = [m for m in zf.namelist() if not m.startswith("__MACOSX/") and not m.endswith("/")]
                if len(members) != 1:
                    raise DataError(f"{path}: expected one data file in the zip archive, found {len(members)}: {members[:5]}")
                if limit is not None:  # format detection: decompress only the head of the member
                    with zf.open(members[0]) as f:
                        return f.read(limit)
                return zf.read(members[0])
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            raise DataError(f"{path}: truncated or corrupt zip file ({e})") from None
        except (RuntimeError, NotImplementedError) as e:  # encrypted, or a compression zipfile lacks
            raise DataError(f"{path}: cannot read the zip archive's member ({e}); unzip it first") from None
    return raw


# Leading bytes of formats that are not text, named in the error when a file holds one; the
# compressions tgdist reads, by the suffix that has them read.
ZIP_MAGIC = b"PK\x03\x04"
_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", ZIP_MAGIC: "zip",
          b"\x28\xb5\x2f\xfd": "zstd", b"PAR1": "parquet", b"\x89HDF": "HDF5"}
_SUFFIX_OF = {kind: suffix[1:] for suffix, (kind, _) in COMPRESSED.items()} | {"zip": "zip"}


def _utf8(head: bytes) -> bool:
    """``head`` decodes as UTF-8 (a character cut at its end allowed)."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


NUMERIC = re.compile(r"^\s*[-+]?(\d|\.\d|nan|inf)", re.IGNORECASE)


@dataclass
class Table:
    """A parsed numeric table: ``values [num_rows, num_cols]`` int64 (all integral) or float64.

    ``exact`` holds int64 copies of integral columns whose values exceed 2**53, where the float64
    table would round them (e.g. nanosecond times next to a fractional feature column); ``wide``
    the integral columns that int64 cannot hold (uint64, or Python ints when negative and above
    2**63 - 1 values meet), exact for node ids (hashed 64-bit ids, say).
    """

    values: np.ndarray
    header: list[str] | None
    lines: np.ndarray  # 1-based file line of each data row
    path: Path
    exact: dict[int, np.ndarray] = field(default_factory=dict)
    text: dict[int, np.ndarray] = field(default_factory=dict)  # string node ids (0 in ``values``)
    wide: dict[int, np.ndarray] = field(default_factory=dict)

    def column(self, c: int) -> np.ndarray:
        return self.exact[c] if c in self.exact else self.values[:, c]


def parse_table(path: Path, data: bytes, delimiter: str | None = "auto", usecols: list[int] | None = None,
                 text_cols: tuple[int, ...] = ()) -> Table:
    """Parse a numeric table with an optional header line into int64 (if possible) or float64.

    Blank lines and comment lines (``#``, and KONECT's ``%``) are skipped; every row keeps its file
    line number so that errors can name it. ``text_cols`` (indices among the columns read) are kept
    as strings, in ``Table.text``: node ids such as account names. The first line that is not a
    comment is a header when its first field is not a number (with ``text_cols``: when none of its
    other fields is); SNAP's ``# FromNodeId ToNodeId`` header lines are comments like any other.
    """
    kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), None)
    if b"\0" in data[:1 << 16] or (kind and not _utf8(data[:1 << 16])):  # say so instead of a garbled field
        if kind in _SUFFIX_OF:
            raise DataError(f"{path}: {kind}-compressed data under a name without its suffix; name it "
                            f"{path.name}.{_SUFFIX_OF[kind]} to have it read")
        raise DataError(f"{path}: {kind + ' ' if kind else ''}binary data, not a text event list (supported: text edge "
                        f"lists and JODIE CSVs, plain or .gz/.bz2/.xz/.zip; TGL directories; tgdist .npz)")
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    all_lines = text.splitlines()
    first = next((i for i, ln in enumerate(all_lines) if ln.strip() and not is_comment(ln)), None)
    if first is None:
        raise DataError(f"{path}: no data rows (only comment lines)")
    header = None
    fields = split_fields(all_lines[first], delimiter)
    if text_cols:  # names in the id columns: a header has no number in the other columns either
        used = fields if usecols is None else [fields[c] for c in usecols if c < len(fields)]
        is_header = not any(NUMERIC.match(f) for i, f in enumerate(used) if i not in text_cols)
    else:
        is_header = not NUMERIC.match(all_lines[first])
    if is_header:
        header = fields
        first += 1
    body = all_lines[first:]
    keep = np.fromiter(((ln.strip() != "") and not is_comment(ln) for ln in body), dtype=bool, count=len(body))
    rows = np.flatnonzero(keep)
    if rows.size == 0:
        raise DataError(f"{path}: no data rows")
    lines = rows + first + 1
    body = [body[i] for i in rows]  # numpy's row numbers in errors then index ``lines``
    if delimiter == "auto":
        delimiter = "," if "," in body[0] else None
    if text_cols:
        return _parse_mixed(path, body, lines, header, delimiter, usecols, text_cols)
    exact: dict[int, np.ndarray] = {}
    wide: dict[int, np.ndarray] = {}
    try:
        values = np.loadtxt(body, dtype=np.int64, delimiter=delimiter, ndmin=2, usecols=usecols)
    except ValueError:
        try:
            values = np.loadtxt(body, dtype=np.float64, delimiter=delimiter, ndmin=2, usecols=usecols)
        except ValueError as e:
            raise _locate_loadtxt_error(path, str(e), lines) from None
        # Integral columns beyond float64's exact range are read again as integers so that ids and
        # times survive exactly.
        with np.errstate(invalid="ignore"):
            big = np.flatnonzero((np.abs(values) >= 2.0**53).any(axis=0) & (values == np.floor(values)).all(axis=0))
        for c in big.tolist():
            use = [usecols[c] if usecols else c]
            try:
                exact[c] = np.ascontiguousarray(np.loadtxt(body, dtype=np.int64, delimiter=delimiter, ndmin=2,
                                                           usecols=use)[:, 0])
                continue
            except ValueError:  # beyond int64 (hashed ids), or written with a fraction or exponent
                pass
            col = _exact_integers(np.loadtxt(body, dtype=str, delimiter=delimiter, ndmin=2, usecols=use)[:, 0])
            if col is not None:  # else float64 it is
                (exact if col.dtype == np.int64 else wide)[c] = col
    return Table(values, header, lines, path, exact, wide=wide)


def _exact_integers(fields: np.ndarray) -> np.ndarray | None:
    """Integer fields exactly: int64 when they fit, else uint64 when none is negative, else Python
    ints (an object array); None when a field is not an integer (a fraction, an exponent)."""
    for dtype in (np.int64, np.uint64):
        try:
            return np.ascontiguousarray(fields.astype(dtype))
        except (ValueError, OverflowError):
            pass
    try:
        return np.array([int(f) for f in fields.tolist()], dtype=object)
    except ValueError:
        return None


def is_comment(line: str) -> bool:
    """A whole-line comment: ``#`` (SNAP, DyGLib) or ``%`` (KONECT's ``out.*`` files)."""
    return line.lstrip().startswith(("#", "%"))


def split_fields(line: str, delimiter: str | None) -> list[str]:
    """The fields of one line as the table is split (``auto``: commas, else whitespace)."""
    line = line.strip()
    if delimiter == "auto":
        delimiter = "," if "," in line else None
    return [f.strip() for f in (line.split(delimiter) if delimiter else line.split())]


def _parse_mixed(path: Path, body: list[str], lines: np.ndarray, header, delimiter, usecols,
                 text_cols: tuple[int, ...]) -> Table:
    """``parse_table`` with string columns: every field read as text, the others converted."""
    try:
        raw = np.loadtxt(body, dtype=str, delimiter=delimiter, ndmin=2, usecols=usecols, comments="#")
    except ValueError as e:
        raise _locate_loadtxt_error(path, str(e), lines) from None
    numeric = [c for c in range(raw.shape[1]) if c not in text_cols]
    cols, wide, integral = {}, {}, True
    for c in numeric:
        ints = _exact_integers(raw[:, c])
        if ints is not None and ints.dtype == np.int64:
            cols[c] = ints
            continue
        integral = False
        if ints is not None:
            wide[c] = ints
        try:
            cols[c] = raw[:, c].astype(np.float64)
        except ValueError:
            r = next(i for i, v in enumerate(raw[:, c]) if not is_float(v))
            raise FieldError(path, lines[r], str(raw[r, c]), usecols[c] if usecols else c) from None
    values = np.zeros(raw.shape, np.int64 if integral else np.float64)
    for c, v in cols.items():
        values[:, c] = v
    exact = {c: v for c, v in cols.items() if not integral and v.dtype.kind == "i"}
    return Table(values, header, lines, path, exact, {c: raw[:, c] for c in text_cols if c < raw.shape[1]}, wide)


def is_float(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


_DATE = re.compile(r"\d{4}-\d\d-\d\d|\d\d?:\d\d")


class FieldError(DataError):
    """A field that is not a number, in the file's 0-based ``column``. Dates and clock times get a
    hint of their own: they are not read as times."""

    def __init__(self, path: Path, line, field: str, column: int, hint: str | None = None):
        self.path, self.line, self.field, self.column = path, line, field, column
        if _DATE.search(field):
            hint = "times must be numbers, such as Unix seconds; convert dates before reading"
        what = f"non-numeric field {field!r}" if field.strip() else "empty field"
        super().__init__(f"{path}:{line}: {what} in column {column + 1}" + (f" ({hint})" if hint else ""))

    def hinted(self, hint: str) -> FieldError:
        return FieldError(self.path, self.line, self.field, self.column, hint)


def _locate_loadtxt_error(path: Path, msg: str, lines: np.ndarray) -> DataError:
    """Turn numpy.loadtxt's message (data row numbers) into an error ``FILE:LINE: problem``."""
    def line_of(row: int) -> str:
        return str(lines[row]) if 0 <= row < lines.size else "?"
    # "could not convert string 'x' to float64 at row 1, column 2." (row 0-based, column 1-based)
    m = re.search(r"could not convert string '(.*)' to \w+ at row (\d+), column (\d+)", msg)
    if m:
        return FieldError(path, line_of(int(m.group(2))), m.group(1), int(m.group(3)) - 1)
    # "the number of columns changed from 3 to 2 at row 2; ..." (row 1-based)
    m = re.search(r"the number of columns changed from (\d+) to (\d+) at row (\d+)", msg)
    if m:
        first = f" as on the first data line ({line_of(0)})" if int(m.group(3)) > 1 else ""
        return DataError(f"{path}:{line_of(int(m.group(3)) - 1)}: expected {m.group(1)} fields{first}, found "
                         f"{m.group(2)}")
    # "invalid column index 2 at row 2 with 2 columns" (row 1-based)
    m = re.search(r"invalid column index (\d+) at row (\d+) with (\d+) columns", msg)
    if m:
        return DataError(f"{path}:{line_of(int(m.group(2)) - 1)}: expected at least {int(m.group(1)) + 1} fields, "
                         f"found {m.group(3)}")
    return DataError(f"{path}: {msg.splitlines()[0] if msg else 'unreadable table'}")


def integral(table: Table, col: int, what: str) -> np.ndarray:
    """Column ``col`` as int64; NaN, inf or fractions are errors naming ``what``, file and line."""
    v = table.column(col)
    if v.dtype.kind == "f":
        bad = ~np.isfinite(v) | (v != np.floor(v))
        if bad.any():
            r = int(np.argmax(bad))
            raise DataError(f"{table.path}:{table.lines[r]}: {what} {v[r].item()} is not an integer")
        huge = np.abs(v) >= 2.0**63
        if huge.any():
            r = int(np.argmax(huge))
            raise DataError(f"{table.path}:{table.lines[r]}: {what} {v[r].item():.17g} does not fit in a 64-bit integer")
        v = v.astype(np.int64)
    return np.ascontiguousarray(v)


def as_ids(table: Table, col: int, what: str) -> np.ndarray:
    """Node ids exactly as written: names (strings), int64, or wider integers (``Table.wide``).
    Ids are only labels, so negative ones and ones beyond int64 are ids like any other."""
    if col in table.text:
        return table.text[col]
    if col in table.wide:
        return table.wide[col]
    return integral(table, col, f"{what} id")


def as_times(table: Table, col: int, what: str = "time") -> np.ndarray:
    v = table.column(col)
    if v.dtype.kind == "f":
        bad = ~np.isfinite(v)
        if bad.any():
            r = int(np.argmax(bad))
            raise DataError(f"{table.path}:{table.lines[r]}: {what} {v[r].item()} is not a finite number")
        if (v == np.floor(v)).all() and np.abs(v).max() < 2**53:
            v = v.astype(np.int64)  # integral after all (a float column elsewhere forced float64)
    return np.ascontiguousarray(v)


def check_finite(arr: np.ndarray, table: Table, what: str) -> None:
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        r = int(np.argmax(~np.isfinite(arr).reshape(arr.shape[0], -1).all(axis=1)))
        raise DataError(f"{table.path}:{table.lines[r]}: {what} is not a finite number")


def text_blocks(path: Path, block: int):
    """The (decompressed) text of ``path`` in blocks of whole lines, about ``block`` bytes each, and
    the bytes read so far of the file itself (for progress)."""
    name = path.name.lower()
    kind, codec = next((v for k, v in COMPRESSED.items() if name.endswith(k)), (None, None))
    with open(path, "rb") as raw, (codec.open(raw, "rb") if codec else raw) as f:
        rest = b""
        while True:
            try:
                chunk = f.read(block)
            except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
                raise DataError(f"{path}: truncated or corrupt {kind} file ({e})") from None
            if not chunk:
                if rest:
                    yield rest, raw.tell()
                return
            chunk = rest + chunk
            cut = chunk.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a block: keep reading
                rest = chunk
                continue
            rest = chunk[cut:]
            yield chunk[:cut], raw.tell()


