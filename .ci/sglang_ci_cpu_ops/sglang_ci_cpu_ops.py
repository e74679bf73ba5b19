"""Test-only SGLang plugin (see pyproject.toml): REPLACE hooks through SGLang's own `plugin_hook` route the CPU ops
SGLang 0.5.23 sends to sgl-kernel (torch.ops.sgl_kernel.*_cpu, no wheel on this machine) to torch: the fused norm
ops' `forward_cpu` to SGLang's own `forward_native`, and the scale-shift modulation SGLang's `forward_native` calls
(`fuse_scale_shift_kernel`, whose CPU branch imports sgl_kernel) to its formula in torch, x * (c + scale) + shift
with scale / shift broadcast as SGLang's `expand_scale_shift_cpu_param` does."""

LAYERNORM = "sglang.multimodal_gen.runtime.layers.layernorm"
MODULATE = "sglang.kernels.ops.diffusion.modulate.scale_shift_triton"
TARGETS = (f"{LAYERNORM}._ScaleResidualNormScaleShift.forward_cpu", f"{LAYERNORM}._NormScaleShift.forward_cpu")


def _native(self, *args, **kwargs):
    return self.forward_native(*args, **kwargs)


def _scale_shift_torch(x, scale, shift, scale_constant=1.0, block_l=128, block_c=128):
    from sglang.kernels.ops.diffusion.modulate.scale_shift_triton import expand_scale_shift_cpu_param

    scale = expand_scale_shift_cpu_param(scale, x)
    shift = expand_scale_shift_cpu_param(shift, x)
    return (x * (scale_constant + scale) + shift).to(x.dtype)


def register() -> None:
    from sglang.multimodal_gen.runtime.platforms.plugins import HookType, plugin_hook

    for target in TARGETS:
        plugin_hook(target, HookType.REPLACE)(_native)
    plugin_hook(f"{MODULATE}.fuse_scale_shift_kernel", HookType.REPLACE)(_scale_shift_torch)
