"""InternVL (the "-hf" releases, model_type internvl) in pure PyTorch, eager fp32: the reference the JAX twin is held
against.

transformers 5.24's InternVLForConditionalGeneration: the InternViT tower (models/intern_vit.py) encodes each
448-px tile; the last block's tokens without CLS (vision_feature_layer -1, strategy "default") are laid on their
h x w grid and pixel-shuffled by downsample_ratio 0.5 (2x2 neighbours -> one token of 4C channels, in transformers'
reshape/permute order), projected by LayerNorm(4C, eps 1e-5) -> linear_1 -> GELU -> linear_2 into the language
model's width, and replace the `<IMG_CONTEXT>` tokens' embeddings in reading order (tiles in processor order, each
tile's (h/2)*(w/2) tokens row-major). The language model is Qwen2 (InternVL3: Qwen2.5) with plain RoPE and
positions 0..T-1, composed from models/qwen2.py's blocks. What is InternVL's own: its config keys, the pixel
shuffle and projector, and the checkpoint names: the module tree is transformers 5's in-memory one
(`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head`), the release stores
`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*` (both load).

Training and inference forwards are the same here: the only train-mode differences in transformers' InternVL are
dropouts (all 0 in the releases, DROPOUT) and no image-dependent mask (attention is causal + padding throughout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from torch_sources.models import qwen2
from torch_sources.models.config_keys import BOOKKEEPING, ConfigError, KeyAudit
from torch_sources.models.intern_vit import InternVLVisionConfig, InternVLVisionModel
from torch_sources.models.layers import ACTIVATIONS, LayerInputs, LayerNorm, apply_rope, rope_cos_sin
from torch_sources.models.loading import iter_tensors, load_config
from torch_sources.models.qwen2 import Qwen2Config
from torch_sources.models.qwen2_vl import LanguageModelView, Qwen2VLTextModel, merge_image_embeddings

AUTO_MODEL = ("internvl", "InternVLForConditionalGeneration")  # HF model_type -> this file's model (models/auto.py finds it here)
__all__ = [
    "CONFIG_KEYS", "TEXT_EXTRA_KEYS", "TEXT_MODEL_TYPES", "PROJECTOR_LN_EPS", "InternVLConfig", "in_memory_name",
    "rope_inv_freq", "rope_cos_sin", "apply_rope", "layer_inputs", "merge_image_embeddings", "pixel_shuffle",
    "InternVLMultiModalProjector", "InternVLModel", "InternVLForConditionalGeneration",
]

PROJECTOR_LN_EPS = 1e-5  # nn.LayerNorm's default: transformers passes no eps to the projector's norm

CONFIG_KEYS = KeyAudit(
    "internvl",
    honored=frozenset({"text_config", "vision_config", "image_token_id", "downsample_ratio", "projector_hidden_act",
                       "vision_feature_layer", "tie_word_embeddings"}),
    ignored={"image_seq_length": "the processor's tokens per tile; the forward counts the image tokens"},
    refused={"vision_feature_select_strategy": (("default",), "'full' keeps CLS, whose 1 + h*w tokens transformers' "
                                                              "pixel shuffle cannot lay on a square grid")})
# text_config keys the Qwen2 audit (models/qwen2.py CONFIG_KEYS) does not list, read or set aside here first.
TEXT_EXTRA_KEYS = KeyAudit(
    "internvl text",
    honored=frozenset(),
    ignored={"_attn_implementation_autoset": "which attention kernel transformers 4.x picked; eager here",
             "tie_word_embeddings": "transformers 5 ties on the top-level key only (the releases repeat it here)"})
TEXT_MODEL_TYPES = ("qwen2",)  # the InternVL2.5/3 -hf releases' language model (Qwen2.5); no other is composed here


def in_memory_name(name: str) -> str:
    """A stored tensor name -> the module tree's (transformers 5's in-memory names, which load unchanged)."""
    for saved, live in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                        ("vision_tower.", "model.vision_tower."),
                        ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(saved):
            return live + name[len(saved):]
    return name


@dataclass(frozen=True)
class InternVLConfig(LanguageModelView):
    text: Qwen2Config
    vision: InternVLVisionConfig
    image_token_id: int = 151667
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int = -1
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf(cls, d: dict) -> "InternVLConfig":
        """Either form of config.json: the release's (transformers 4.52 wrote it: text_config with rope_theta,
        the original InternViT keys in vision_config, no top-level tie) or transformers 5's save_pretrained form
        (text_config.rope_parameters and layer_types, the top-level tie). The tie is the config's; a checkpoint
        storing its own head unties it (untied, applied by the loaders)."""
        CONFIG_KEYS.check(d)
        for key in ("text_config", "vision_config"):
            if not isinstance(d.get(key), dict):
                raise ConfigError(f"internvl config: no {key} (InternVL nests both towers' keys)")
        text_d = dict(d["text_config"])
        if text_d.get("model_type", "qwen2") not in TEXT_MODEL_TYPES:
            raise ConfigError(f"internvl config not supported by this source: text_config.model_type="
                              f"{text_d['model_type']!r} (accepted: {TEXT_MODEL_TYPES}; InternVL3's language model)")
        TEXT_EXTRA_KEYS.check({k: text_d.pop(k) for k in list(text_d) if k in TEXT_EXTRA_KEYS.keys
                               and k not in BOOKKEEPING})
        tie = bool(d.get("tie_word_embeddings", True))  # transformers 5 reads the top level only (see untied)
        text = Qwen2Config.from_hf({**text_d, "tie_word_embeddings": tie})
        ratio = d.get("downsample_ratio", 0.5)
        if ratio != 0.5:
            raise ConfigError(f"internvl config not supported by this source: downsample_ratio={ratio!r} (accepted: "
                              f"0.5; every release shuffles 2x2 neighbours into one token)")
        act = d.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"internvl config: projector_hidden_act={act!r} (known: {sorted(ACTIVATIONS)})")
        layer = d.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ConfigError(f"internvl config not supported by this source: vision_feature_layer={layer!r} (one "
                              f"layer index; a list concatenates layers, which no release does)")
        return cls(text=text, vision=InternVLVisionConfig.from_hf(d["vision_config"]),
                   image_token_id=int(d.get("image_token_id", 151667)), downsample_ratio=float(ratio),
                   projector_hidden_act=act, vision_feature_layer=layer, tie_word_embeddings=tie)

    @classmethod
    def from_pretrained(cls, path) -> "InternVLConfig":
        return cls.from_hf(load_config(path))

    def untied(self) -> "InternVLConfig":
        """The same model with its own head: what transformers makes of a tying config (the top-level key, default
        True) whose checkpoint stores a head different from the embedding. The release has no top-level key (4.x
        tied on text_config's `false` and stored the head), and 5.x's save_pretrained writes True beside the
        untied head it kept: only the checkpoint can tell, so the loaders check it."""
        return dataclasses.replace(self, tie_word_embeddings=False,
                                   text=dataclasses.replace(self.text, tie_word_embeddings=False))

    @property
    def scale(self) -> int:  # 1 / downsample_ratio: the side of the neighbourhood one token absorbs
        return int(round(1 / self.downsample_ratio))

    @property
    def tokens_per_tile(self) -> int:  # (image / patch)^2 * ratio^2: image_seq_length
        v = self.vision
        return (v.image_size[0] // v.patch_size[0]) * (v.image_size[1] // v.patch_size[1]) // self.scale ** 2


# ---- operators ------------------------------------------------------------------------------

def rope_inv_freq(config: InternVLConfig):  # -> f32[hd/2]: the language model's table (models/qwen2.py)
    return qwen2.rope_inv_freq(config.text)


def layer_inputs(config: InternVLConfig, attention_mask, position_ids=None) -> LayerInputs:
    """Causal + padding mask and Qwen2's RoPE cos/sin (positions 0..T-1 unless given) every layer shares."""
    return qwen2.layer_inputs(config.text, attention_mask, position_ids)


def pixel_shuffle(features, scale: int = 2):
    """f32[N,A,B,C] -> f32[N, A/s, B/s, C*s*s]: transformers' InternVLModel.pixel_shuffle at ratio 1/s (its axes
    named width, height): fold s neighbours along B into channels, swap the grid axes, fold s along A, swap back.
    The projector's weights were trained on this channel order, so it is kept step for step."""
    N, A, B, C = features.shape
    x = features.reshape(N, A, B // scale, C * scale).permute(0, 2, 1, 3)
    x = x.reshape(N, B // scale, A // scale, C * scale * scale)
    return x.permute(0, 2, 1, 3)


# ---- modules --------------------------------------------------------------------------------

class InternVLMultiModalProjector(nn.Module):
    def __init__(self, config: InternVLConfig):
        super().__init__()
        width, hidden = config.vision.hidden_size * config.scale ** 2, config.text.hidden_size
        self.act = ACTIVATIONS[config.projector_hidden_act]
        self.layer_norm = LayerNorm(width, PROJECTOR_LN_EPS)
        self.linear_1 = nn.Linear(width, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x):  # f32[..., 4C] -> f32[..., D]
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLModel(nn.Module):
    """transformers' InternVLModel: `vision_tower`, `multi_modal_projector`, `language_model` (Qwen2's stack)."""

    def __init__(self, config: InternVLConfig):
        super().__init__()
        self.config = config
        self.vision_tower = InternVLVisionModel(config.vision)
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        self.language_model = Qwen2VLTextModel(config)  # reads config.text only: embed_tokens, layers, norm

    def encode_images(self, pixel_values):
        """f32[N,C,H,W] tiles -> f32[N*(H/p/s)*(W/p/s), D]: per tile, the feature layer's tokens without CLS on
        their grid, pixel-shuffled, projected; tiles in order, each tile's tokens row-major."""
        c = self.config
        x = self.vision_tower(pixel_values, c.vision_feature_layer)[:, 1:]  # strategy "default": CLS dropped
        N, L, E = x.shape
        side = int(L ** 0.5)  # transformers assumes a square grid (int(sqrt)): a non-square tile fails its reshape
        x = pixel_shuffle(x.reshape(N, side, side, E), c.scale)
        return self.multi_modal_projector(x.reshape(-1, x.shape[-1]))

    def forward(self, input_ids, attention_mask, position_ids=None, pixel_values=None, image_embeds=None):
        """i64[B,T], i64[B,T], i64[B,T] | None, f32[N,C,H,W] | None (or image_embeds f32[n,D]) -> f32[B,T,D]."""
        c = self.config
        embeds = self.language_model.embed_tokens(input_ids)
        if pixel_values is not None:
            image_embeds = self.encode_images(pixel_values)
        if image_embeds is not None:
            embeds = merge_image_embeddings(embeds, input_ids, image_embeds, c.image_token_id)
        return self.language_model(embeds, layer_inputs(c, attention_mask, position_ids))


class InternVLForConditionalGeneration(nn.Module):
    """transformers 5's tree: `model.vision_tower`, `model.multi_modal_projector`, `model.language_model`,
    `lm_head` (the embedding when tied)."""

    def __init__(self, config: InternVLConfig):
        super().__init__()
        self.config = config
        self.model = InternVLModel(config)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def embed(self, input_ids):  # i64[B,T] -> f32[B,T,D]: the token embeddings (text only)
        return self.model.language_model.embed_tokens(input_ids)

    def encode_images(self, pixel_values):  # f32[N,C,H,W] -> f32[N*tokens_per_tile, D]
        """The rows that replace the `<IMG_CONTEXT>` tokens, all tiles of the batch in order (frozen under LoRA, so a
        trainer may compute them once per batch)."""
        return self.model.encode_images(pixel_values)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, position_ids=None,
                return_hidden: bool = False, image_embeds=None):
        """input_ids i64[B,T], attention_mask i64[B,T] (right padding), pixel_values f32[N,C,H,W] (every tile of
        the batch: the processor's output; or image_embeds f32[n,D], encode_images' output), position_ids i64[B,T]
        (None: 0..T-1, as LLaMA-Factory's unpacked batches) -> logits f32[B,T,V] (and the final hidden states with
        return_hidden)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, position_ids, pixel_values, image_embeds)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path):
        """Build from an HF checkpoint directory (the release's stored names or transformers 5's in-memory ones),
        fp32, eval mode."""
        config = InternVLConfig.from_pretrained(path)
        state = {in_memory_name(name): t.to(torch.float32) for name, t in iter_tensors(path)}
        embed = "model.language_model.embed_tokens.weight"
        head = state.get("lm_head.weight")
        if config.tie_word_embeddings and head is not None and not torch.equal(head, state[embed]):
            config = config.untied()  # as transformers: both stored and different, so not tied (it warns)
        with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
            model = cls(config)
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state[embed]
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.get_parameter(embed)
        return model.eval()

