"""The synthetic HD map (nuScenes map expansion v1.3) as the unmodified devkit reads it.

The expected geometry is the generator's own shapely layers (bev.synthetic.roads), rasterised
here independently (point-in-polygon / distance-to-line at pixel centres), never through the
devkit or the writer's cv2 rasteriser; points known by construction come from the road
cross-section constants.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import shapely

from bev.data.rig import MINI_LOCATIONS
from bev.synthetic import roads as R
from bev.synthetic.world import SAMPLE_DT, World, build_world, ego_route, scene_rng
from bev.synthetic.writer import scene_names

SEED = 0  # as in conftest's synthetic_root
SCHEMA = {
    "version",
    "canvas_edge",
    "polygon",
    "line",
    "node",
    "drivable_area",
    "road_segment",
    "road_block",
    "lane",
    "ped_crossing",
    "walkway",
    "stop_line",
    "carpark_area",
    "road_divider",
    "lane_divider",
    "traffic_light",
    "lane_connector",
    "arcline_path_3",
    "connectivity",
}


@pytest.fixture(scope="module")
def maps(synthetic_root):
    from nuscenes.map_expansion.map_api import NuScenesMap

    locations = sorted({MINI_LOCATIONS[n] for n in scene_names(2)})
    return {loc: NuScenesMap(str(synthetic_root), loc) for loc in locations}


def _four_way(road: R.RoadMap) -> R.Junction:
    return next(j for j in road.junctions if len(j.arms) == 4)


def test_schema_and_links(synthetic_root, maps):
    for loc, m in maps.items():
        raw = json.loads((synthetic_root / "maps" / "expansion" / f"{loc}.json").read_text())
        assert set(raw) == SCHEMA and raw["version"] == "1.3"
        for layer in m.non_geometric_layers + ["lane_connector"]:
            assert len(getattr(m, layer)) > 0, (loc, layer)
        lane = m.lane[0]
        assert set(lane) >= {
            "polygon_token",
            "lane_type",
            "from_edge_line_token",
            "to_edge_line_token",
            "left_lane_divider_segments",
            "right_lane_divider_segments",
        }
        for rec in m.stop_line:  # every token the devkit resolves exists
            assert m.get("road_block", rec["road_block_token"]) and rec["cue"]
        for rec in m.lane + m.lane_connector:
            assert rec["token"] in m.arcline_path_3 and rec["token"] in m.connectivity
            for nxt in m.get_outgoing_lane_ids(rec["token"]):
                m.getind("lane" if nxt in m._token2ind["lane"] else "lane_connector", nxt)
        # The devkit's own lane sampling follows the lanes: sampled poses lie inside their lane polygon.
        poses = m.discretize_lanes([m.lane[3]["token"]], 1.0)[m.lane[3]["token"]]
        poly = m.extract_polygon(m.lane[3]["polygon_token"])
        assert len(poses) > 10 and all(poly.buffer(0.05).contains(shapely.Point(p[:2])) for p in poses)


def test_map_mask_around_a_junction_matches_the_generator(maps):
    """get_map_mask on a 60 m patch around a 4-way junction agrees with the generator's geometry."""
    for loc, m in maps.items():
        road = R.road_map(SEED, loc)
        j = _four_way(road)
        size, res = 60.0, 0.2
        n = int(size / res)
        layers = ["drivable_area", "ped_crossing", "walkway", "stop_line", "road_divider", "lane_divider"]
        got = m.get_map_mask((j.xy[0], j.xy[1], size, size), 0.0, layers, (n, n)).astype(bool)
        # Devkit canvas: row r <-> y = y_min + r res, column c <-> x = x_min + c res (it rounds scaled
        # coordinates to pixel centres; the patch is not rotated).
        c = np.arange(n) * res - size / 2
        X, Y = np.meshgrid(j.xy[0] + c, j.xy[1] + c)
        pixels = shapely.points(X, Y)
        for k, name in enumerate(layers):
            geom = shapely.clip_by_rect(
                shapely.union_all([r["geom"] for r in road.layers[name]]),
                *(j.xy - size / 2 - 1),
                *(j.xy + size / 2 + 1),
            )
            shapely.prepare(geom)  # ~10x faster point queries on these unions
            if name.endswith("divider"):
                want = shapely.dwithin(geom, pixels, res)
                assert want.sum() > 100 and got[k].sum() > 100, (loc, name)
                # Devkit line pixels lie on the generator's lines, and cover most of them.
                assert shapely.dwithin(geom, pixels[got[k]], 2 * res).mean() > 0.97, (loc, name)
                assert got[k][want].mean() > 0.8, (loc, name)
            else:
                # Up to the devkit's vertex rounding at the boundary: every pixel a pixel inside the
                # polygons is in the devkit's mask, and every devkit pixel is within 2 pixels of them.
                inner_geom, near_geom = geom.buffer(-res), geom.buffer(2 * res)
                shapely.prepare([inner_geom, near_geom])
                inner = shapely.contains_xy(inner_geom, X, Y)
                assert inner.sum() > 100 and got[k][inner].all(), (loc, name)
                near = shapely.contains_xy(near_geom, X[got[k]], Y[got[k]])
                assert near.all(), (loc, name, near.mean())


