"""The arrays file's fast reader: stored members are views of the file's bytes, identical to
what numpy's loader returns; deflated files (written before, or by hand) still load."""
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from neox_perf.predictors.artifacts import Arrays, _stored_npy
from neox_perf.predictors.errors import ProfileError

BUNDLED = Path(__file__).resolve().parents[2] / "neox_perf" / "profiles"


@pytest.mark.parametrize("name", ["perlmutter-a100-80gb", "vista-gh200"])
def test_every_bundled_member_reads_as_numpy_reads_it(name):
    d = BUNDLED / name
    manifest = json.loads((d / "manifest.json").read_text())
    arrays = Arrays(d / manifest["arrays"]["file"], manifest["arrays"]["sha256"])
    ref = np.load(d / manifest["arrays"]["file"], allow_pickle=False)
    for member in ref.files:
        got = _stored_npy(arrays._data, arrays._infos[member])
        assert got is not None, f"{member}: bundled profiles are stored, not deflated"
        assert got.dtype == ref[member].dtype and np.array_equal(got, ref[member])
        assert not got.flags.writeable  # a view of the file: nothing may write through it


def _write(path: Path, compressed: bool, **members):
    with open(path, "wb") as fh:
        (np.savez_compressed if compressed else np.savez)(fh, **members)


@pytest.mark.parametrize("compressed", [False, True])
def test_stored_and_deflated_files_give_the_same_arrays(tmp_path, compressed):
    members = {"m0.feature": np.array([0, 1, -1], dtype=np.int32),
               "m0.threshold": np.linspace(0, 1, 7, dtype=np.float32),
               "m0.right": np.arange(3, dtype=np.int64), "m0.value": np.zeros((2, 3)),
               "m0.roots": np.array([0], dtype=np.int32)}
    path = tmp_path / "arrays.npz"
    _write(path, compressed, **members)
    got = Arrays(path, None).get("m0")
    for want, have in zip(members.values(), got):
        assert have.dtype == want.dtype and have.shape == want.shape and np.array_equal(have, want)


def test_a_truncated_stored_file_is_a_profile_error_not_a_crash(tmp_path):
    path = tmp_path / "arrays.npz"
    _write(path, False, **{"m0.feature": np.arange(1000, dtype=np.int32)})
    data = path.read_bytes()
    # cut inside the member's data, keep a valid central directory: rebuild the zip by hand
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = z.infolist()[0]
    assert info.compress_type == zipfile.ZIP_STORED
    arrays = Arrays(path, None)
    short = zipfile.ZipInfo(info.filename)
    short.file_size = 100  # claims fewer bytes than the header's shape needs
    short.compress_type = zipfile.ZIP_STORED
    short.header_offset = info.header_offset
    assert _stored_npy(arrays._data, short) is None  # refused, numpy's loader decides
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ProfileError, match="corrupt profile arrays"):
        Arrays(path, None)
