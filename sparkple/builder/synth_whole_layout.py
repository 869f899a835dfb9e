"""The whole tiny model's layout (`sparkple synth-checkpoint --whole-model`): its text and vision
sizes, vocabulary and chat template, and every weight's name, shape and random initialisation."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .synth_ple_tensors import float32_to_bf16

# The whole tiny model (`synth_whole_model`): sizes both vLLM 0.34's CPU path and transformers
# accept. Every decoder layer is a linear-attention (GatedDeltaNet) layer: transformers builds a
# full-attention layer only with QSA, which vLLM does not run on a CPU. The linear-attention
# head dims are 128 (vLLM's CPU GDN kernel refuses 32). hc_lowrank 12 with hc_count 4: vLLM
# merges the hyper-connection's down projection (12 rows) and its injection (4 rows) into one
# 16-row weight with no pad rows, which 0.34's loader would find never initialised.
WHOLE_MODEL_TEXT: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention"] * 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "output_gate_type": "sigmoid",
    "hidden_act": "silu",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "hc_count": 4,
    "hc_lowrank": 12,
    "ple_conv_kernel_size": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}
# A vision tower as small as transformers builds (vLLM skips it: language_model_only).
WHOLE_MODEL_VISION: dict[str, Any] = {
    "model_type": "qwen4_exp_vision",
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 128,
    "num_position_embeddings": 16,
}
# What `vllm serve` renders a chat into (vLLM refuses a chat completion for a tokenizer without a
# template): the real model's ChatML turns, written byte by byte by the byte-level tokenizer.
# transformers reads it from the model directory beside the tokenizer files.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
WHOLE_MODEL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The byte-level tokenizer's 256 bytes and its end-of-text token (id 256), padded to 320 rows.
WHOLE_MODEL_VOCAB = 320
WHOLE_MODEL_EOS = 256
WHOLE_MODEL_QUANTS = ("bf16", "nvfp4", "fp8")
# The whole model's PLE rows are scaled to this largest magnitude whatever the seed: every seed's
# table has the same global scale (and hash), so a table built from another seed's checkpoint
# passes the packed table's load checks and differs only in its rows.
WHOLE_MODEL_ROW_AMAX = 16.0


# How a weight's random values are drawn: "linear" normal / sqrt(fan_in) (the last dim, or all
# but the first), "embed" unit normal, "head" 4 / sqrt(fan_in) (logits of a few units: the top
# token mostly stands clear of BF16 rounding), "norm0" 0.1 x normal (RMSNorms applied as
# 1 + weight), "norm1" 1 + 0.1 x normal (RMSNorms applied as weight), "bias" 0.02 x normal,
# "a_log" log U(1, 16), "zeros".
# The PLE layer's dilated short convolution is zeros, as vLLM and transformers initialise it:
# with random weights vLLM 0.34's PLE short-conv kernel (models/qwen4_exp/common/ops/ple.py,
# under the Triton interpreter on a CPU) gives NaN logits from the first prefill, where
# transformers' are finite. The PLE rows still reach the output through the gated value.
INITS = ("linear", "embed", "head", "norm0", "norm1", "bias", "a_log", "zeros")


def whole_model_weights(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(checkpoint name, shape, init) of every weight of the whole model but the PLE table and
    its hash buffers (`ple_tensors`), as transformers saves them (experts one by one)."""
    t, v = cfg["text_config"], cfg["vision_config"]
    hidden, vocab = int(t["hidden_size"]), int(t["vocab_size"])
    hc = int(t["hc_count"]) * hidden
    rank = int(t["hc_lowrank"])
    nk, nv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
    dk, dv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    inter, shared = int(t["moe_intermediate_size"]), int(t["shared_expert_intermediate_size"])
    ple_dim = int(t["ple_embed_dim"])
    out: list[tuple[str, tuple[int, ...], str]] = []

    vh, vi = int(v["hidden_size"]), int(v["intermediate_size"])
    merged = vh * int(v["spatial_merge_size"]) ** 2
    patch = int(v["patch_size"])
    vis = "model.visual"
    out += [
        (
            f"{vis}.patch_embed.proj.weight",
            (vh, int(v["in_channels"]), int(v["temporal_patch_size"]), patch, patch),
            "linear",
        ),
        (f"{vis}.patch_embed.proj.bias", (vh,), "bias"),
        (f"{vis}.pos_embed.weight", (int(v["num_position_embeddings"]), vh), "embed"),
    ]
    for i in range(int(v["depth"])):
        block = f"{vis}.blocks.{i}"
        out += [
            (f"{block}.norm1.weight", (vh,), "norm1"),
            (f"{block}.norm1.bias", (vh,), "bias"),
            (f"{block}.norm2.weight", (vh,), "norm1"),
            (f"{block}.norm2.bias", (vh,), "bias"),
            (f"{block}.attn.qkv.weight", (3 * vh, vh), "linear"),
            (f"{block}.attn.qkv.bias", (3 * vh,), "bias"),
            (f"{block}.attn.proj.weight", (vh, vh), "linear"),
            (f"{block}.attn.proj.bias", (vh,), "bias"),
            (f"{block}.mlp.linear_fc1.weight", (vi, vh), "linear"),
            (f"{block}.mlp.linear_fc1.bias", (vi,), "bias"),
            (f"{block}.mlp.linear_fc2.weight", (vh, vi), "linear"),
            (f"{block}.mlp.linear_fc2.bias", (vh,), "bias"),
        ]
    out += [
        (f"{vis}.merger.norm.weight", (vh,), "norm1"),
        (f"{vis}.merger.norm.bias", (vh,), "bias"),
        (f"{vis}.merger.linear_fc1.weight", (merged, merged), "linear"),
        (f"{vis}.merger.linear_fc1.bias", (merged,), "bias"),
        (f"{vis}.merger.linear_fc2.weight", (int(v["out_hidden_size"]), merged), "linear"),
        (f"{vis}.merger.linear_fc2.bias", (int(v["out_hidden_size"]),), "bias"),
    ]

    def mixer(prefix: str, inject: bool) -> list[tuple[str, tuple[int, ...], str]]:
        parts = [
            (f"{prefix}.hc_norm.weight", (hc,), "norm0"),
            (f"{prefix}.input_mix_weight_down.weight", (rank, hc), "linear"),
            (f"{prefix}.input_mix_weight_up.weight", (hc, rank), "linear"),
        ]
        if inject:
            parts.append(
                (f"{prefix}.block_inject_weight.weight", (int(t["hc_count"]), hc), "linear")
            )
        return parts

    lm = "model.language_model"
    out.append((f"{lm}.embed_tokens.weight", (vocab, hidden), "embed"))
    ple_layers = {layer - 1 for layer in t["ple_layer_ids"]}
    for i in range(int(t["num_hidden_layers"])):
        layer = f"{lm}.layers.{i}"
        gdn = f"{layer}.linear_attn"
        out += [
            (f"{gdn}.dt_bias", (nv,), "norm1"),
            (f"{gdn}.A_log", (nv,), "a_log"),
            (f"{gdn}.conv1d.weight", (conv_dim, 1, int(t["linear_conv_kernel_dim"])), "linear"),
            (f"{gdn}.norm.weight", (dv,), "norm1"),
            (f"{gdn}.out_proj.weight", (hidden, nv * dv), "linear"),
            (f"{gdn}.in_proj_qkv.weight", (conv_dim, hidden), "linear"),
            (f"{gdn}.in_proj_z.weight", (nv * dv, hidden), "linear"),
            (f"{gdn}.in_proj_b.weight", (nv, hidden), "linear"),
            (f"{gdn}.in_proj_a.weight", (nv, hidden), "linear"),
        ]
        mlp = f"{layer}.mlp"
        out.append((f"{mlp}.gate.weight", (int(t["num_experts"]), hidden), "linear"))
        for e in range(int(t["num_experts"])):
            out += [
                (f"{mlp}.experts.{e}.gate_proj.weight", (inter, hidden), "linear"),
                (f"{mlp}.experts.{e}.up_proj.weight", (inter, hidden), "linear"),
                (f"{mlp}.experts.{e}.down_proj.weight", (hidden, inter), "linear"),
            ]
        out += [
            (f"{mlp}.shared_expert.gate_proj.weight", (shared, hidden), "linear"),
            (f"{mlp}.shared_expert.up_proj.weight", (shared, hidden), "linear"),
            (f"{mlp}.shared_expert.down_proj.weight", (hidden, shared), "linear"),
            (f"{mlp}.shared_expert_gate.weight", (1, hidden), "linear"),
        ]
        if i in ple_layers:
            ple = f"{layer}.ple"
            out += [
                (f"{ple}.conv1d.weight", (hc, 1, int(t["ple_conv_kernel_size"])), "zeros"),
                (f"{ple}.key_proj.weight", (hc, ple_dim), "linear"),
                (f"{ple}.value_proj.weight", (hidden, ple_dim), "linear"),
                (f"{ple}.norm_key.weight", (hc,), "norm0"),
                (f"{ple}.norm_query.weight", (hc,), "norm0"),
                (f"{ple}.norm_conv.weight", (hc,), "norm0"),
            ]
        out += mixer(f"{layer}.attn_hyper_connection", inject=True)
        out += mixer(f"{layer}.mlp_hyper_connection", inject=True)
    out += mixer(f"{lm}.hyper_connection_mixer", inject=False)
    out.append(("lm_head.weight", (vocab, hidden), "head"))
    return out


def random_weight(rng: np.random.Generator, shape: tuple[int, ...], init: str) -> np.ndarray:
    """A weight of `shape` drawn from `rng` as `init` (one of INITS) says: bfloat16 bits."""
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    normal = rng.standard_normal(shape, dtype=np.float32)
    if init == "linear":
        values = normal / np.float32(math.sqrt(fan_in))
    elif init == "embed":
        values = normal
    elif init == "head":
        values = normal * np.float32(4 / math.sqrt(fan_in))
    elif init == "norm0":
        values = normal * np.float32(0.1)
    elif init == "norm1":
        values = 1 + normal * np.float32(0.1)
    elif init == "bias":
        values = normal * np.float32(0.02)
    elif init == "a_log":
        values = np.log(rng.uniform(1, 16, size=shape)).astype(np.float32)
    elif init == "zeros":
        values = np.zeros(shape, np.float32)
    else:
        raise ValueError(f"unknown init {init!r}: expected one of {INITS}")
    return float32_to_bf16(values)