def test_points_known_by_construction(maps):
    for loc, m in maps.items():
        road = R.road_map(SEED, loc)
        j = _four_way(road)
        arm, (street, d) = next(iter(j.arms.items()))
        u, left = road.dirs[arm], road.dirs[(arm + 1) % 4]
        at = lambda dist, lat, j=j, u=u, left=left: j.xy + dist * u + lat * left  # noqa: E731
        centre = m.layers_on_point(*j.xy)
        assert centre["drivable_area"] and m.get("road_segment", centre["road_segment"])["is_intersection"]
        assert m.record_on_point(*at(sum(R.CROSSING) / 2, 0.3 * R.CURB), "ped_crossing")
        assert m.record_on_point(*at((R.CURB + R.SIDEWALK_END) / 2 + 20.0, (R.CURB + R.SIDEWALK_END) / 2), "walkway")
        assert not m.record_on_point(*at(30.0, (R.CURB + R.SIDEWALK_END) / 2), "drivable_area")
        # The stop line spans the incoming half only: traffic arrives along -u, whose right is `left`
        # (driving on the right, road.side = 1) or whose left is -`left` (driving on the left).
        incoming = road.side
        assert m.record_on_point(*at(sum(R.STOP_LINE) / 2, incoming * 0.5 * R.LANE_W), "stop_line")
        assert not m.record_on_point(*at(sum(R.STOP_LINE) / 2, -incoming * 0.5 * R.LANE_W), "stop_line")
        # The stop line is the waiting area behind the paint (STOP_AREA), as in the nuScenes expansion.
        assert m.record_on_point(*at(R.STOP_AREA[1] - 0.2, incoming * 0.5 * R.LANE_W), "stop_line")
        assert not m.record_on_point(*at(R.STOP_AREA[1] + 0.2, incoming * 0.5 * R.LANE_W), "stop_line")
        # A lane in the middle of a street carries traffic in the direction the lane is driven.
        lane_tok = m.get_closest_lane(*road.lane_path(street, d, 0).at(30.0)[0], radius=1.0)
        assert lane_tok in m._token2ind["lane"]


def test_carpark_and_parked_cars(maps):
    for loc, m in maps.items():
        road = R.road_map(SEED, loc)
        assert len(m.carpark_area) >= 2  # several per location, so drives pass them
        lots = {r["token"] for r in m.carpark_area}
        for x, y, yaw in road.bays[::7]:
            tok = m.layers_on_point(x, y)["carpark_area"]
            assert tok in lots
            assert not m.record_on_point(x + 60 * math.cos(yaw), y + 60 * math.sin(yaw), "carpark_area")
    # A world whose ego passes the car park has parked cars whose centres the devkit puts in it.
    loc = "boston-seaport"
    m, road = maps[loc], R.road_map(SEED, loc)
    bays = np.array([b[:2] for b in road.bays])
    for scene in range(100):  # the first scene whose drive passes the car park (ego routes are cheap)
        ego, _ = ego_route(road, scene_rng(SEED, scene), 12)
        xy, _ = ego.path.at(ego.speed * np.arange(12) * SAMPLE_DT)
        if np.min(np.linalg.norm(xy[:, None] - bays[None], axis=2)) < 40.0:
            break
    world = build_world(SEED, scene, 12, loc)
    cars = [
        o
        for o in world.objects
        if o.category == "vehicle.car" and o.path is None and np.min(np.linalg.norm(bays - o.xy, axis=1)) < 1e-6
    ]
    assert cars, "no parked car in the car park"
    for o in cars:
        assert m.record_on_point(*o.xy, "carpark_area") in {r["token"] for r in m.carpark_area}
        assert o.attribute == "vehicle.parked"


