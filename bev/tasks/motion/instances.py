"""Vehicle instances decoded from the centerness, offset and flow heads, by FIERY's rules.

Conventions (bev.geometry): BEV arrays are indexed [x, y] (row = forward axis). Offsets and flows
are in grid cells, channel 0 along x (rows), channel 1 along y (columns); offset = centre - cell;
flow[t] is the motion of an instance's centre from frame t to t + 1. Instance maps are int64,
0 = background, 1.. = instances.

Per frame (decode_instances):
- centres (find_centres): cells whose centerness is > threshold and equal to the maximum of their
  nms_kernel x nms_kernel neighbourhood; every cell of a tied plateau is a centre;
- every foreground cell joins the centre nearest (Euclidean, in cells) to cell + offset, the first
  centre in raster order on ties; centres that get no cell are dropped and the rest numbered
  1..K in raster order.
Over time, two ways. propagate_instances (the default of the temporal model, as PowerBEV): frame 0's
instances are carried forward, each future cell joining the instance of the frame before whose
flow-moved centre is nearest to cell + offset. make_consistent (FIERY's; predict_instances): every
frame decoded on its own, then each instance of frame t is moved by the mean flow over its cells;
these moved centres are matched to the centres (mean cell) of frame t + 1's instances by the
Hungarian algorithm on Euclidean distance; a pair closer than matching_threshold cells keeps
frame t's id, every other instance of frame t + 1 gets a new id. Frame 0 keeps its own ids.

Where FIERY's code (fiery/utils/instance.py) breaks on edge cases this module differs on purpose:
- more than max_instances centres: the highest-scoring ones are kept (FIERY keeps the first ones
  in raster order);
- a frame whose every cell is foreground keeps all its instances (FIERY's renumbering turns the
  first one into background);
- after a frame without instances, the next frame's instances get new ids (FIERY passes that
  frame's ids through unchanged, so they can collide with ids already used).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bev.geometry import Grid


def _head(t: torch.Tensor, name: str, channels: int) -> torch.Tensor:
    """(C, X, Y) float view of one frame of a head; a single-channel head may come as (X, Y)."""
    if channels == 1 and t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[0] != channels:
        raise ValueError(f"{name} must be ({channels}, X, Y) for one frame, got {tuple(t.shape)}")
    return t.detach().float()


def find_centres(
    centerness: torch.Tensor, threshold: float = 0.1, nms_kernel: int = 3, max_instances: int = 100
) -> torch.Tensor:
    """(1, X, Y) or (X, Y) centerness -> (N, 2) int64 (x, y) cells of the instance centres, raster order."""
    heat = _head(centerness, "centerness", channels=1)[0]
    if nms_kernel < 1 or nms_kernel % 2 == 0:
        raise ValueError(f"nms_kernel must be an odd number >= 1, got {nms_kernel}")
    if max_instances < 1:
        raise ValueError(f"max_instances must be >= 1, got {max_instances}")
    pooled = F.max_pool2d(heat[None, None], nms_kernel, stride=1, padding=nms_kernel // 2)[0, 0]
    keep = (heat > threshold) & (heat == pooled)
    centres = keep.nonzero()  # raster order
    if len(centres) > max_instances:
        scores = heat[keep]
        best = torch.sort(scores, descending=True, stable=True).indices[:max_instances]
        centres = centres[best.sort().values]
    return centres


def _renumber(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Ids in 0..n -> consecutive ids, order kept, 0 stays 0, unused ids dropped."""
    used = torch.zeros(n + 1, dtype=torch.bool, device=ids.device)
    used[ids] = True
    used[0] = False
    new = used.cumsum(0)
    return new[ids]


def decode_instances(
    segmentation: torch.Tensor,
    centerness: torch.Tensor,
    offset: torch.Tensor,
    threshold: float = 0.1,
    nms_kernel: int = 3,
    max_instances: int = 100,
) -> torch.Tensor:
    """One frame: (X, Y) bool foreground, (1, X, Y) centerness, (2, X, Y) offset -> (X, Y) int64 ids."""
    off = _head(offset, "offset", channels=2)
    if segmentation.shape != off.shape[1:]:
        raise ValueError(
            f"segmentation {tuple(segmentation.shape)} must be (X, Y) = {tuple(off.shape[1:])}, the offset's grid"
        )
    centres = find_centres(centerness, threshold, nms_kernel, max_instances)
    out = torch.zeros(segmentation.shape, dtype=torch.int64, device=off.device)
    fg = segmentation.bool().to(off.device)
    if len(centres) == 0 or not fg.any():
        return out
    cells = fg.nonzero()  # (M, 2)
    votes = cells.to(off.dtype) + off[:, fg].T  # where each cell says its centre is
    dist = ((votes[:, None, :] - centres[None].to(off.dtype)) ** 2).sum(-1)  # (M, N)
    ids = dist.argmin(1) + 1  # the first of equal minima: raster order of the centres
    out[fg] = _renumber(ids, len(centres))
    return out


