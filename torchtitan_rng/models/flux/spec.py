"""Registers the "flux" train spec."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan_rng.models.flux.dataset import FluxDataset
from torchtitan_rng.models.flux.model import FluxModel, build_flux_model, flux_loss
from torchtitan_rng.models.flux.validation import validate
from torchtitan_rng.train_spec import TrainSpec, register_train_spec


def apply_fsdp(model: FluxModel, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> None:
    """Shard each transformer block, then the transformer. The frozen encoders stay whole on every rank:
    they are small, have no gradients to reduce, and sit outside every sharded module."""
    transformer = model.transformer
    for block in [*transformer.double_blocks, *transformer.single_blocks]:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(transformer, mesh=mesh, mp_policy=mp_policy)


register_train_spec(
    TrainSpec(
        name="flux",
        build_model=build_flux_model,
        build_dataset=FluxDataset,
        loss_fn=flux_loss,
        apply_fsdp=apply_fsdp,
        items_per_sample=lambda config: 1,
        throughput_unit="images",
        validate=validate,
        block_lists=lambda model: [model.transformer.double_blocks, model.transformer.single_blocks],
        tensor_parallel_refusal="its single-stream blocks project attention's q, k, v and the MLP's input with one "
                                "linear and take both back with another, which a column then row split does not "
                                "follow",
    )
)
