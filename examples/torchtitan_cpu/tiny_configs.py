"""Tiny torchtitan 0.3 configs that train in seconds on a CPU, as torchtitan's config registry functions:
``--module tiny_configs --config tiny_llama`` (or ``tiny_flux``, or ``tiny_qwen3_moe``, an MoE model for expert
parallelism), found here because ``train.py``'s folder is first on the path. Their files are those
``write_assets.py`` writes (by default under ``ASSETS``, relative to the directory you run from; torchtitan's own
``--hf_assets_path``, ``--dataloader.dataset_path`` and the Flux tokenizer and encoder flags point elsewhere).

Each keeps torchtitan's randomness and adds some where a CPU run would have none: the llama's and the MoE model's
attention drops out, and Flux draws its noise, timesteps, random crop and caption dropout as torchtitan does, so
that a resume that lost the random streams shows in the losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ASSETS = "outputs/torchtitan_cpu"
VOCAB = 256  # write_assets.py's byte-level tokenizer: 254 bytes and two special tokens
# Tiny Flux: text encoders of width 32 (context_in_dim / vec_in_dim), 32x32 images (a 4x4 latent).
FLUX_TEXT_DIM, FLUX_IMAGE = 32, 32
ATTENTION_DROPOUT = 0.1


def _cpu_layout(config: Any) -> None:
    # With torchtitan's default spmd_types backend, FSDP wrapping fails on the CPU ("all parameters must be
    # DTensors on the full SPMD mesh"); the DTensor backend wraps the same model.
    config.parallelism.spmd_backend = "partial_dtensor"


def _dropping_attention() -> type:
    from torchtitan.models.common.attention import FlexAttention

    class DroppingDenseAttention(FlexAttention):
        """FlexAttention has no CPU backward: SDPA over the block mask's dense mask, with dropout (torchtitan's
        attention has none)."""

        @dataclass(kw_only=True, slots=True)
        class Config(FlexAttention.Config):
            dropout_p: float = 0.0

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.dropout_p = config.dropout_p

        def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                    attention_masks: Any, scale: float | None = None, enable_gqa: bool = False,
                    **kwargs: Any) -> torch.Tensor:
            from torch.nn.attention.flex_attention import create_mask

            # Under context parallelism q is this rank's slice and k, v the whole sequence (torchtitan gathers
            # them); the sharded block mask's mask_mod maps the slice's rows to their places in it.
            batch, q_length, kv_length = q_BLNH.shape[0], q_BLNH.shape[1], k_BLNH.shape[1]
            mask = create_mask(attention_masks.mask_mod, batch, None, q_length, kv_length, device=q_BLNH.device)
            out = F.scaled_dot_product_attention(
                q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2), attn_mask=mask,
                dropout_p=self.dropout_p if self.training else 0.0, scale=scale, enable_gqa=enable_gqa)
            return out.transpose(1, 2)

    return DroppingDenseAttention


def _text_run(config: Any) -> Any:
    """A text model's run on the offline assets: its loss over the tiny vocabulary, the byte-level tokenizer, the
    text files (validation off: ``--validator.enable`` validates on the same text), 2 sequences of 64 tokens."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    config.hf_assets_path = f"{ASSETS}/tokenizer"
    config.dataloader.dataset_path = f"{ASSETS}/text"
    config.validator.enable = False
    config.validator.dataloader.dataset, config.validator.dataloader.dataset_path = "c4_test", f"{ASSETS}/text"
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    _cpu_layout(config)
    return config


def tiny_llama() -> Any:
    """torchtitan's llama3 debug config, shrunk to 2 layers of width 64, sequences of 64 tokens, batches of 2,
    with an attention that drops out (p = ``ATTENTION_DROPOUT``)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    dim, heads = 64, 4
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=2, dim=dim, n_heads=heads, hidden_dim=128,
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=256, theta=500000, scaling="llama"),
        attn_backend="flex")
    attention = _dropping_attention()
    for layer in layers:
        layer.attention.inner_attention = attention.Config(dropout_p=ATTENTION_DROPOUT)
    config.model_spec.model = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=layers)
    return _text_run(config)


def tiny_qwen3_moe() -> Any:
    """torchtitan's qwen3 MoE debug config (``qwen3_moe_debug``), shrunk as ``tiny_llama`` is: 2 MoE layers of
    width 64 with 8 experts (top 2; expert-parallel degrees up to 8 divide them), sequences of 64 tokens, batches
    of 2, and the same attention that drops out. Routing, the experts' grouped matmuls (``torch._grouped_mm``,
    fp32 on the CPU) and the load-balancing hook are torchtitan's own; pass ``--training.disable_cuda_graphs``."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    dim, head_dim = 64, 16
    layers = _build_qwen3_moe_layers(
        n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=64, num_experts=8,
        top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1000000.0))
    attention = _dropping_attention()
    for layer in layers:
        layer.attention.inner_attention = attention.Config(dropout_p=ATTENTION_DROPOUT)
    model = config.model_spec.model
    model.vocab_size, model.dim, model.layers = VOCAB, dim, layers
    model.norm = _qwen3_norm(dim)
    model.tok_embeddings = Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT)
    model.lm_head = Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT)
    return _text_run(config)


