"""Occupancy files other tools read, and files that must not hang or exhaust a reader (issue 59).

A prediction is loaded as the Occ3D challenge and SparseOcc load one, by re-implementing their loading lines
(not through our reader). Labels and predictions that are named pipes, gigabyte members, absurd declared shapes,
truncated members and folders each end in one OccupancyFileError naming the file, at the cost of a header."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bev.tasks.occupancy.grid import NUM_CLASSES, OCC_SHAPE
from bev.tasks.occupancy.io import OccupancyFileError, read_labels, read_prediction, write_prediction
from helpers.occupancy_files import GIB, npy_header, raw_npy_header, renamed, run_guarded, write_npz, zeros_member

REPO = Path(__file__).resolve().parents[1]


def _labels(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {
        "semantics": g.integers(0, NUM_CLASSES, OCC_SHAPE, dtype=np.uint8),
        "mask_lidar": (g.random(OCC_SHAPE) < 0.5).astype(np.uint8),
        "mask_camera": (g.random(OCC_SHAPE) < 0.3).astype(np.uint8),
    }


def _pred(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, NUM_CLASSES, OCC_SHAPE, dtype=np.uint8)


READERS = {"labels": (read_labels, "labels.npz"), "prediction": (read_prediction, "tok.npz")}


# ----------------------------------------------------------------------------- prediction keys


def test_one_prediction_file_loads_as_the_challenge_and_sparseocc_load_it(tmp_path):
    argmax = np.random.default_rng(2).integers(0, NUM_CLASSES, OCC_SHAPE)  # int64, as a model's argmax
    path = write_prediction(tmp_path, "tok", argmax)
    # The challenge: format_results saves np.savez_compressed(path, occ_pred.astype(np.uint8)), so its loader
    # takes the array under numpy's default key (its evaluation server is not public).
    challenge = np.load(path)["arr_0"]
    assert challenge.dtype == np.uint8 and challenge.shape == (200, 200, 16)
    # SparseOcc's ray_metrics.py: np.load(path, allow_pickle=True)['pred'], reshaped to [200, 200, 16], as uint8.
    sparseocc = np.reshape(np.load(path, allow_pickle=True)["pred"], [200, 200, 16]).astype(np.uint8)
    np.testing.assert_array_equal(challenge, argmax)
    np.testing.assert_array_equal(sparseocc, argmax)
    with np.load(path) as z:  # the challenge's key first: a loader taking the first array gets it too
        assert z.files[0] == "arr_0"


def test_read_prediction_takes_either_tools_key(tmp_path):
    pred = _pred()
    np.savez_compressed(tmp_path / "challenge.npz", pred)  # the challenge's format_results
    np.savez_compressed(tmp_path / "sparseocc.npz", pred=pred)
    # The challenge's evaluate_miou(show_dir=...) dumps: pred, gt and the token; the extra arrays are not read.
    np.savez_compressed(tmp_path / "dump.npz", pred=pred, gt=_pred(3), sample_token="tok")
    for name in ("challenge", "sparseocc", "dump"):
        np.testing.assert_array_equal(read_prediction(tmp_path / f"{name}.npz"), pred)
    other = pred.copy()
    other[0, 0, 0] = (other[0, 0, 0] + 1) % NUM_CLASSES
    np.savez_compressed(tmp_path / "differ.npz", arr_0=pred, pred=other)
    np.savez_compressed(tmp_path / "neither.npz", semantics=pred)
    for name, words in (("differ", "'arr_0' and 'pred' differ"), ("neither", "holds no prediction")):
        with pytest.raises(OccupancyFileError) as e:
            read_prediction(tmp_path / f"{name}.npz")
        assert str(tmp_path / f"{name}.npz") in str(e.value) and words in str(e.value), e.value


def test_labels_as_numpy_writes_them_are_read(tmp_path):
    """Occ3D's own files (np.savez_compressed), np.savez's stored members, bool masks and Fortran order."""
    labels = _labels()
    np.savez_compressed(tmp_path / "compressed.npz", **labels)
    np.savez(tmp_path / "stored.npz", **labels)
    np.savez(tmp_path / "fortran.npz", **{k: np.asfortranarray(v) for k, v in labels.items()})
    np.savez(tmp_path / "bool.npz", **{k: v.astype(bool) if k != "semantics" else v for k, v in labels.items()})
    for name in ("compressed", "stored", "fortran", "bool"):
        got = read_labels(tmp_path / f"{name}.npz")
        np.testing.assert_array_equal(got.semantics, labels["semantics"])
        np.testing.assert_array_equal(got.mask_camera, labels["mask_camera"].astype(bool))
        assert got.semantics.flags.writeable and got.semantics.flags.c_contiguous


# ----------------------------------------------------------------------------- files that hang or exhaust


def _refused(read, path: Path, *words: str) -> str:
    with pytest.raises(OccupancyFileError) as e:
        read(path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg and all(w in msg for w in words), msg
    assert "rewrite it with bev.tasks.occupancy.io.write_" in msg  # the fix
    return msg


@pytest.mark.parametrize("kind", READERS)
def test_a_named_pipe_is_refused_not_waited_on(tmp_path, kind):
    read, name = READERS[kind]
    fifo = tmp_path / name
    os.mkfifo(fifo)
    hung, raised = run_guarded(lambda: read(fifo), fifo)
    assert not hung, f"{kind}: the reader waited for a writer on a named pipe"
    assert isinstance(raised, OccupancyFileError), raised
    assert str(fifo) in str(raised) and "a named pipe, not a regular file" in str(raised)


@pytest.mark.parametrize("kind", READERS)
def test_other_non_regular_files_are_refused(tmp_path, kind):
    read, name = READERS[kind]
    folder = tmp_path / "dir" / name
    folder.mkdir(parents=True)
    _refused(read, folder, "it is a folder, not a regular file")
    device = tmp_path / "dev" / name
    device.parent.mkdir()
    device.symlink_to("/dev/zero")  # endless zeros: read as a file, it would never end
    _refused(read, device, "it is a character device, not a regular file")


def _with(kind: str, key: str, member) -> dict:
    """A valid file's arrays of `kind` with `key` replaced by `member` (raw .npy bytes)."""
    arrays = dict(_labels()) if kind == "labels" else {"arr_0": _pred()}
    arrays.pop(key, None)
    return {f"{key}.npy": member, **arrays}


