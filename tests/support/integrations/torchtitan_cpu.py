"""Test support: torchtitan 0.3 on the CPU (gloo, FSDP2, 2 processes) and the tiny config the tests train.

Everything here adapts torchtitan to a CPU-only test machine; none of it is part of the plug-in
(``torchtitan_rng.integrations.torchtitan``), which does not depend on any of it. Each adjustment says
why it is needed. The tests also pass ``--parallelism.spmd_backend partial_dtensor``: with the default
``spmd_types`` backend, FSDP wrapping fails here ("all parameters must be DTensors on the full SPMD mesh";
not investigated further). ``apply()`` must run before anything imports torchtitan (``torchtitan_run.py``).

``tiny_flux`` (with ``write_flux_assets``) is torchtitan's own Flux trainer on a shrunk flux_debugmodel, offline.

The config registry function ``tiny_llama`` is what the runs pass as ``--module torchtitan_cpu --config
tiny_llama``: torchtitan's llama3 debug config with a 2-layer model of width 64 and an attention that
drops out (p = ``TORCHTITAN_TEST_DROPOUT``, default 0.1), so that resuming needs the random streams.
"""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VOCAB = 256


_MOE_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _stub_moe_kernels() -> None:
    # torchtitan's MoE token dispatcher imports its Triton kernels unconditionally, and there is no Triton
    # for the CPU. An inert module in their place lets the import pass (the dense model never calls them);
    # a fake ``triton`` instead would make torch believe Triton is installed.
    stub = types.ModuleType(_MOE_KERNELS)
    for name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                 "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(stub, name, None)
    sys.modules.setdefault(_MOE_KERNELS, stub)


class _CpuDeviceModule(types.ModuleType):
    """torch.cpu, plus the device-name and memory-statistics calls of torchtitan's metrics (no-ops)."""

    def __init__(self) -> None:
        super().__init__("torch_cpu_for_torchtitan")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 30)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


_applied = False


def apply() -> None:
    # Once per process: the suite's warm server has applied it before it forks a run, which applies it again.
    global _applied
    if _applied:
        return
    _applied = True
    _stub_moe_kernels()
    import torch.distributed as dist

    from torchtitan.tools import utils

    # torchtitan's device helpers fall back to "cuda" when no accelerator is found (tools/utils.py), and
    # torch.cpu lacks the memory-monitor functions its metrics call. Set before any other torchtitan
    # module copies them (``from torchtitan.tools.utils import device_module``).
    utils.device_type, utils.device_module = "cpu", _CpuDeviceModule()

    # Stock torchtitan 0.3.0 calls torch.distributed.set_timeout, which torch 2.13 lacks, after its first
    # step, and runs pipeline parallelism with torch 2.14's pre-split schedule.step: without the plug-in's
    # stand-ins, a stock run (the tests' controls) could not pass step 1.
    from torchtitan_rng.integrations.torchtitan import provide_presplit_step, provide_set_timeout

    provide_set_timeout()
    provide_presplit_step()

    # set_pg_timeouts calls barrier(device_ids=[current device]); gloo takes no device ids.
    barrier = dist.barrier

    def cpu_barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return barrier(*args, **kwargs)

    dist.barrier = cpu_barrier

    # torchtitan's FSDP2 reduce-scatters gradients with PREMUL_SUM(1 / 1.0) (the loss is already divided by
    # the global token count), and gloo has no PREMUL_SUM: with a factor of 1.0 it is a plain SUM.
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def plain_sum_for_unit_factor(*args: Any, **kwargs: Any) -> Any:
        factor = kwargs.get("factor", args[4] if len(args) > 4 else None)
        if factor == 1.0:
            return None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM
        return divide_factors(*args, **kwargs)

    _fsdp_collectives._get_gradient_divide_factors = plain_sum_for_unit_factor

    # The block mask is built by a torch.compile'd create_block_mask: compiling it with inductor on the CPU
    # takes minutes on a small machine. Eager builds the same mask.
    from torch.nn.attention.flex_attention import create_block_mask

    from torchtitan.models.common import attention

    attention._compiled_create_block_mask = create_block_mask


