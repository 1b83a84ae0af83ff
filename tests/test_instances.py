"""Instance decoding (centres, offsets, flow-matched ids) recovers known instances from perfect heads."""

import math

import pytest
import torch

from bev.geometry import Grid
from bev.tasks.motion.instances import (
    decode_instances,
    decode_sequence,
    find_centres,
    instance_paths,
    make_consistent,
    predict_instances,
    propagate_instances,
)

X, Y = 24, 20


def boxes(*specs: tuple[int, int, int, int, int], base: torch.Tensor | None = None) -> torch.Tensor:
    """(X, Y) ids from (id, x0, x1, y0, y1) boxes."""
    f = torch.zeros(X, Y, dtype=torch.int64) if base is None else base.clone()
    for i, x0, x1, y0, y1 in specs:
        f[x0:x1, y0:y1] = i
    return f


def centre(mask: torch.Tensor) -> torch.Tensor:
    """The label centre: the mean cell, rounded."""
    return mask.nonzero().double().mean(0).round()


def perfect_heads(instances: torch.Tensor):
    """segmentation, centerness, offset, flow as ideal heads would give them for (T, X, Y) ids."""
    T = instances.shape[0]
    cells = torch.stack(torch.meshgrid(torch.arange(X), torch.arange(Y), indexing="ij")).double()  # (2, X, Y)
    heat, offset, flow = torch.zeros(T, 1, X, Y), torch.full((T, 2, X, Y), 255.0), torch.zeros(T, 2, X, Y)
    for t in range(T):
        for i in instances[t][instances[t] > 0].unique():
            m = instances[t] == i
            c = centre(m)
            heat[t, 0] = torch.maximum(heat[t, 0], torch.exp(-((cells - c[:, None, None]) ** 2).sum(0) / 9).float())
            offset[t][:, m] = (c[:, None] - cells[:, m]).float()
            if t + 1 < T and (instances[t + 1] == i).any():
                flow[t][:, m] = (centre(instances[t + 1] == i) - c).float()[:, None]
    return instances > 0, heat, offset, flow


def test_centres_are_thresholded_local_maxima():
    heat = torch.zeros(X, Y)
    heat[5, 5], heat[5, 6] = 0.9, 0.8  # suppressed by its neighbour
    heat[5, 9] = 0.7  # 3 cells away: kept
    heat[15, 15] = 0.1  # not above the threshold
    heat[20, 3] = heat[20, 4] = 0.5  # a tied plateau keeps both
    assert find_centres(heat[None]).tolist() == [[5, 5], [5, 9], [20, 3], [20, 4]]
    assert find_centres(heat, nms_kernel=7).tolist() == [[5, 5], [20, 3], [20, 4]]
    assert find_centres(heat, threshold=0.6).tolist() == [[5, 5], [5, 9]]


def test_too_many_centres_keep_the_best_scores_in_raster_order():
    heat = torch.zeros(X, Y)
    heat[2, 2], heat[2, 10], heat[10, 2], heat[10, 10] = 0.3, 0.9, 0.5, 0.8
    assert find_centres(heat, max_instances=2).tolist() == [[2, 10], [10, 10]]


def test_decoding_recovers_instances_including_touching_vehicles():
    truth = boxes((1, 2, 6, 2, 8), (2, 10, 14, 3, 7), (3, 10, 14, 7, 11), (4, 18, 22, 12, 19))  # 2 and 3 touch
    seg, heat, offset, _ = perfect_heads(truth[None])
    assert torch.equal(decode_instances(seg[0], heat[0], offset[0]), truth)  # ids in raster order of centres


