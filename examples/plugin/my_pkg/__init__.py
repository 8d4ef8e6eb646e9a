"""A user's own package, outside torchtitan_rng; ``my_pkg.my_spec`` registers a train spec."""
