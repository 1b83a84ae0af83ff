"""The synthetic world and its nuScenes-format writer (the embedded default dataset).

world.py    scene layout: objects, their motion, the ego trajectory
raycast.py  the six-camera ray-caster
tables.py   the 13 nuScenes tables and their tokens
sensors.py  the cameras' render scales and JPEGs, the LIDAR_TOP mount and clouds
samples.py  each sample's files and the maps, written by the worker processes (pool.py)
manifest.py what a set records; add_occupancy (`--occupancy-only`)
writer.py   `make_synthetic` and `bev-make-synthetic`
"""