def test_decoding_tolerates_offset_noise_and_a_stray_cell_joins_the_nearest_centre():
    truth = boxes((1, 2, 8, 2, 8), (2, 12, 18, 10, 16))
    seg, heat, offset, _ = perfect_heads(truth[None])
    noisy = offset[0] + 0.6 * torch.randn(offset[0].shape, generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    seg[0, 10, 2] = True  # foreground with an offset pointing nowhere: nearest to (4, 4)
    noisy[:, 10, 2] = 0
    want = truth.clone()
    want[10, 2] = 1
    assert torch.equal(decode_instances(seg[0], heat[0], noisy), want)


def test_decoding_without_centres_or_foreground_is_background():
    seg, heat, offset, _ = perfect_heads(boxes((1, 2, 6, 2, 6))[None])
    assert not decode_instances(seg[0], torch.zeros_like(heat[0]), offset[0]).any()
    assert not decode_instances(torch.zeros_like(seg[0]), heat[0], offset[0]).any()


def test_a_frame_wholly_foreground_keeps_all_its_instances():
    truth = boxes((1, 0, 12, 0, Y), (2, 12, X, 0, Y))
    seg, heat, offset, _ = perfect_heads(truth[None])
    assert torch.equal(decode_instances(seg[0], heat[0], offset[0]), truth)


def moving_scene(T: int, step: int) -> torch.Tensor:
    """Vehicle 1 drives +x, vehicle 2 drives -y, `step` cells per frame."""
    return torch.stack(
        [boxes((1, 1 + step * t, 4 + step * t, 2, 5), (2, 14, 17, 14 - step * t, 18 - step * t)) for t in range(T)]
    )


def test_ids_follow_moving_vehicles_and_a_new_vehicle_gets_a_new_id():
    truth = moving_scene(4, 2)
    truth[2:] = torch.stack([boxes((3, 19, 22, 1, 4), base=f) for f in truth[2:]])  # appears at t = 2
    _, _, _, flow = perfect_heads(truth)
    scrambled = torch.stack([truth[0]] + [torch.where(f > 0, 4 - f + 7 * t, 0) for t, f in enumerate(truth[1:])])
    out = make_consistent(scrambled, flow)
    assert torch.equal(out, truth)


def test_flow_carries_ids_over_moves_beyond_the_matching_threshold():
    truth = moving_scene(3, 5)
    _, _, _, flow = perfect_heads(truth)
    assert torch.equal(make_consistent(truth, flow), truth)
    out = make_consistent(truth, torch.zeros_like(flow))  # without flow every frame's vehicles are new
    assert out[1].unique().tolist() == [0, 3, 4] and out[2].unique().tolist() == [0, 5, 6]


def test_ids_after_a_gap_or_an_empty_frame_are_new():
    truth = moving_scene(3, 1)
    truth[1] = torch.where(truth[1] == 2, 0, truth[1])  # vehicle 2 unseen at t = 1
    _, _, _, flow = perfect_heads(truth)
    assert make_consistent(truth, flow)[2].unique().tolist() == [0, 1, 3]
    truth[1] = 0
    assert make_consistent(truth, flow)[2].unique().tolist() == [0, 3, 4]


def test_predict_instances_from_perfect_heads_batched():
    first = moving_scene(4, 2)
    second = torch.stack([boxes((1, 8 + t, 12 + t, 8, 12), (2, 12 + t, 16 + t, 8, 12)) for t in range(4)])
    heads = [perfect_heads(s) for s in (first, second)]
    for truth, h in zip((first, second), heads):
        assert torch.equal(predict_instances(*h), truth)
    batched = predict_instances(*(torch.stack(parts) for parts in zip(*heads)))
    assert torch.equal(batched, torch.stack([first, second]))
    flipped = torch.where(second > 0, 3 - second, 0)
    per_frame = torch.stack([flipped[t] if t % 2 else second[t] for t in range(4)])  # ids exchanged at t = 1, 3
    out = make_consistent(torch.stack([first, per_frame]), torch.stack([h[3] for h in heads]))
    assert torch.equal(out, torch.stack([first, second]))


def test_instance_paths_are_mean_cells_per_frame():
    truth = moving_scene(3, 2)
    truth[2] = torch.where(truth[2] == 2, 0, truth[2])
    paths = instance_paths(truth)
    assert list(paths) == [1, 2]
    assert paths[1].tolist() == [[2.0, 3.0], [4.0, 3.0], [6.0, 3.0]]
    assert paths[2][:2].tolist() == [[15.0, 15.5], [15.0, 13.5]] and all(math.isnan(v) for v in paths[2][2])
    grid = Grid(xbound=(-6, 6, 0.5), ybound=(-5, 5, 0.5))
    assert instance_paths(truth, grid)[1][0].tolist() == [-6 + 2.5 * 0.5, -5 + 3.5 * 0.5]
    assert len(instance_paths(truth[None])) == 1


def test_bad_shapes_are_named():
    seg, heat, offset, flow = perfect_heads(moving_scene(2, 1))
    with pytest.raises(ValueError, match=r"offset must be \(2, X, Y\)"):
        decode_instances(seg[0], heat[0], offset[0, :1])
    with pytest.raises(ValueError, match="flow must be"):
        predict_instances(seg, heat, offset, flow[:1])
    with pytest.raises(ValueError, match="nms_kernel"):
        find_centres(heat[0], nms_kernel=2)
    with pytest.raises(ValueError, match=r"instances must be \(T, X, Y\)"):
        make_consistent(seg[0].long(), flow)


def test_propagation_carries_the_present_ids_by_the_flow_even_far_and_touching():
    first = moving_scene(4, 5)  # beyond FIERY's matching threshold per frame
    second = torch.stack([boxes((1, 8 + t, 12 + t, 8, 12), (2, 12 + t, 16 + t, 8, 12)) for t in range(4)])  # touching
    heads = [perfect_heads(s) for s in (first, second)]
    batched = propagate_instances(*(torch.stack(parts) for parts in zip(*heads)))
    assert torch.equal(batched, torch.stack([first, second]))
    assert torch.equal(decode_sequence(*heads[0], method="propagate"), first)
    assert torch.equal(decode_sequence(*heads[0], method="fiery"), predict_instances(*heads[0]))


def test_propagation_gives_a_vehicle_coming_into_view_a_new_id():
    truth = moving_scene(4, 1)
    truth[2:] = torch.stack([boxes((3, 19, 22, 1, 4), base=f) for f in truth[2:]])  # appears at t = 2
    assert torch.equal(propagate_instances(*perfect_heads(truth)), truth)


def test_an_unknown_decoding_is_named():
    with pytest.raises(ValueError, match="propagate"):
        decode_sequence(*perfect_heads(moving_scene(2, 1)), method="hungarian")
