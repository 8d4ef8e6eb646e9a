"""Built-in train specs; importing this package registers them."""

from torchtitan_rng.models import flux, llama  # noqa: F401