def instance_centres(instances: torch.Tensor, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Y) ids -> (ids (K,), centres (K, 2) float64): the mean (x, y) cell of each instance, of
    cell + shift when a (2, X, Y) shift (e.g. flow) is given."""
    fg = instances > 0
    ids, inverse = torch.unique(instances[fg], return_inverse=True)
    points = fg.nonzero().double()
    if shift is not None:
        points = points + shift.detach().double()[:, fg].T
    sums = torch.zeros(len(ids), 2, dtype=torch.float64, device=instances.device).index_add_(0, inverse, points)
    counts = torch.bincount(inverse, minlength=len(ids)).double()
    return ids, sums / counts[:, None]


def _relabel(frame: torch.Tensor, old: list[int], new: list[int]) -> torch.Tensor:
    lut = torch.zeros(int(frame.max()) + 1, dtype=torch.int64, device=frame.device)
    lut[torch.as_tensor(old, dtype=torch.int64, device=frame.device)] = torch.as_tensor(
        new, dtype=torch.int64, device=frame.device
    )
    return lut[frame]


def _match(prev: torch.Tensor, flow: torch.Tensor, cur: torch.Tensor, threshold: float) -> dict[int, int]:
    """{id in cur: id in prev} for the Hungarian pairs of flow-moved prev centres and cur centres."""
    from scipy.optimize import linear_sum_assignment  # scipy comes with nuscenes-devkit

    prev_ids, moved = instance_centres(prev, flow)
    cur_ids, centres = instance_centres(cur)
    if len(prev_ids) == 0 or len(cur_ids) == 0:
        return {}
    dist = (moved[:, None] - centres[None]).norm(dim=-1).cpu().numpy()
    rows, cols = linear_sum_assignment(dist)
    ok = dist[rows, cols] < threshold
    return {int(cur_ids[c]): int(prev_ids[r]) for r, c in zip(rows[ok], cols[ok])}


def make_consistent(instances: torch.Tensor, flow: torch.Tensor, matching_threshold: float = 3.0) -> torch.Tensor:
    """(T, X, Y) per-frame ids + (T, 2, X, Y) flow -> (T, X, Y) ids that persist over time (B leading kept)."""
    if instances.dim() == 4 and flow.dim() == 5:
        return torch.stack([make_consistent(i, f, matching_threshold) for i, f in zip(instances, flow)])
    if instances.dim() != 3 or flow.shape != (instances.shape[0], 2, *instances.shape[1:]):
        raise ValueError(
            f"instances must be (T, X, Y) and flow (T, 2, X, Y) on the same grid, got "
            f"{tuple(instances.shape)} and {tuple(flow.shape)}"
        )
    frames = [instances[0].long()]
    next_id = int(frames[0].max()) + 1 if frames[0].numel() else 1
    for t in range(1, instances.shape[0]):
        cur = instances[t].long()
        mapping = _match(frames[-1], flow[t - 1], cur, matching_threshold)
        for i in torch.unique(cur[cur > 0]).tolist():
            if i not in mapping:
                mapping[i], next_id = next_id, next_id + 1
        frames.append(_relabel(cur, list(mapping), list(mapping.values())) if mapping else cur.clone())
    return torch.stack(frames)


def predict_instances(
    segmentation: torch.Tensor,
    centerness: torch.Tensor,
    offset: torch.Tensor,
    flow: torch.Tensor | None = None,
    threshold: float = 0.1,
    nms_kernel: int = 3,
    max_instances: int = 100,
    matching_threshold: float = 3.0,
) -> torch.Tensor:
    """Per-frame decoding, then ids made consistent over time by the flow.

    segmentation (T, X, Y) bool, centerness (T, 1, X, Y), offset (T, 2, X, Y), flow (T, 2, X, Y)
    -> (T, X, Y) int64; a leading batch axis B on all of them is kept. flow None: zero flow (FIERY
    does the same when its model has no flow head).
    """
    if segmentation.dim() == 4:
        return torch.stack(
            [
                predict_instances(
                    segmentation[b],
                    centerness[b],
                    offset[b],
                    None if flow is None else flow[b],
                    threshold,
                    nms_kernel,
                    max_instances,
                    matching_threshold,
                )
                for b in range(segmentation.shape[0])
            ]
        )
    T, X, Y = _check_sequence(segmentation, centerness, offset, flow)
    frames = torch.stack(
        [
            decode_instances(segmentation[t], centerness[t], offset[t], threshold, nms_kernel, max_instances)
            for t in range(T)
        ]
    )
    if flow is None:
        flow = torch.zeros(T, 2, X, Y, device=frames.device)
    return make_consistent(frames, flow, matching_threshold)


def propagate_instances(
    segmentation: torch.Tensor,
    centerness: torch.Tensor,
    offset: torch.Tensor,
    flow: torch.Tensor,
    threshold: float = 0.1,
    nms_kernel: int = 3,
    max_instances: int = 100,
    matching_threshold: float = 3.0,
) -> torch.Tensor:
    """The present frame's instances carried over the future frames by the flow (as PowerBEV): frame 0 is
    decoded as decode_instances does; in frame t the centres are those of frame t - 1's instances, each
    moved by its mean flow, and those of frame t's own centerness (find_centres) farther than
    matching_threshold cells from all of them (a vehicle coming into view: a new id); each foreground
    cell joins the centre nearest to cell + offset.
    Shapes as predict_instances (B leading kept)."""
    if segmentation.dim() == 4:
        args = (threshold, nms_kernel, max_instances, matching_threshold)
        return torch.stack(
            [
                propagate_instances(segmentation[b], centerness[b], offset[b], flow[b], *args)
                for b in range(len(segmentation))
            ]
        )
    T, X, Y = _check_sequence(segmentation, centerness, offset, flow)
    frames = [decode_instances(segmentation[0], centerness[0], offset[0], threshold, nms_kernel, max_instances)]
    next_id = int(frames[0].max()) + 1
    for t in range(1, T):
        ids, centres = instance_centres(frames[-1], flow[t - 1])
        # centres this frame finds farther than matching_threshold from every carried one: new vehicles
        found = find_centres(centerness[t], threshold, nms_kernel, max_instances).double()
        if len(ids) and len(found):
            found = found[torch.cdist(found, centres).min(1).values > matching_threshold]
        new_ids = torch.arange(next_id, next_id + len(found), device=ids.device)
        ids, centres = torch.cat([ids, new_ids]), torch.cat([centres, found.to(centres)])
        out = torch.zeros(X, Y, dtype=torch.int64, device=frames[-1].device)
        fg = segmentation[t].bool().to(out.device)
        if len(ids) and fg.any():
            votes = fg.nonzero().double() + _head(offset[t], "offset", channels=2).double()[:, fg].T
            out[fg] = ids[torch.cdist(votes, centres).argmin(1)]
        next_id += len(found)
        frames.append(out)
    return torch.stack(frames)


DECODINGS = ("propagate", "fiery")


def decode_sequence(
    segmentation: torch.Tensor, centerness: torch.Tensor, offset: torch.Tensor, flow: torch.Tensor, method: str
) -> torch.Tensor:
    """Instances over the frames by `method`: "propagate" (propagate_instances) or "fiery" (predict_instances)."""
    if method == "propagate":
        return propagate_instances(segmentation, centerness, offset, flow)
    if method == "fiery":
        return predict_instances(segmentation, centerness, offset, flow)
    raise ValueError(f"instance decoding must be one of {DECODINGS}, got {method!r}")


def _check_sequence(segmentation, centerness, offset, flow) -> tuple[int, int, int]:
    if segmentation.dim() != 3:
        raise ValueError(f"segmentation must be (T, X, Y) or (B, T, X, Y), got {tuple(segmentation.shape)}")
    T, X, Y = segmentation.shape
    for name, t, c in (("centerness", centerness, 1), ("offset", offset, 2), ("flow", flow, 2)):
        if t is not None and tuple(t.shape) != (T, c, X, Y):
            raise ValueError(f"{name} must be {(T, c, X, Y)} to go with segmentation {(T, X, Y)}, got {tuple(t.shape)}")
    return T, X, Y


def instance_paths(instances: torch.Tensor, grid: Grid | None = None) -> dict[int, torch.Tensor]:
    """(T, X, Y) consistent ids -> {id: (T, 2) float64 centre per frame, NaN where the id is absent}.

    The centre is the mean (x, y) cell index of the instance; with a grid, ego (x, y) metres of that
    point instead. A (B, T, X, Y) input gives a list of such dicts.
    """
    if instances.dim() == 4:
        return [instance_paths(i, grid) for i in instances]
    if instances.dim() != 3:
        raise ValueError(f"instances must be (T, X, Y) or (B, T, X, Y), got {tuple(instances.shape)}")
    paths: dict[int, torch.Tensor] = {}
    T = instances.shape[0]
    for t in range(T):
        for i, c in zip(*instance_centres(instances[t])):
            paths.setdefault(int(i), torch.full((T, 2), math.nan, dtype=torch.float64))[t] = c.cpu()
    if grid is not None:
        lo = torch.tensor([grid.xbound[0], grid.ybound[0]], dtype=torch.float64)
        step = torch.tensor([grid.xbound[2], grid.ybound[2]], dtype=torch.float64)
        paths = {i: lo + (p + 0.5) * step for i, p in paths.items()}
    return dict(sorted(paths.items()))
