"""The data arguments, each declared once: name, default, check and meaning.

    DatasetConfig   what every dataset of a run shares (where the data is, inputs, targets, windows)
    LoaderConfig    how batches are loaded (batch size, loader processes)
    DataConfig      both, plus the DataModule's own: the two splits and training augmentation; it is
                    the `data:` config node, the arguments of NuScenesDataModule

The dataset's own arguments (split, augment, verbose) are not here: they differ between the datasets
of one run. NuScenesBEVDataset takes a DatasetConfig and NuScenesDataModule a DataConfig, or the same
fields as keyword arguments; unknown names are refused with a did-you-mean hint, and every value is
checked (and normalised: tuples, a Grid, category groups) when a config is built.

Hydra: importing this module registers two schemas in the `data` group, built from DataConfig, so the
YAML files state only what differs from the defaults below, `data.<key>=...` type-checks at composition
and an unknown `+data.<key>` is refused there:
    data/schema             every DataConfig field with its default (data/nuscenes.yaml extends it)
    data/checkpoint_schema  every field but FROM_CHECKPOINT, default null (bev-eval and bev-predict:
                            null keeps the checkpoint's value)
"""

from __future__ import annotations

import difflib
import math
import operator
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Optional

from bev.classes import normalize_categories, normalize_map_layers

# Settings a checkpoint's network was built for: bev-eval and bev-predict always take them from it.
FROM_CHECKPOINT = ("grid", "final_dim", "augment")
_SCALARS = (str, int, float, bool)


# ---------------------------------------------------------------- checks (value -> normalised value)


def _fail(name: str, want: str, value: Any) -> ValueError:
    return ValueError(f"data.{name} must be {want}, got {value!r}")


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(name, "a non-empty string", v)
    return v


def _path(name: str, v: Any) -> str:
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise _fail(name, "a folder path", v)
    return str(Path(v).expanduser())


def _optional_path(name: str, v: Any) -> str | None:
    return None if v is None else _path(name, v)


def _flag(name: str, v: Any) -> bool:
    # 0/1 and "yes" are not silently read as flags: YAML and Hydra give real booleans.
    if type(v).__name__ not in ("bool", "bool_"):
        raise _fail(name, "true or false", v)
    return bool(v)


def _whole(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    try:
        if isinstance(v, bool):
            raise TypeError
        n = operator.index(v)  # ints and NumPy ints, not 1.5 or "2"
    except TypeError:
        n = None
    if n is None or n < lo or (hi is not None and n > hi):
        raise _fail(name, f"a whole number >= {lo}" + (f" and <= {hi}" if hi is not None else ""), v)
    return int(n)


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(name, "a finite number", v)
    return float(v)


def _pair(name: str, v: Any, want: str) -> tuple:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) != 2:
        raise _fail(name, want, v)
    return tuple(v)


def _size(name: str, v: Any) -> tuple[int, int]:
    want = "[H, W], two whole numbers >= 1"
    try:
        return tuple(_whole(name, x, 1) for x in _pair(name, v, want))
    except ValueError:
        raise _fail(name, want, v) from None


def _range(name: str, v: Any) -> tuple[float, float] | None:
    if v is None:
        return None
    lo, hi = (_number(name, x) for x in _pair(name, v, "[lo, hi] with lo <= hi, or null"))
    if lo > hi:
        raise _fail(name, "[lo, hi] with lo <= hi, or null", v)
    return lo, hi


def _memo(name: str, v: Any) -> float:
    mb = _number(name, v)
    if mb < 0:
        raise _fail(name, ">= 0 (0 turns the memo off)", v)
    return mb


def _grid(name: str, v: Any):
    from bev.geometry import Grid  # torch: imported when a config is built, not when a config is composed

    return Grid.from_any(v)


def _raster(name: str, v: Any) -> str:
    from bev.data.rasterize import check_raster

    return check_raster(v)


def _frames(name: str, v: Any) -> int:
    from bev.data.temporal import check_frames

    return check_frames(v, 0)[0] if name == "past_frames" else check_frames(0, v)[1]


def _label_warp(name: str, v: Any) -> str:
    from bev.data.temporal import check_label_warp

    return check_label_warp(v)


def _bev_aug(name: str, v: Any):
    from bev.data.bev_aug import BevAugRanges

    return BevAugRanges.from_any(v)


def _lidar(name: str, v: Any):
    from bev.data.lidar import LidarOptions

    return LidarOptions.from_any(v)


