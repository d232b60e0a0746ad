"""Checksums sealed into zip archives (torch and NumPy files), checked before they are parsed."""

import hashlib
import pickle
import zipfile

import numpy as np
import pytest
import torch

from tgdist import checksum
from tgdist.errors import DataError


@pytest.fixture(autouse=True)
def _forget_checked_files():
    """A file rewritten within one clock tick keeps its size and times: check every version afresh."""
    checksum._intact.clear()
    yield
    checksum._intact.clear()


def _npz(path):
    np.savez(path, a=np.arange(5), b=np.array([1.5, -2.0]))
    return path


def test_a_sealed_file_ends_with_the_sha256_of_the_bytes_before_it_and_still_loads(tmp_path):
    t, n = tmp_path / "t.pt", _npz(tmp_path / "n.npz")
    torch.save({"x": torch.arange(4), "y": "z"}, t)
    for path in (t, n):
        size = path.stat().st_size
        digest = checksum.seal(path)
        data = path.read_bytes()
        assert len(data) == size + 78 and data[-78:] == b"tgdist-sha256:" + digest.encode()
        assert digest == hashlib.sha256(data[:-64]).hexdigest()
        assert checksum.verify(path) == digest
        assert zipfile.ZipFile(path).comment == data[-78:]  # the archive's comment, which readers skip
    assert torch.load(t, weights_only=True)["y"] == "z" and torch.load(t, weights_only=True, mmap=True)["y"] == "z"
    with np.load(n) as z:
        assert z["a"].tolist() == [0, 1, 2, 3, 4]


def test_every_changed_byte_is_found_but_in_the_mark(tmp_path):
    """A byte changed anywhere (the data, the zip records, the comment length, the digest) is
    refused; one in the 14 bytes of ``tgdist-sha256:`` unseals the file, whose content is intact."""
    path = _npz(tmp_path / "n.npz")
    checksum.seal(path)
    good = path.read_bytes()
    mark = range(len(good) - 78, len(good) - 64)
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bad)
        checksum._intact.clear()
        if i in mark:
            assert checksum.verify(path) is None
            with np.load(path) as z:
                assert z["b"].tolist() == [1.5, -2.0]
        else:
            with pytest.raises(checksum.Corrupt):
                checksum.verify(path)


def test_the_mismatch_is_one_line_naming_the_file_and_both_digests(tmp_path):
    path = _npz(tmp_path / "n.npz")
    expected = checksum.seal(path)
    data = bytearray(path.read_bytes())
    data[100:116] = bytes(16)
    path.write_bytes(data)
    found = hashlib.sha256(data[:-64]).hexdigest()
    with pytest.raises(DataError) as e:
        checksum.verify(path)
    assert str(e.value) == (f"{path}: checksum mismatch, the file is corrupt (expected sha256 {expected[:12]}..., "
                            f"found {found[:12]}...)")
    assert isinstance(e.value, checksum.Corrupt) and e.value.path == path
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)
    data[-3] = ord("x")  # the record itself damaged
    path.write_bytes(data)
    with pytest.raises(checksum.Corrupt, match=r"expected sha256 '[0-9a-f]{12}' \(a damaged record\)"):
        checksum.verify(path)


def test_files_without_a_seal_are_accepted_unchecked(tmp_path):
    """Written before checksums or by another program; too short to hold a seal; not a zip."""
    n = _npz(tmp_path / "n.npz")
    torch.save({"x": 1}, tmp_path / "t.pt")
    (tmp_path / "short").write_bytes(b"PK")
    (tmp_path / "text").write_text("hello " * 40)
    for name in ("n.npz", "t.pt", "short", "text"):
        assert checksum.verify(tmp_path / name) is None
    with pytest.raises(ValueError, match="not a zip archive without a comment"):
        checksum.seal(tmp_path / "text")
    checksum.seal(n)
    with pytest.raises(ValueError, match="cannot be sealed"):  # once
        checksum.seal(n)


def test_an_intact_file_is_hashed_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """Once its times are settled: a file changed in the last second is hashed at every check."""
    path = _npz(tmp_path / "n.npz")
    digest = checksum.seal(path)
    calls = []
    real = checksum._digest
    monkeypatch.setattr(checksum, "_digest", lambda f, size: calls.append(size) or real(f, size))
    assert checksum.verify(path) == checksum.verify(path) == digest and len(calls) == 2  # just written
    monkeypatch.setattr(checksum, "_SETTLED_NS", 0)
    assert checksum.verify(path) == checksum.verify(path) == digest and len(calls) == 3
    other = tmp_path / "copy.npz"
    other.write_bytes(path.read_bytes())  # another file: hashed for itself
    assert checksum.verify(other) == digest and len(calls) == 4


def test_large_files_are_hashed_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(checksum, "_CHUNK", 1000)
    path = tmp_path / "big.npz"
    np.savez(path, a=np.arange(10_000))
    digest = checksum.seal(path)
    assert digest == hashlib.sha256(path.read_bytes()[:-64]).hexdigest() == checksum.verify(path)
