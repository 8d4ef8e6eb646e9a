"""Every file the tiny configs read, written here, with no download (tiny_configs.py; default folder:
``tiny_configs.ASSETS``, relative to the directory you run from):

    python examples/torchtitan_cpu/write_assets.py [FOLDER]

``tokenizer/``: a byte-level ``tokenizer.json`` of ``VOCAB`` ids (the llama's, and Flux's for T5 and CLIP);
``text/train.jsonl``: short lines of text; ``t5_encoder/`` and ``clip_encoder/``: tiny T5 and CLIP
``config.json`` folders (torchtitan takes a path with "clip" in it for CLIP: only that folder's name has it);
``images/shard-000000.tar``: a WebDataset tar of 48 random JPEGs with captions, larger than the crop and not
square, so that the random crop draws. The same files every time (a fixed seed of their own).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
from pathlib import Path

from tiny_configs import ASSETS, FLUX_IMAGE, FLUX_TEXT_DIM, VOCAB

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"<0x{i:02X}>": i for i in range(VOCAB - 2)}
    vocab[BOS], vocab[EOS] = VOCAB - 2, VOCAB - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.ByteFallback()
    tokenizer.add_special_tokens([BOS, EOS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}))


def write_text(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jolly nymphs".split()
    with (folder / "train.jsonl").open("w") as file:
        for i in range(400):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 13))
            file.write(json.dumps({"text": text}) + "\n")


def write_encoders(t5: Path, clip: Path) -> None:
    from transformers import CLIPTextConfig, T5Config

    T5Config(vocab_size=VOCAB, d_model=FLUX_TEXT_DIM, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
             decoder_start_token_id=0).save_pretrained(t5)
    CLIPTextConfig(vocab_size=VOCAB, hidden_size=FLUX_TEXT_DIM, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, max_position_embeddings=77, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                   pad_token_id=0).save_pretrained(clip)


def write_images(folder: Path, samples: int = 48) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    draw = random.Random(0)  # the files only: fixed once written
    words = "a red cat on a blue mat under the green tree by the old stone wall".split()
    with tarfile.open(folder / "shard-000000.tar", "w") as tar:
        for i in range(samples):
            width, height = (FLUX_IMAGE + 8, FLUX_IMAGE) if i % 2 else (FLUX_IMAGE, FLUX_IMAGE + 8)
            pixels = bytes(draw.randrange(256) for _ in range(width * height * 3))
            jpg = io.BytesIO()
            Image.frombytes("RGB", (width, height), pixels).save(jpg, format="JPEG")
            caption = " ".join(draw.choice(words) for _ in range(4 + i % 5)).encode()
            for suffix, payload in (("jpg", jpg.getvalue()), ("txt", caption), ("json", json.dumps({"i": i}).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{suffix}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def write_assets(folder: Path) -> None:
    write_tokenizer(folder / "tokenizer")
    write_text(folder / "text")
    write_encoders(folder / "t5_encoder", folder / "clip_encoder")
    write_images(folder / "images")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the files the tiny torchtitan configs read.")
    parser.add_argument("folder", nargs="?", type=Path, default=Path(ASSETS), help=f"default: {ASSETS}")
    target = parser.parse_args().folder
    if target.exists() and not target.is_dir():
        parser.exit(2, f"error: {target} is a file; name a folder (it is made if missing)\n")
    write_assets(target)
    print(f"wrote the tiny configs' tokenizer, text, encoder configs and images to {target}")