def test_log_location_matches_its_map(synthetic_root, maps):
    from nuscenes.nuscenes import NuScenes

    nusc = NuScenes("v1.0-mini", str(synthetic_root), verbose=False)
    for scene in nusc.scene:
        loc = nusc.get("log", scene["log_token"])["location"]
        assert (
            loc == MINI_LOCATIONS[scene["name"]] and (synthetic_root / "maps" / "expansion" / f"{loc}.json").is_file()
        )
        sample = nusc.get("sample", scene["first_sample_token"])
        pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
        assert maps[loc].record_on_point(pose["translation"][0], pose["translation"][1], "lane") or maps[
            loc
        ].record_on_point(pose["translation"][0], pose["translation"][1], "road_segment")
    # The semantic_prior PNG (what NuScenes.map masks read) is the map's drivable area.
    for rec in nusc.map:
        loc = nusc.get("log", rec["log_tokens"][0])["location"]
        road = R.road_map(SEED, loc)
        rng = np.random.default_rng(0)
        pts = rng.uniform((0, 0), road.canvas, size=(4000, 2))
        want = shapely.contains_xy(road.layers["drivable_area"][0]["geom"], pts[:, 0], pts[:, 1])
        got = rec["mask"].is_on_mask(pts[:, 0], pts[:, 1])
        assert want.sum() > 200 and (want == got).mean() > 0.99


def test_render_map_patch_draws_every_layer(maps, tmp_path):
    """The devkit's render_map_patch draws the written map: lines as they are, polygon layers through
    devkit_render_fix (descartes cannot read shapely 2 polygons, on any map)."""
    import matplotlib.pyplot as plt

    from bev.data.maps import devkit_render_fix

    m = maps["boston-seaport"]
    j = _four_way(R.road_map(SEED, "boston-seaport"))
    box = (j.xy[0] - 50, j.xy[1] - 50, j.xy[0] + 50, j.xy[1] + 50)
    fig, ax = m.render_map_patch(box, ["road_divider", "lane_divider"], figsize=(4, 4))
    fig.savefig(tmp_path / "lines.png")
    assert len(ax.lines) > 5
    plt.close(fig)
    polygons = ["drivable_area", "ped_crossing", "walkway", "stop_line", "road_segment", "lane"]
    with devkit_render_fix():
        fig, ax = m.render_map_patch(box, polygons, figsize=(4, 4))
    fig.savefig(tmp_path / "polygons.png")
    # the 4-way junction's own crossings, stop areas and walkways are each drawn as a patch
    assert len(ax.patches) >= 12, len(ax.patches)
    assert {p.get_facecolor()[:3] for p in ax.patches} >= {
        tuple(plt.matplotlib.colors.to_rgb(m.explorer.color_map[k])) for k in ("ped_crossing", "walkway", "stop_line")
    }
    plt.close(fig)


def test_ego_headings_cover_every_direction():
    """The ego drives in all four quadrants of heading across the default set (10 scenes x 24 key frames)."""
    quadrants = set()
    for si, name in enumerate(scene_names(10)):
        loc = MINI_LOCATIONS[name]
        road = R.road_map(SEED, loc)
        ego, wobble = ego_route(road, scene_rng(SEED, si), 24)
        drive = World(SEED, loc, road, ego, wobble, np.zeros(3), [])  # the scene's ego, without its traffic
        h = np.array([drive.ego_pose(k * SAMPLE_DT)[1] for k in range(24)])
        quadrants |= set((np.floor((h % (2 * math.pi)) / (math.pi / 2)).astype(int) % 4).tolist())
    assert quadrants == {0, 1, 2, 3}
