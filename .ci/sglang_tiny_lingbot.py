"""Write a tiny random-weight LingBot-World model directory that SGLang 0.5.23's real `DiffGenerator.from_pretrained`
loads on a CPU as `LingBotWorldCausalDMDPipeline` (image-to-video, camera actions): diffusers layout (model_index.json
with the pipeline's seven components), a 2-layer causal LingBot-World transformer in the original checkpoint's names
(`blocks.N.self_attn.q`, `patch_embedding_wancamctrl`, `blocks.N.cam_injector_layer1` ... which its arch config maps),
a tiny Wan2.1-style VAE (diffusers `AutoencoderKLWan`, z_dim 16, 8x spatial / 4x temporal; its encoder is used: the
first frame is VAE-encoded), a tiny CLIP vision image encoder with its image processor, a tiny UMT5 text encoder and a
word-level tokenizer; and a 64x64 first-frame image (FIRST_FRAME). Nothing is downloaded; weights come from a seeded
generator, so two runs write the same files.

Usage: python .ci/sglang_tiny_lingbot.py OUT_DIR   (prints the directory; needs torch, diffusers, transformers,
safetensors, tokenizers, pillow)
"""

from __future__ import annotations

import json
import os
import sys

import torch

#: The transformer: 2 layers x 2 heads x 16 channels; 64x64 frames are 8x8 latents, 16 tokens (2x2 patches).
HEADS, HEAD_DIM, LAYERS, FFN, TEXT_DIM, FREQ_DIM, Z = 2, 16, 2, 64, 32, 256, 16
#: The CLIP vision tower's width (its penultimate hidden states condition the cross-attention).
CLIP_DIM = 32
#: 20 condition channels (4 mask + 16 latent) next to the 16 noise channels.
IN_CHANNELS = Z + 4 + Z
#: Plucker camera rays: 6 channels x (8x8 pixels per latent cell) per patch position.
CAM_CHANNELS = 6 * 64
#: Causal settings in latent frames: 2 per chunk, window 4 frames, 1 sink frame.
CAUSAL = {"num_frames_per_block": 2, "sink_size": 1, "sliding_window_num_frames": 4}
FIRST_FRAME = "first_frame.png"
WORDS = [
    "a", "cat", "dog", "walks", "runs", "on", "the", "beach", "in", "snow", "city", "at", "night", "red",
    "blue", "car", "bird", "flies", "over", "sea", "street", "forward",
]  # fmt: skip