@pytest.mark.parametrize("kind", READERS)
def test_a_huge_declared_shape_is_refused_before_allocating(tmp_path, kind):
    read, name = READERS[kind]
    key = "semantics" if kind == "labels" else "arr_0"
    path = write_npz(tmp_path / name, _with(kind, key, npy_header((2**40,))))
    _refused(read, path, "has shape (1099511627776,), expected (200, 200, 16)")


@pytest.mark.parametrize("kind", READERS)
def test_a_truncated_member_is_truncated_not_pickled(tmp_path, kind):
    read, name = READERS[kind]
    key = "mask_camera" if kind == "labels" else "arr_0"
    path = write_npz(tmp_path / name, _with(kind, key, npy_header(OCC_SHAPE) + bytes(1000)))
    msg = _refused(read, path, "is truncated", "640000 bytes", f"{key}.npy holds 1000 bytes")
    assert "pickle" not in msg


@pytest.mark.parametrize(
    "text",
    [
        "{'descr': '|u1', 'fortran_order': False, 'shape': (200, 200, 16), }" + " " * 20000,  # over numpy's cap
        "{'descr': '|u1', 'fortran_order': False, 'shape': (200, 200, 16), ",  # cut: a tokenizer error
        "(" * 4000 + ")" * 4000,  # too deep for its parser
        "{'descr': 'zz', 'fortran_order': False, 'shape': (200, 200, 16), }",
    ],
)
def test_an_unreadable_npy_header_is_one_short_line(tmp_path, text):
    path = write_npz(tmp_path / "labels.npz", _with("labels", "semantics", raw_npy_header(text)))
    msg = _refused(read_labels, path, "semantics: is not a readable .npy array")
    assert len(msg) < 600, msg


@pytest.mark.parametrize("kind", READERS)
def test_a_member_longer_than_its_array_is_refused_unread(tmp_path, kind):
    read, name = READERS[kind]
    key = "semantics" if kind == "labels" else "arr_0"
    path = write_npz(tmp_path / name, _with(kind, key, npy_header(OCC_SHAPE) + bytes(640000 + (64 << 20))))
    _refused(read, path, "holds more than its array", "holds 67748864 bytes")


@pytest.fixture(scope="module")
def gigabyte_files(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Files of 10 MB holding a member that inflates to 2 GiB of zeros (header: uint8 (2**31,)), under a key the
    reader needs and under a key it does not: {case: (reader, path)}. The member is deflated once (3 s)."""
    t = tmp_path_factory.mktemp("gigabyte")
    base = write_npz(t / "base.npz", {"semantics": zeros_member(2 * GIB)})
    files = {
        "labels, expected key": ("read_labels", t / "labels_expected" / "labels.npz"),
        "labels, extra key": ("read_labels", t / "labels_extra" / "labels.npz"),
        "prediction, expected key": ("read_prediction", t / "pred_expected" / "tok.npz"),
        "prediction, extra key": ("read_prediction", t / "pred_extra" / "tok.npz"),
    }
    for _, path in files.values():
        path.parent.mkdir()
    labels = _labels()
    shutil.copyfile(base, files["labels, expected key"][1])
    write_npz(files["labels, expected key"][1], {k: labels[k] for k in ("mask_lidar", "mask_camera")}, mode="a")
    write_npz(renamed(base, files["labels, extra key"][1], "semantics", "unlabeled"), labels, mode="a")
    renamed(base, files["prediction, expected key"][1], "semantics", "arr_0.npy")
    write_npz(renamed(base, files["prediction, extra key"][1], "semantics", "unlabeled"), {"arr_0": _pred()}, "a")
    return files


# A fresh interpreter reads each file with its address space capped at 512 MiB above what its imports took:
# a reader that inflates or allocates a gigabyte member fails there with MemoryError instead of taking the
# memory from the machine. It prints what each read ended in and how much its peak RSS grew.
CAPPED_READS = """
import json, resource, sys
from bev.tasks.occupancy import io as occ_io
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20),) * 2)
out = {}
for case, (reader, path) in json.loads(sys.argv[1]).items():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        getattr(occ_io, reader)(path)
        out[case] = ["read"]
    except occ_io.OccupancyFileError as e:
        out[case] = ["refused", str(e)]
    except MemoryError as e:
        out[case] = ["MemoryError", str(e)]
    out[case].append((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
print(json.dumps(out))
"""


def test_gigabyte_members_are_never_inflated(gigabyte_files):
    assert all(p.stat().st_size < 20 << 20 for _, p in gigabyte_files.values())
    cases = {case: (reader, str(path)) for case, (reader, path) in gigabyte_files.items()}
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED_READS, json.dumps(cases)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (_, path) in cases.items():
        outcome, *rest, grew_mib = got[case]
        if "expected key" in case:
            assert outcome == "refused", (case, got[case])
            assert path in rest[0] and "has shape (2147483648,), expected (200, 200, 16)" in rest[0], rest
        else:  # a member nobody asked for is never read
            assert outcome == "read", (case, got[case])
        assert grew_mib < 64, (case, grew_mib)
