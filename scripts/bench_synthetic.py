"""CPU ms per sample of the synthetic writer's sample job and its parts, numpy vs native (bev.synthetic.timing)."""

from bev.synthetic.timing import main

main()