def write_assets(folder: Path) -> tuple[Path, Path]:
    """A byte-level tokenizer (``VOCAB`` ids) and a small text dataset: (hf_assets_path, dataset_path)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = [f"<0x{i:02X}>" for i in range(VOCAB - 2)]
    vocab = {token: i for i, token in enumerate(tokens)}
    vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"] = VOCAB - 2, VOCAB - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.ByteFallback()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    assets = folder / "tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
         "add_eos_token": True}))
    data = folder / "text"
    data.mkdir(parents=True, exist_ok=True)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jolly nymphs".split()
    with (data / "train.jsonl").open("w") as file:
        for i in range(400):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 13))
            file.write(json.dumps({"text": text}) + "\n")
    return assets, data


def _dropping_attention() -> type:
    from torchtitan.models.common.attention import FlexAttention

    class DroppingDenseAttention(FlexAttention):
        """FlexAttention has no CPU backward: SDPA over the block mask's dense mask, with dropout (torchtitan's
        attention has none; the tests need randomness inside the model to see the streams matter)."""

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


def tiny_llama() -> Any:
    """torchtitan's llama3 debug config, shrunk to 2 layers of width 64 with attention dropout."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
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
    dropout = float(os.environ.get("TORCHTITAN_TEST_DROPOUT", "0.1"))
    for layer in layers:
        layer.attention.inner_attention = attention.Config(dropout_p=dropout)
    config.model_spec.model = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=layers)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.validator.enable = False
    return config


def tiny_qwen3_moe() -> Any:
    """torchtitan's qwen3 MoE debug config (``qwen3_moe_debug``), shrunk as ``tiny_llama`` is: 2 MoE layers of
    width 64 with 8 experts (top 2; expert parallel degrees up to 8 divide them), the byte-level vocabulary,
    sequences of 64, and the same dropping attention. Routing, the experts' grouped matmuls
    (``torch._grouped_mm``, fp32 on the CPU) and the load-balancing hook are torchtitan's own."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
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
    dropout = float(os.environ.get("TORCHTITAN_TEST_DROPOUT", "0.1"))
    for layer in layers:
        layer.attention.inner_attention = attention.Config(dropout_p=dropout)
    model = config.model_spec.model
    model.vocab_size, model.dim, model.layers = VOCAB, dim, layers
    model.norm = _qwen3_norm(dim)
    model.tok_embeddings = Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT)
    model.lm_head = Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.validator.enable = False
    return config


# Tiny Flux: text encoders of width 32 (context_in_dim / vec_in_dim), 32x32 images (a 4x4 latent).
FLUX_TEXT_DIM, FLUX_IMAGE = 32, 32


def write_flux_assets(folder: Path, samples: int = 48) -> dict[str, Path]:
    """Everything torchtitan's Flux trainer reads, with no download: the byte-level tokenizer (both T5's and
    CLIP's), tiny T5 and CLIP ``config.json`` folders for ``--encoder.random_init`` (a path with "clip" in it is
    taken as CLIP, so only the CLIP folder's name has it), and a WebDataset tar of ``samples`` random images
    with captions, larger than the crop and not square, so that the random crop draws."""
    import io
    import random
    import tarfile

    from PIL import Image
    from transformers import CLIPTextConfig, T5Config

    tokenizer, _ = write_assets(folder)
    t5, clip = folder / "t5_encoder", folder / "clip_encoder"
    T5Config(vocab_size=VOCAB, d_model=FLUX_TEXT_DIM, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
             decoder_start_token_id=0).save_pretrained(t5)
    CLIPTextConfig(vocab_size=VOCAB, hidden_size=FLUX_TEXT_DIM, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, max_position_embeddings=77, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                   pad_token_id=0).save_pretrained(clip)
    data = folder / "images"
    data.mkdir(parents=True, exist_ok=True)
    draw = random.Random(0)  # the files only: fixed once written
    words = "a red cat on a blue mat under the green tree by the old stone wall".split()
    with tarfile.open(data / "shard-000000.tar", "w") as tar:
        for i in range(samples):
            width, height = (FLUX_IMAGE + 8, FLUX_IMAGE) if i % 2 else (FLUX_IMAGE, FLUX_IMAGE + 8)
            pixels = bytes(draw.randrange(256) for _ in range(width * height * 3))
            image = Image.frombytes("RGB", (width, height), pixels)
            jpg = io.BytesIO()
            image.save(jpg, format="JPEG")
            caption = " ".join(draw.choice(words) for _ in range(4 + i % 5)).encode()
            for suffix, payload in (("jpg", jpg.getvalue()), ("txt", caption), ("json", json.dumps({"i": i}).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{suffix}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return {"tokenizer": tokenizer, "t5": t5, "clip": clip, "images": data}


def tiny_flux() -> Any:
    """torchtitan's flux_debugmodel, shrunk: width 64 with 2 heads, one double and one single block, a small
    autoencoder, 32x32 images, 16 T5 tokens, batches of 2 (full activation checkpointing, as flux_debugmodel).
    The noise, timesteps, random crop and caption dropout are torchtitan's own."""
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
    config.tokenizer.max_t5_encoding_len = 16
    config.tokenizer.test_mode = True
    config.encoder.random_init = True
    config.dataloader.img_size = FLUX_IMAGE
    config.validator.dataloader.img_size = FLUX_IMAGE
    config.training.local_batch_size = 2
    return config