def _choice(name: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise _fail(name, f"one of {', '.join(choices)}", v)
    return v


DEPTH_STRIDES = (8, 16)  # the camera encoder's strides (bev.models.camera.STRIDES)


def _depth_stride(name: str, v: Any) -> int | None:
    if v is None:
        return None
    try:
        n = None if isinstance(v, bool) else operator.index(v)  # 8, not 8.0 or "8"
    except TypeError:
        n = None
    if n not in DEPTH_STRIDES:
        raise _fail(name, "8 or 16 (model.net.camera.downsample), or null for the model's stride", v)
    return n


def _categories(name: str, v: Any) -> tuple[tuple[str, ...], ...]:
    return normalize_categories(v)


def _map_layers(name: str, v: Any) -> tuple[str, ...]:
    return normalize_map_layers(v)


def _option(default: Any, check, *args) -> Any:
    """A field: its default and its check (check(name, value, *args) -> the normalised value)."""
    return field(default=default, metadata={"check": check, "args": args})


def _required(check, *args) -> Any:
    return field(metadata={"check": check, "args": args})


# ---------------------------------------------------------------- the declarations


class _Checked:
    """Runs each field's check; `build` refuses unknown names; the keys of a config are its field names."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check, args = f.metadata["check"], f.metadata["args"]
            object.__setattr__(self, f.name, check(f.name, getattr(self, f.name), *args))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def build(cls, base: Any = None, /, **options: Any):
        """A config of this class: `base` (None, a config that has these fields, or a mapping such as a
        Hydra node) with `options` replacing its values. Unknown names are refused with a hint."""
        values = dict(base) if isinstance(base, Mapping) else {}
        if base is not None and not isinstance(base, Mapping):
            values = {k: getattr(base, k) for k in cls.keys()}
        values.update(options)
        refuse_unknown(values, cls)
        if "dataroot" in cls.keys() and values.get("dataroot") is None:
            raise ValueError("data.dataroot is required: pass data.dataroot=<the folder holding <version>/*.json>")
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class DatasetConfig(_Checked):
    """What every dataset of a run shares. After construction the values are normalised: grid a
    bev.geometry.Grid, categories one tuple of prefixes per class, map_layers a tuple of class names,
    pairs tuples of numbers, paths strings."""

    dataroot: str = _required(_path)  # folder of <version>/*.json (the 13 tables), samples/ and maps/
    version: str = _option("v1.0-mini", _text)  # table folder: v1.0-mini | v1.0-trainval | ...
    grid: Any = _option(None, _grid)  # BEV grid and depth bins (a Grid or its bounds); null: LSS's
    final_dim: Any = _option((128, 352), _size)  # [H, W] of the network input after resize + crop
    resize_lim: Any = _option(None, _range)  # training resize range, absolute; null: LSS's scaled to final_dim
    bot_pct_lim: Any = _option(None, _range)  # training range of the cropped bottom fraction; null: LSS's
    rot_lim: Any = _option(None, _range)  # training rotation range in degrees; null: LSS's
    rand_flip: bool = _option(True, _flag)  # training: random horizontal flips
    ncams: int = _option(6, _whole, 1, 6)  # training: a random subset of ncams cameras (val: all 6)
    # object classes: a list of prefixes = 1 class; a list of lists = one class each
    categories: Any = _option(("vehicle.",), _categories)
    # HD-map classes after the object classes: null | bevfusion | lss | [drivable_area, ...]
    map_layers: Any = _option(None, _map_layers)
    # object targets: center (cell centre in the box) | lss (LSS's rounded corners)
    raster: str = _option("center", _raster)
    # items carry the cameras' images and geometry; false: none (a LiDAR-only network reads none, so none is decoded)
    cameras: bool = _option(True, _flag)
    # items carry the depth bin of the nearest LIDAR_TOP point per feature cell
    depth_target: bool = _option(False, _flag)
    # the feature cells' stride in pixels: 8 or 16; null: the model's (bev-train sets model.net.camera.downsample), else 16
    depth_stride: int | None = _option(None, _depth_stride)
    # items carry 3D boxes and CenterPoint targets of the detection classes (bev.tasks.detection.targets)
    detection: bool = _option(False, _flag)
    # detection boxes trained on: class (the devkit's class ranges, as it scores) | grid (every box in the grid
    # with points, mmdet3d's ObjectRangeFilter; scoring still applies the class ranges)
    det_range: str = _option("class", _choice, ("class", "grid"))
    # items carry Occ3D occupancy labels from <dataroot>/gts/<scene>/<sample token>/labels.npz
    # (bev.tasks.occupancy.data)
    occupancy: bool = _option(False, _flag)
    # training: BEV augmentation (bev.data.bev_aug): null | bevdet | {rot_lim, scale_lim, flip_x, flip_y}
    bev_aug: Any = _option(None, _bev_aug)
    # items carry "points": LIDAR_TOP key frame + sweeps in the ego frame (bev.data.lidar):
    # null (off) | {enabled: true|false, sweeps: 0..30, max_points: >= 1}
    lidar: Any = _option(None, _lidar)
    # without augmentation, MB of decoded inputs kept per loader process; 0: off
    input_memo_mb: float = _option(0.0, _memo)
    past_frames: int = _option(0, _frames)  # temporal windows: P input frames before the present (FIERY: 2)
    future_frames: int = _option(0, _frames)  # F frames after the present, labels only (FIERY: 4)
    filter_invisible: bool = _option(False, _flag)  # temporal labels drop boxes of visibility level 1 (FIERY's filter)
    label_warp: str = _option("exact", _label_warp)  # exact | fiery (FIERY's label warp, lateral sign error included)
    cache_dir: str | None = _option(None, _optional_path)  # where split indexes are cached; null: <dataroot>/.bev_cache


@dataclass(frozen=True, kw_only=True)
class LoaderConfig(_Checked):
    """How the DataLoaders batch the items."""

    batch_size: int = _option(4, _whole, 1)  # items (samples or windows) per batch, per process
    num_workers: int = _option(2, _whole, 0)  # loader processes; 0: load in the main process
    pin_memory: bool = _option(False, _flag)  # page-locked batches, for faster copies to a GPU
    persistent_workers: bool = _option(True, _flag)  # keep the loader processes between epochs (num_workers > 0)


@dataclass(frozen=True, kw_only=True)
class DataConfig(LoaderConfig, DatasetConfig):
    """The `data:` config node: NuScenesDataModule's arguments."""

    train_split: str = _option("mini_train", _text)  # the training split (a devkit split or <version>/splits.json)
    val_split: str = _option("mini_val", _text)  # the validation split; test = the val split
    augment: bool = _option(True, _flag)  # augment training (LSS resize/crop/flip/rotate, ncams); val never is
    # detection training: class-balanced grouping and sampling (bev.data.cbgs; mmdet3d's CBGSDataset)
    cbgs: bool = _option(False, _flag)

    @property
    def dataset(self) -> DatasetConfig:
        return DatasetConfig(**{k: getattr(self, k) for k in DatasetConfig.keys()})

    @property
    def loader(self) -> LoaderConfig:
        return LoaderConfig(**{k: getattr(self, k) for k in LoaderConfig.keys()})


def refuse_unknown(options: Mapping[str, Any], cls: type[_Checked] = DataConfig) -> None:
    """One error naming every key `cls` does not declare, each with its nearest declared key."""
    known = cls.keys()
    unknown = [k for k in options if k not in known]
    if not unknown:
        return
    hints = []
    for k in unknown:
        near = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
        hints.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    raise ValueError(
        f"unknown {cls.__name__} key(s) {', '.join(hints)}; the keys are {', '.join(known)} (bev/data/config.py)"
    )


def check_training(data: Mapping[str, Any]) -> None:
    """What bev-train refuses in the `data:` node that a DataConfig alone takes (bev-eval and bev-predict build
    theirs with augment off): BEV augmentation without data.augment, which would be silently skipped."""
    bev_aug = data.get("bev_aug")
    if bev_aug is not None and data.get("augment") is False:
        shown = bev_aug if isinstance(bev_aug, str) else dict(bev_aug) if isinstance(bev_aug, Mapping) else bev_aug
        raise ValueError(
            f"data.bev_aug={shown} does nothing with data.augment=false: BEV augmentation is training augmentation "
            "and follows data.augment. Pass data.augment=true (which turns the image augmentation on too) or "
            "data.bev_aug=null"
        )


# ---------------------------------------------------------------- Hydra schemas


def _hydra_type(tp: Any) -> Any:
    """The annotation OmegaConf validates: plain scalars (optional or not) as they are, the rest Any
    (checked when the config is built)."""
    if tp in _SCALARS:
        return tp
    args = typing.get_args(tp)
    if len(args) == 2 and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return Optional[inner] if inner in _SCALARS else Any  # noqa: UP045 (OmegaConf reads typing.Optional)
    return Any


def hydra_schema(cls: type[_Checked], name: str, overrides: bool = False, skip: Sequence[str] = ()) -> type:
    """A dataclass OmegaConf takes as a schema: `cls`'s fields with their defaults (required ones ???),
    plus `_target_` (stated in the YAML); with `overrides` every field is optional and null by default."""
    hints = typing.get_type_hints(cls)
    specs: list[tuple] = [] if overrides else [("_target_", str, field(default="???"))]
    for f in fields(cls):
        if f.name in skip:
            continue
        tp = _hydra_type(hints[f.name])
        if overrides:
            specs.append((f.name, Any if tp is Any else Optional[tp], field(default=None)))  # noqa: UP045
        else:
            specs.append((f.name, tp, field(default="???" if f.default is MISSING else f.default)))
    return make_dataclass(name, specs)


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="data", name="schema", node=hydra_schema(DataConfig, "DataSchema"))
    store.store(
        group="data",
        name="checkpoint_schema",
        node=hydra_schema(DataConfig, "DataOverridesSchema", overrides=True, skip=FROM_CHECKPOINT),
    )


register_schemas()
