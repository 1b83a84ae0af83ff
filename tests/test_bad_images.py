"""Camera images are checked against their sample_data width/height before any pixel is decoded: a
different size is one clear error, and a decompression bomb under a camera's name is never decoded
(importing the devkit lifts PIL's own limit for the whole process)."""

import json
import shutil
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from bev.data import NuScenesBEVDataset


def _copy(synthetic_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(synthetic_root, root, ignore=shutil.ignore_patterns(".bev_cache"))
    return root


def _first_val_image(root):
    """(dataset row, camera index, path) of the first mini_val sample's CAM_FRONT, via the dataset index."""
    ds = NuScenesBEVDataset(root, split="mini_val", verbose=False)
    cam = 1  # CAM_FRONT in the dataset's camera order
    return ds, 0, cam, root / ds.index["image_path"][0, cam].decode()


def _png_header(path, width: int, height: int) -> None:
    """A PNG whose header claims width x height RGB pixels, with a token of pixel data (not a valid image)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def test_an_image_of_another_size_than_its_table_says_is_refused(synthetic_root, tmp_path):
    root = _copy(synthetic_root, tmp_path)
    ds, i, cam, path = _first_val_image(root)
    Image.fromarray(np.zeros((450, 800, 3), np.uint8)).save(path, format="JPEG")
    with pytest.raises(ValueError) as e:
        ds[i]
    msg = str(e.value)
    assert str(path) in msg and "800x450" in msg and "1600x900" in msg and "sample_data" in msg


def test_a_decompression_bomb_is_never_decoded(synthetic_root, tmp_path, monkeypatch):
    root = _copy(synthetic_root, tmp_path)
    ds, i, cam, path = _first_val_image(root)
    _png_header(path, 20000, 20000)  # 1.2 GB of RGB once decoded
    assert Image.open(path).size == (20000, 20000)  # the devkit's limit lets PIL open it

    loads = {cls: cls.load for cls in (ImageFile.ImageFile, Image.Image)}

    def guarded(cls):
        def load(self, *a, **k):
            assert self.size != (20000, 20000), "the bomb was decoded"
            return loads[cls](self, *a, **k)

        return load

    for cls in loads:  # the other cameras decode as usual
        monkeypatch.setattr(cls, "load", guarded(cls))
    with pytest.raises(ValueError, match="20000x20000 pixels but its sample_data lists 1600x900"):
        ds[i]


def test_the_tables_sizes_are_the_images_sizes_in_the_synthetic_set(synthetic_root):
    sd = json.loads((synthetic_root / "v1.0-mini" / "sample_data.json").read_text())
    cams = [r for r in sd if r["filename"].endswith(".jpg")]
    assert cams and all(Image.open(synthetic_root / r["filename"]).size == (r["width"], r["height"]) for r in cams)
