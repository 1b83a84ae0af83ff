"""The synthetic world and its nuScenes-format writer (the embedded default dataset).

world.py    scene layout: objects, their motion, the ego trajectory
raycast.py  the ray-caster (the six cameras; the LiDAR's beams through lidar.py)
lidar.py    LIDAR_TOP: a spinning 32-beam LiDAR ray-cast against the same world, its clouds and sweeps
tables.py   the 13 nuScenes tables and their tokens
sensors.py  the cameras' render scales and JPEGs, the LIDAR_TOP mount
samples.py  each sample's files and the maps, written by the worker processes (pool.py)
manifest.py what a set records; add_occupancy (`--occupancy-only`)
writer.py   `make_synthetic` and `bev-make-synthetic`
"""
