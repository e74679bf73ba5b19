"""Write a tiny random-weight LongLive2 model directory that SGLang 0.5.23's real `DiffGenerator.from_pretrained` loads
on a CPU: diffusers layout (model_index.json), a 2-layer LongLive2 transformer (the original LongLive `model.*`
checkpoint names its arch config maps), a tiny Wan2.2-style VAE (diffusers `AutoencoderKLWan`, z_dim 48, 16x spatial),
a tiny UMT5 text encoder (transformers) and a word-level tokenizer. Nothing is downloaded; weights come from a seeded
generator, so two runs write the same files.

Usage: python .ci/sglang_tiny_longlive2.py OUT_DIR   (prints the directory; needs torch, diffusers, transformers,
safetensors, tokenizers)
"""

from __future__ import annotations

import json
import os
import sys

import torch

#: The transformer's shape: 2 layers x 2 heads x 16 channels; 4 tokens per 64x64 frame (16x VAE, 2x2 patches).
HEADS, HEAD_DIM, LAYERS, FFN, TEXT_DIM, FREQ_DIM, Z = 2, 16, 2, 64, 32, 256, 48
#: LongLive2 causal settings in latent frames: 2 per chunk, window 4 (rolls), 1 sink frame.
CAUSAL = {"num_frames_per_block": 2, "local_attn_size": 4, "sink_size": 1, "sliding_window_num_frames": 4}
WORDS = [
    "a", "cat", "dog", "walks", "runs", "on", "the", "beach", "in", "snow", "city", "at", "night", "red",
    "blue", "car", "bird", "flies", "over", "sea",
]


def _save(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def write_transformer(out: str, gen: torch.Generator) -> None:
    """LongLive's original checkpoint layout (`model.blocks.N.self_attn.q` ...), mapped by SGLang's arch config."""
    dim = HEADS * HEAD_DIM

    def lin(name: str, fan_in: int, fan_out: int, t: dict) -> None:
        t[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
        t[f"{name}.bias"] = torch.randn(fan_out, generator=gen) * 0.02

    t: dict[str, torch.Tensor] = {}
    t["model.patch_embedding.weight"] = torch.randn(dim, Z, 1, 2, 2, generator=gen) / (Z * 4) ** 0.5
    t["model.patch_embedding.bias"] = torch.zeros(dim)
    lin("model.text_embedding.0", TEXT_DIM, dim, t)
    lin("model.text_embedding.2", dim, dim, t)
    lin("model.time_embedding.0", FREQ_DIM, dim, t)
    lin("model.time_embedding.2", dim, dim, t)
    lin("model.time_projection.1", dim, 6 * dim, t)
    for i in range(LAYERS):
        b = f"model.blocks.{i}"
        t[f"{b}.modulation"] = torch.randn(1, 6, dim, generator=gen) / dim**0.5
        for attn in ("self_attn", "cross_attn"):
            for p in "qkvo":
                lin(f"{b}.{attn}.{p}", dim, dim, t)
            t[f"{b}.{attn}.norm_q.weight"] = torch.ones(dim)
            t[f"{b}.{attn}.norm_k.weight"] = torch.ones(dim)
        t[f"{b}.norm3.weight"] = torch.ones(dim)
        t[f"{b}.norm3.bias"] = torch.zeros(dim)
        lin(f"{b}.ffn.0", dim, FFN, t)
        lin(f"{b}.ffn.2", FFN, dim, t)
    t["model.head.modulation"] = torch.randn(1, 2, dim, generator=gen) / dim**0.5
    lin("model.head.head", dim, Z * 4, t)
    os.makedirs(f"{out}/transformer", exist_ok=True)
    _save(f"{out}/transformer/diffusion_pytorch_model.safetensors", t)
    config = {
        "_class_name": "LongLive2Transformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": HEADS,
        "attention_head_dim": HEAD_DIM,
        "in_channels": Z,
        "out_channels": Z,
        "text_dim": TEXT_DIM,
        "freq_dim": FREQ_DIM,
        "ffn_dim": FFN,
        "num_layers": LAYERS,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
        **CAUSAL,
    }
    with open(f"{out}/transformer/config.json", "w") as f:
        json.dump(config, f, indent=1)


def write_vae(out: str) -> None:
    """A Wan2.2-style VAE (z_dim 48, 16x spatial / 4x temporal) with 16 base channels, diffusers format."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=16,
        decoder_base_dim=16,
        z_dim=Z,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * Z,
        latents_std=[1.0] * Z,
    )
    vae.save_pretrained(f"{out}/vae", safe_serialization=True)


def write_text_encoder(out: str) -> None:
    """A 2-layer UMT5 encoder (d_model 32) and a word-level tokenizer over WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )
    fast.save_pretrained(f"{out}/tokenizer")
    cfg = UMT5Config(
        vocab_size=64,
        d_model=TEXT_DIM,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    UMT5EncoderModel(cfg).save_pretrained(f"{out}/text_encoder", safe_serialization=True)


def write_model(out: str, seed: int = 0) -> str:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(out, exist_ok=True)
    write_transformer(out, gen)
    write_vae(out)
    write_text_encoder(out)
    os.makedirs(f"{out}/scheduler", exist_ok=True)
    with open(f"{out}/scheduler/scheduler_config.json", "w") as f:
        json.dump({"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "shift": 1.0}, f)
    index = {
        "_class_name": "LongLive2Pipeline",
        "_diffusers_version": "0.35.0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "LongLive2Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    with open(f"{out}/model_index.json", "w") as f:
        json.dump(index, f, indent=1)
    return out


if __name__ == "__main__":
    print(write_model(sys.argv[1]))
