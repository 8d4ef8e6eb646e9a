"""The small Llama-style decoder family; importing this package registers the "llama" train spec."""

from torchtitan_rng.models.llama import spec  # noqa: F401  (registers "llama")