def _save(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def write_transformer(out: str, gen: torch.Generator) -> None:
    """LingBot-World's original checkpoint layout (`blocks.N.self_attn.q` ...), mapped by SGLang's arch config."""
    dim = HEADS * HEAD_DIM

    def lin(name: str, fan_in: int, fan_out: int, t: dict) -> None:
        t[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
        t[f"{name}.bias"] = torch.randn(fan_out, generator=gen) * 0.02

    t: dict[str, torch.Tensor] = {}
    t["patch_embedding.weight"] = torch.randn(dim, IN_CHANNELS, 1, 2, 2, generator=gen) / (IN_CHANNELS * 4) ** 0.5
    t["patch_embedding.bias"] = torch.zeros(dim)
    lin("patch_embedding_wancamctrl", CAM_CHANNELS * 4, dim, t)
    lin("c2ws_hidden_states_layer1", dim, dim, t)
    lin("c2ws_hidden_states_layer2", dim, dim, t)
    lin("text_embedding.0", TEXT_DIM, dim, t)
    lin("text_embedding.2", dim, dim, t)
    lin("time_embedding.0", FREQ_DIM, dim, t)
    lin("time_embedding.2", dim, dim, t)
    lin("time_projection.1", dim, 6 * dim, t)
    for i in range(LAYERS):
        b = f"blocks.{i}"
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
        for cam in ("cam_injector_layer1", "cam_injector_layer2", "cam_scale_layer", "cam_shift_layer"):
            lin(f"{b}.{cam}", dim, dim, t)
    # The image branch (CLIP hidden states -> the cross-attention context). LingBot-World's arch config maps no
    # checkpoint name onto it (a Wan2.2 checkpoint has none), so these are SGLang's own names, which pass through.
    e = "condition_embedder.image_embedder"
    t[f"{e}.norm1.weight"], t[f"{e}.norm1.bias"] = torch.ones(CLIP_DIM), torch.zeros(CLIP_DIM)
    lin(f"{e}.ff.fc_in", CLIP_DIM, CLIP_DIM, t)
    lin(f"{e}.ff.fc_out", CLIP_DIM, dim, t)
    t[f"{e}.norm2.weight"], t[f"{e}.norm2.bias"] = torch.ones(dim), torch.zeros(dim)
    t["head.modulation"] = torch.randn(1, 2, dim, generator=gen) / dim**0.5
    lin("head.head", dim, Z * 4, t)
    os.makedirs(f"{out}/transformer", exist_ok=True)
    _save(f"{out}/transformer/diffusion_pytorch_model.safetensors", t)
    config = {
        "_class_name": "CausalLingBotWorldTransformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": HEADS,
        "attention_head_dim": HEAD_DIM,
        "in_channels": IN_CHANNELS,
        "out_channels": Z,
        "text_dim": TEXT_DIM,
        "image_dim": CLIP_DIM,
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
    """A Wan2.1-style VAE (z_dim 16, 8x spatial / 4x temporal) with 16 base channels, diffusers format."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=Z,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * Z,
        latents_std=[1.0] * Z,
    )
    vae.save_pretrained(f"{out}/vae", safe_serialization=True)


def write_image_encoder(out: str) -> None:
    """A 2-layer CLIP vision tower (32x32 input, 16x16 patches) and its CLIP image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(hidden_size=CLIP_DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=16, projection_dim=CLIP_DIM)  # fmt: skip
    CLIPVisionModel(cfg).save_pretrained(f"{out}/image_encoder", safe_serialization=True)
    # transformers 5 writes the tower's names without the `vision_model.` prefix; released CLIP checkpoints (Wan's
    # image_encoder) and SGLang's native CLIPVisionModel.load_weights have it.
    from safetensors.torch import load_file

    path = f"{out}/image_encoder/model.safetensors"
    _save(path, {k if k.startswith("vision_model.") else f"vision_model.{k}": v for k, v in load_file(path).items()})
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        f"{out}/image_processor"
    )


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
    cfg = UMT5Config(vocab_size=64, d_model=TEXT_DIM, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0,
                     eos_token_id=1, decoder_start_token_id=0)  # fmt: skip
    UMT5EncoderModel(cfg).save_pretrained(f"{out}/text_encoder", safe_serialization=True)


def write_first_frame(out: str, gen: torch.Generator) -> str:
    """A 64x64 RGB first frame: a smooth gradient with seeded noise (PNG)."""
    from PIL import Image

    y, x = torch.meshgrid(torch.linspace(0, 1, 64), torch.linspace(0, 1, 64), indexing="ij")
    rgb = torch.stack([x, y, 1 - x * y], dim=-1) * 200 + torch.rand(64, 64, 3, generator=gen) * 55
    path = f"{out}/{FIRST_FRAME}"
    Image.fromarray(rgb.clamp(0, 255).to(torch.uint8).numpy()).save(path)
    return path


def write_model(out: str, seed: int = 0) -> str:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(out, exist_ok=True)
    write_transformer(out, gen)
    write_vae(out)
    write_image_encoder(out)
    write_text_encoder(out)
    write_first_frame(out, gen)
    os.makedirs(f"{out}/scheduler", exist_ok=True)
    with open(f"{out}/scheduler/scheduler_config.json", "w") as f:
        json.dump({"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "shift": 1.0}, f)
    index = {
        "_class_name": "LingBotWorldCausalDMDPipeline",
        "_diffusers_version": "0.35.0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "CausalLingBotWorldTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "image_encoder": ["transformers", "CLIPVisionModel"],
        "image_processor": ["transformers", "CLIPImageProcessor"],
    }
    with open(f"{out}/model_index.json", "w") as f:
        json.dump(index, f, indent=1)
    return out


if __name__ == "__main__":
    print(write_model(sys.argv[1]))
