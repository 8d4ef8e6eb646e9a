"""Advice in a refusal works when followed: what it tells the user to change is then accepted."""

from __future__ import annotations

import re

import pytest

from torchtitan_rng.config import ConfigError, gradient_accumulation_steps, parse_args


def test_a_count_that_does_not_divide_names_the_counts_that_do() -> None:
    """16 samples in micro-batches of 4 on 3 processes: the refusal names the data-parallel sizes that divide
    (a resume may change its process count, not its batch sizes), and each of them is accepted; control: one it
    does not name is refused."""
    config = parse_args(["--training.global_batch_size", "16", "--training.local_batch_size", "4"])
    with pytest.raises(ConfigError) as refused:
        gradient_accumulation_steps(config.training, 3)
    message = str(refused.value)
    named = re.search(r"run on a data-parallel size that divides it \(([\d, ]+)\)", message)
    assert named is not None and "a resume keeps the batch sizes" in message and "\n" not in message, message
    sizes = [int(size) for size in named.group(1).split(", ")]
    assert sizes == [1, 2, 4]
    assert [gradient_accumulation_steps(config.training, size) for size in sizes] == [4, 2, 1]
    with pytest.raises(ConfigError):
        gradient_accumulation_steps(config.training, 8)
