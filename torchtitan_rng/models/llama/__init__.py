from torchtitan_rng.models.llama import spec  # noqa: F401  (registers "llama")