def tiny_flux() -> Any:
    """torchtitan's flux_debugmodel, shrunk: width 64 with 2 heads, one double and one single block, a small
    autoencoder, 32x32 images, 16 T5 tokens, batches of 2 (full activation checkpointing, as flux_debugmodel);
    the byte-level tokenizer for T5 and CLIP (``--tokenizer.test_mode``), and tiny T5 and CLIP encoders
    initialised at random from their ``config.json`` (``--encoder.random_init``). The noise, timesteps, random
    crop and caption dropout are torchtitan's own."""
    from copy import deepcopy
    from dataclasses import replace

    from torchtitan.models.common.linear import Linear
    from torchtitan.models.flux import _make_double_block_config, _make_single_block_config
    from torchtitan.models.flux.config_registry import flux_debugmodel
    from torchtitan.models.flux.model.autoencoder import AutoEncoder
    from torchtitan.models.flux.model.layers import EmbedND, LastLayer, MLPEmbedder

    config = flux_debugmodel()
    hidden, heads, axes = 64, 2, (8, 12, 12)  # the rope's axes add up to the head width, 32
    model = config.model_spec.model

    def mlp(in_dim: int) -> MLPEmbedder.Config:
        layer = model.time_in_config.in_layer
        return MLPEmbedder.Config(in_dim=in_dim, hidden_dim=hidden,
                                  in_layer=replace(layer, in_features=in_dim, out_features=hidden),
                                  out_layer=replace(layer, in_features=hidden, out_features=hidden))

    config.model_spec.model = replace(
        model, vec_in_dim=FLUX_TEXT_DIM, context_in_dim=FLUX_TEXT_DIM, hidden_size=hidden, num_heads=heads,
        depth=1, depth_single_blocks=1, axes_dim=axes,
        img_in=replace(model.img_in, out_features=hidden),
        txt_in=replace(model.txt_in, in_features=FLUX_TEXT_DIM, out_features=hidden),
        autoencoder=AutoEncoder.Config(resolution=FLUX_IMAGE, in_channels=3, ch=32, out_ch=3, ch_mult=(1, 1, 1, 1),
                                       num_res_blocks=1, z_channels=16, scale_factor=0.3611, shift_factor=0.1159),
        pe_config=EmbedND.Config(dim=hidden // heads, theta=10_000, axes_dim=axes),
        time_in_config=mlp(256), vector_in_config=mlp(FLUX_TEXT_DIM),
        double_blocks=[deepcopy(_make_double_block_config(hidden_size=hidden, num_heads=heads, mlp_ratio=2.0,
                                                          qkv_bias=True))],
        single_blocks=[deepcopy(_make_single_block_config(hidden_size=hidden, num_heads=heads, mlp_ratio=2.0))],
        final_layer_config=replace(
            model.final_layer_config, hidden_size=hidden,
            linear=replace(model.final_layer_config.linear, in_features=hidden),
            adaln_linear=replace(model.final_layer_config.adaln_linear, in_features=hidden,
                                 out_features=2 * hidden)))
    assert isinstance(config.model_spec.model.final_layer_config, LastLayer.Config)
    assert isinstance(config.model_spec.model.img_in, Linear.Config)
    tokenizer = f"{ASSETS}/tokenizer"
    config.hf_assets_path = config.tokenizer.t5_tokenizer_path = config.tokenizer.clip_tokenizer_path = tokenizer
    config.tokenizer.max_t5_encoding_len = 16
    config.tokenizer.test_mode = True
    config.encoder.t5_encoder, config.encoder.clip_encoder = f"{ASSETS}/t5_encoder", f"{ASSETS}/clip_encoder"
    config.encoder.random_init = True
    config.dataloader.dataset_path = config.validator.dataloader.dataset_path = f"{ASSETS}/images"
    config.dataloader.img_size = FLUX_IMAGE
    config.validator.dataloader.img_size = FLUX_IMAGE
    config.training.local_batch_size = 2
    _cpu_layout(config)
    return config
