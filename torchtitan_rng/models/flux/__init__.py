"""The Flux-style rectified-flow model family; importing this package registers the "flux" train spec."""

from torchtitan_rng.models.flux import spec  # noqa: F401
