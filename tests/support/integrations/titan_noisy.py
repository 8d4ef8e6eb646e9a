"""A torchtitan override that makes one attention output projection noisy (``tests.support.divergences.make_noisy``),
for the torchtitan plug-in's locator tests: ``--override.imports tests.support.integrations.titan_noisy.noisy_layer0``
(or ``noisy_layer1``: the layer a second pipeline stage holds). Everything else of the model is built as configured."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config.override import derive, override
from torchtitan.models.common import Linear

from tests.support.divergences import make_noisy


class NoisyLinear(Linear):
    """torchtitan's Linear whose output gets noise from a generator seeded by the OS."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        make_noisy(self)


@override(target=Linear.Config, fqns=["*layers.0.attention.wo"], exact=True,
          description="tests: layers.0.attention.wo made noisy")
def noisy_layer0(config: Linear.Config) -> NoisyLinear.Config:
    return derive(config, NoisyLinear.Config)


@override(target=Linear.Config, fqns=["*layers.1.attention.wo"], exact=True,
          description="tests: layers.1.attention.wo made noisy")
def noisy_layer1(config: Linear.Config) -> NoisyLinear.Config:
    return derive(config, NoisyLinear.Config)
