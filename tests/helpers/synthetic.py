"""What the session's synthetic_root fixture writes, for tests that rebuild its worlds and renders."""

SEED, SCENES, SAMPLES = 0, 2, 3
# Ray-cast at 400x225, as `make train`'s data: tests that re-render its scenes cast a quarter of the rays
# of the default render (scale 2).
RENDER_SCALE = 4
