"""The synthetic world and its nuScenes-format writer (the embedded default dataset).

world.py    scene layout: objects, their motion, the ego trajectory
raycast.py  the six-camera ray-caster
writer.py   the 13 nuScenes tables, JPEGs, maps; `make_synthetic` and `bev-make-synthetic`
"""
