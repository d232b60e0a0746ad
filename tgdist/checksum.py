"""SHA-256 checksums for the files tgdist writes and reads back (checkpoints, processed-graph cache
entries, partition artifacts), checked before a file is parsed: a flipped byte inside a tensor
loads without complaint otherwise.

A zip archive (``torch.save`` and ``np.savez`` write one) ends with a record that may carry a
comment. ``seal`` makes that comment ``tgdist-sha256:<64 hex digits>``, the SHA-256 of every byte
of the file before those digits. ``torch.load``, ``np.load`` and unzip read a sealed archive as
before (they skip the comment), and the checksum goes wherever the file goes: an atomic rename, a
copy to another machine. ``verify`` accepts a file without a seal unchecked: one written before
checksums (tgdist up to this version), or by another program (a user's ``torch.save``).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time
from pathlib import Path

from tgdist.errors import DataError

MARK = b"tgdist-sha256:"
_DIGITS = 64  # hex digits of a SHA-256
_SEAL = len(MARK) + _DIGITS  # the comment's length
_END = b"PK\x05\x06"  # a zip archive's end-of-central-directory record: 22 bytes, its comment length last
_END_SIZE = 22
_HEX = re.compile(rb"[0-9a-f]{64}")
_CHUNK = 1 << 24

# Files this process found intact, by identity and version ((device, inode, size, mtime, ctime) ->
# digest): a resume checks its checkpoint before the run directory is touched and again when it
# loads it, and the second check need not hash a large file again. A file changed in the last
# second is not remembered: file times move in clock ticks, and a rewrite within one keeps them.
_intact: dict[tuple, str] = {}
_SETTLED_NS = 10**9


class Corrupt(DataError):
    """A sealed file whose bytes no longer match its checksum. The message names the file; callers
    add what to do about it."""

    def __init__(self, path, expected: str, found: str):
        self.path, self.expected, self.found = Path(path), expected, found
        super().__init__(f"{path}: checksum mismatch, the file is corrupt (expected sha256 {shown(expected)}, "
                         f"found {shown(found)})")

    def __reduce__(self):  # as it was made (the default passes the message alone): it crosses processes
        return type(self), (self.path, self.expected, self.found)


def shown(digest: str) -> str:
    """A digest as messages show it: its first 12 digits."""
    return f"{digest[:12]}..." if re.fullmatch(r"[0-9a-f]{64}", digest) else f"{ascii(digest[:12])} (a damaged record)"


def sha256_file(path: str | Path, size: int | None = None) -> str:
    """The SHA-256 of a file's first ``size`` bytes (all of it by default), read in 16 MiB chunks."""
    with open(path, "rb") as f:
        return _digest(f, size)


def _digest(f, size: int | None) -> str:
    h = hashlib.sha256()
    buf = memoryview(bytearray(_CHUNK))
    left = float("inf") if size is None else size
    while left > 0:
        n = f.readinto(buf[:int(min(_CHUNK, left))])
        if not n:
            break
        h.update(buf[:n])
        left -= n
    return h.hexdigest()


def seal(path: str | Path) -> str:
    """Append the checksum to a zip archive just written at ``path`` (before it is renamed into
    place); returns the digest. The archive must have no comment (none of torch's or NumPy's has):
    its last 22 bytes are the end record, whose comment length is set to the seal's."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - _END_SIZE, 0))
        end = f.read(_END_SIZE)
        if len(end) != _END_SIZE or not end.startswith(_END) or end[-2:] != b"\0\0":
            raise ValueError(f"{path}: not a zip archive without a comment, so it cannot be sealed")
        f.seek(size - 2)
        f.write(struct.pack("<H", _SEAL) + MARK)
        f.flush()
        f.seek(0)
        digest = _digest(f, size + len(MARK))
        f.seek(size + len(MARK))
        f.write(digest.encode())
    return digest


def verify(path: str | Path) -> str | None:
    """Check a sealed file against its checksum before anything parses it: its digest when the
    file is intact, None when it has no seal (accepted unchecked, see the module's docstring);
    ``Corrupt`` when its bytes changed. A file is hashed once per process while it is unchanged."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key in _intact:
            return _intact[key]
        if st.st_size < _END_SIZE + _SEAL:
            return None
        f.seek(st.st_size - _SEAL)
        tail = f.read(_SEAL)
        if not tail.startswith(MARK):
            return None
        f.seek(0)
        found = _digest(f, st.st_size - _DIGITS)
    expected = tail[len(MARK):]
    if not _HEX.fullmatch(expected) or expected.decode() != found:
        raise Corrupt(path, expected.decode("ascii", "replace"), found)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLED_NS:
        _intact[key] = found
    return found
