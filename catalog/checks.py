"""The catalog of checks per task class and method: level, aspect and measure of every check.

Data, not code paths: a check names the methods it applies to (`methods`, empty = every method of its
class), so a new method adds entries here and probes beside them, never a branch in the grader.

Shared by the recorder (which writes each check's inputs and reference outputs) and the grader
(which hands the inputs to a candidate and scores its outputs with the check's measure).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSpec:
    level: str
    name: str
    aspect: str   # "spec" | "numeric" | "behavioral"
    measure: str  # grader.scoring.measures.MEASURES key ("pass" for spec checks)
    what: str
    methods: tuple[str, ...] = ()  # training methods it applies to; () = all (and every serving check)
    features: tuple[str, ...] = ()  # family features it needs (family yaml `features`), all of them; () = any family

    @property
    def key(self) -> str:
        return f"{self.level}/{self.name}"


def _c(level, name, aspect, measure, what, methods=(), features=()):
    return CheckSpec(level, name, aspect, measure, what, tuple(methods), tuple(features))


SFT, DPO, PPO = ("sft",), ("dpo",), ("ppo",)
ALL = ()


# Spec checks run in the grader only (nothing to record but the expected names and shapes).
TRAINING_SPEC = (
    _c("L0", "torch_free", "spec", "pass", "no torch/transformers/torch_sources import, direct or indirect"),
    _c("L0", "layout", "spec", "pass", "every mirrored module exists and exposes the torch twin's public names"),
    _c("L0", "param_tree", "spec", "pass",
       "conversion.<family>.hf_layout of the converted tree: every checkpoint tensor's HF name and HF shape"),
    _c("L0", "lora_trainable", "spec", "pass", "LoRA trainable set: same PEFT names and shapes, base frozen"),
)

_TRAINING_CHECKS = (
    _c("L1", "rms_norm", "numeric", "tensor", "RMSNorm on random activations", ALL, ("norm:rms",)),
    _c("L1", "layer_norm", "numeric", "tensor", "LayerNorm (weight and bias) on random activations", ALL,
       ("norm:layer",)),
    _c("L1", "rope", "numeric", "tensor",
       "inverse frequencies over the rotary dim (llama3-scaled: also the unscaled config form), cos/sin, rotation "
       "(partial rotary: the tail channels pass through)", ALL, ("pos:rope",)),
    _c("L1", "alibi", "numeric", "tensor",
       "ALiBi slopes for power-of-two and other head counts, and the bias of left- and right-padded masks",
       ALL, ("pos:alibi",)),
    _c("L1", "mlp", "numeric", "tensor", "layer 0's MLP (gated, fused gate/up or plain, by family)"),
    _c("L1", "activation", "numeric", "tensor",
       "layer 0's MLP activation alone, on its negative tail too (an exact GELU and its tanh approximation differ "
       "by ~1e-4 in an MLP's output but by ~10% past -3)"),
    _c("L1", "attention_core", "numeric", "tensor", "eager GQA attention with causal+padding mask"),
    _c("L1", "attention_block", "numeric", "tensor",
       "layer 0's whole attention module: projections (fused or not, biased or not), q/k norms, position "
       "encoding, core, output projection"),
    _c("L1", "qkv_split", "numeric", "tensor", "a fused qkv projection's output split into q, k, v heads", ALL,
       ("qkv:fused",)),
    _c("L1", "attention_window", "numeric", "tensor",
       "the sliding-window mask past the window, padded, and eager attention under it", ALL,
       ("attn:sliding_window",)),
    _c("L1", "lora_linear", "numeric", "tensor", "LoRA linear y = xW^T + s (xA^T)B^T"),
    _c("L1", "image_regularize", "numeric", "agreement",
       "every shipped image decoded and regularized as LF does (max/min pixels, RGB, the Qwen2-VL size rules), exact, "
       "and the processor's patch grids (smart_resize's rounding)", ALL, ("vision:qwen",)),
    _c("L1", "image_processor", "numeric", "tensor",
       "the image processor's pixel values of every shipped image: bicubic resize, rescale, normalise, temporal "
       "patch, merge-block patch flattening", ALL, ("vision:qwen",)),
    _c("L1", "tower_pixels", "numeric", "tensor",
       "a fixed-size tower's processor on every shipped image, regularized by LF's base rule: pixel values (SigLIP "
       "and Gemma 3 resizes, LLaVA-NeXT's anyres tiles, InternVL's tiles) and the family's extras (image sizes)",
       ALL, ("vision:tower",)),
    _c("L1", "vision_rope", "numeric", "tensor",
       "the tower's 2-D rope: each patch's (row, column) in merge-block order, cos/sin", ALL, ("vision:qwen",)),
    _c("L1", "mrope", "numeric", "tensor",
       "the rope index of rows with one and two images, text between, padding (transformers' get_rope_index), its "
       "rope deltas, and the decoder's M-RoPE cos/sin (the mrope_section split)", ALL, ("pos:mrope",)),
    _c("L1", "patch_embed", "numeric", "tensor", "the tower's patch embedding (a Conv3d as one matmul)", ALL,
       ("vision:qwen",)),
    _c("L1", "vision_windows", "numeric", "agreement",
       "Qwen2.5-VL's window attention: the window permutation of the merged tokens and the windows' bounds", ALL,
       ("vision:windows",)),
    _c("L1", "data_tokens", "numeric", "agreement", "template+processor token ids on the raw train set", SFT),
    _c("L1", "data_labels", "numeric", "agreement", "label masks (-100 on prompts) on the raw train set", SFT),
    _c("L1", "collate", "numeric", "agreement", "collator padding and attention mask of the first batch", SFT),
    _c("L2", "decoder_layer", "numeric", "tensor", "decoder layer 0 on random hidden states"),
    _c("L2", "vision_block", "numeric", "tensor",
       "the tower's block 0 on two images' patch states: per-image attention by cu_seqlens under the vision rope",
       ALL, ("vision:qwen",)),
    _c("L2", "vision_merger", "numeric", "tensor", "the tower's patch merger (norm, 2x2 neighbours, MLP)", ALL,
       ("vision:qwen",)),
    _c("L2", "deepstack", "numeric", "tensor",
       "DeepStack's injection: merged features added to the image tokens' hidden states, in reading order, every "
       "other row unchanged", ALL, ("vision:deepstack",)),
    _c("L2", "audio_tower", "numeric", "agreement",
       "the audio tower present and loaded: its output's shape on random log-mel frames, and that every value is "
       "finite (the paper grades no audio numbers)", ALL, ("audio:present",)),
    _c("L2", "vision_tower", "numeric", "tensor",
       "the whole tower on two shipped images' pixel values: merged embeddings (and deepstack features)", ALL,
       ("vision:qwen",)),
    _c("L2", "image_features", "numeric", "tensor",
       "a fixed-size tower's image rows (encode_images: the tower at its feature layer, pooling, pixel shuffle or "
       "anyres unpad with newlines, the projector) on three shipped images' pixel values", ALL, ("vision:tower",)),
    _c("L3", "logits_b1_t7", "numeric", "tensor",
       "full-model logits, batch 1 x 7, no attention mask, also through a tied-embedding copy of the checkpoint"),
    _c("L3", "logits_b2_t16_pad", "numeric", "tensor", "full-model logits, batch 2 x 16, right padding"),
    _c("L3", "logits_b3_t33_pad", "numeric", "tensor", "full-model logits, batch 3 x 33, ragged padding"),
    _c("L3", "next_token_dist", "numeric", "distributional", "next-token distributions of the padded batch"),
    _c("L3", "logits_images", "numeric", "tensor",
       "full-model logits of a padded batch with three shipped images (one row holds two), positions from the "
       "model's own rope index", ALL, ("data:images",)),
    _c("L3", "pixel_grad", "numeric", "tensor",
       "that batch's loss over its text labels and its gradient with respect to the pixel values (image content "
       "through the tower and every attended layer)", ALL, ("data:images",)),
    _c("L4", "loss_step0", "numeric", "scalar", "SFT loss of the first accumulation step, LoRA init", SFT),
    _c("L4", "lora_grads_step0", "numeric", "tensor", "LoRA gradients of the first accumulation step", SFT),
    _c("L4", "loss_step0_train_on_prompt", "numeric", "scalar",
       "the first accumulation step's SFT loss on train_on_prompt rows: every labelled position, the first one "
       "too, in the denominator (LF 0.9.5's transformers)", SFT, ("data:train_on_prompt",)),
    _c("L4", "fixed_steps_loss", "behavioral", "scalar",
       "losses of k optimizer steps on fixed batches, under the task's optimizer args and with weight decay 1.0, lr 2e-2 on "
       "the linear schedule", SFT),
    _c("L4", "fixed_steps_params", "behavioral", "tensor", "LoRA params after those k optimizer steps, both runs", SFT),
    _c("L5", "e2e_step_losses", "behavioral", "scalar", "per-step training losses of the candidate's own entry point", SFT),
    _c("L5", "e2e_adapter", "behavioral", "tensor",
       "trained adapter after the end-to-end run (its outputs are the L6 child's adapter, every method)"),
    _c("L5", "e2e_eval_loss", "behavioral", "scalar",
       "the candidate's own eval_loss before and after training (its Trainer.evaluate), not the L6 score", SFT),
    _c("L6", "heldout_loss", "behavioral", "banded",
       "held-out eval loss the grader computes from the candidate's logits with its L5 adapter, banded by seed spread", SFT),
    _c("L1", "pairwise_tokens", "numeric", "agreement",
       "pairwise processor token ids of chosen and rejected rows on the raw train set (prompt cut with infer_seqlen)", DPO),
    _c("L1", "pairwise_labels", "numeric", "agreement", "pairwise label masks (-100 over the prompt), both responses", DPO),
    _c("L1", "pairwise_collate", "numeric", "agreement",
       "pairwise collator: every chosen row, then every rejected row, padded together", DPO),
    _c("L3", "sequence_logps", "numeric", "tensor",
       "per-sequence log-probs summed over response tokens, chosen and rejected, under the policy (a nonzero "
       "adapter) and the reference (the adapter disabled)", DPO),
    _c("L4", "dpo_loss_step0", "numeric", "scalar",
       "DPO sigmoid loss of the first accumulation step, from an adapter whose policy differs from the reference", DPO),
    _c("L4", "dpo_metrics_step0", "numeric", "scalar",
       "LF's logged metrics of that step: rewards, accuracies, margins, log-probs, logits means", DPO),
    _c("L4", "dpo_grads_step0", "numeric", "tensor", "LoRA gradients of that step", DPO),
    _c("L4", "dpo_fixed_steps_loss", "behavioral", "scalar",
       "DPO losses of k optimizer steps on fixed batches from the LoRA init (the last step short: one micro-batch "
       "of 3 pairs), under the task's args and with weight decay 1.0, lr 2e-2, linear schedule, label smoothing "
       "0.1 and ftx 0.5", DPO),
    _c("L4", "dpo_fixed_steps_params", "behavioral", "tensor", "LoRA params after those k DPO steps, both runs", DPO),
    _c("L5", "dpo_e2e_step_losses", "behavioral", "scalar",
       "per-step DPO losses of the candidate's own train_dpo from the raw preference dataset", DPO),
    _c("L5", "dpo_e2e_metrics", "behavioral", "scalar", "per-step logged metrics of that run", DPO),
    _c("L5", "dpo_e2e_eval", "behavioral", "scalar",
       "the candidate's own held-out loss and metrics before and after training, not the L6 score", DPO),
    _c("L6", "heldout_preference", "behavioral", "banded",
       "held-out preference loss and accuracy the grader computes from the candidate's policy and reference logits "
       "with its L5 adapter, each banded by seed spread", DPO),
    _c("L1", "prompt_data", "numeric", "agreement",
       "unsupervised processor prompt ids and labels on the raw train set, and the left-padded prompt batch", PPO),
    _c("L1", "value_head", "numeric", "tensor", "TRL's value head Linear(hidden, 1) on random hidden states", PPO),
    _c("L1", "reward_score", "numeric", "tensor",
       "the full reward model's score at attention_mask.sum - 1 of right-padded query + response rows", PPO),
    _c("L1", "rollout_rules", "numeric", "agreement",
       "sampling (temperature, top-k, top-p, exponential race over shared noise) under three settings, and LF's "
       "trimming of queries and responses (eos kept when pad == eos, a second stop word, an empty response)", PPO),
    _c("L1", "kl_rewards", "numeric", "tensor",
       "per-token KL penalty rewards, the score at the last response token, at two KL coefficients", PPO),
    _c("L1", "gae_whiten", "numeric", "tensor",
       "GAE advantages and returns, whitened over the whole batch, at the task's (gamma, lam), at (0.9, 0.8), "
       "and with whitened rewards", PPO),
    _c("L1", "ppo_loss", "numeric", "tensor",
       "clipped policy and value losses and TRL's loss stats where ratios and values cross both clip ranges, and "
       "zeroed past ratio_threshold", PPO),
    _c("L1", "kl_controller", "numeric", "scalar",
       "the adaptive KL controller across its clip range, and the fixed one", PPO),
    _c("L3", "rollout_generate", "numeric", "agreement",
       "sampled responses of a nonzero adapter from left-padded prompts (positions from the mask), trimmed", PPO),
    _c("L3", "rollout_logprobs_values", "numeric", "tensor",
       "TRL's batched forward pass of the policy (nonzero adapter, value head) and the reference: log-probs, "
       "values and response masks of right-padded query + response rows", PPO),
    _c("L4", "ppo_step0_losses", "numeric", "scalar",
       "policy, value and total loss of the first mini-batch of a PPO step on fixed rollouts", PPO),
    _c("L4", "ppo_step0_tensors", "numeric", "tensor",
       "that step's old log-probs, reference log-probs, values, KLs, advantages and returns", PPO),
    _c("L4", "ppo_step0_grads", "numeric", "tensor", "LoRA and value-head gradients of that mini-batch", PPO),
    _c("L4", "ppo_fixed_steps_stats", "behavioral", "scalar",
       "TRL's step stats of k PPO steps (rollouts included) on fixed prompt batches from the inits, under the "
       "task's args and with weight decay 1.0, lr 2e-2, linear schedule, a fixed KL controller at 0.3, "
       "gamma 0.9, lam 0.8 and whitened rewards", PPO),
    _c("L4", "ppo_fixed_steps_rollouts", "behavioral", "agreement", "the responses sampled at each of those steps", PPO),
    _c("L4", "ppo_fixed_steps_params", "behavioral", "tensor", "LoRA and value head after those steps, both runs", PPO),
    _c("L5", "ppo_e2e_stats", "behavioral", "scalar",
       "per-step PPO stats of the candidate's own train_ppo from the raw prompts (no clip fractions)", PPO),
    _c("L5", "ppo_e2e_rollouts", "behavioral", "agreement", "the responses that run sampled at every step", PPO),
    _c("L5", "ppo_e2e_value_head", "behavioral", "tensor", "the value head that run trained", PPO),
    _c("L5", "ppo_e2e_eval", "behavioral", "scalar",
       "the candidate's own held-out reward before training (after training, one sampled token in 1536 may flip "
       "on fp32 rounding: the grader scores it at L6, banded), not the L6 score", PPO),
    _c("L6", "heldout_reward", "behavioral", "banded",
       "held-out reward the grader computes: its own decoding of the candidate's logits with its L5 adapter, its "
       "own numpy reward model, banded by seed spread", PPO),
)

# in level order (stable: each method's checks keep their order within a level)
TRAINING_CHECKS = tuple(sorted(_TRAINING_CHECKS, key=lambda s: s.level))

SERVING_SPEC = (
    _c("L0", "torch_free", "spec", "pass", "no torch/transformers/torch_sources import, direct or indirect"),
    _c("L0", "layout", "spec", "pass", "every mirrored serving module exposes the torch twin's public names"),
    _c("L0", "engine_api", "spec", "pass", "LLMEngine and ModelRunner expose the engine API"),
    _c("L0", "param_tree", "spec", "pass",
       "conversion.<family>.hf_layout of the converted tree: every checkpoint tensor's HF name and HF shape"),
)

SERVING_CHECKS = (
    _c("L1", "paged_attention", "numeric", "tensor", "ragged paged attention: prefill, chunk and decodes in one call"),
    _c("L1", "paged_attention_window_softcap", "numeric", "tensor", "the same with sliding window and soft-cap"),
    _c("L1", "paged_attention_kernel", "numeric", "tensor",
       "the Pallas ragged paged-attention kernel body itself on contexts past one key block (interpret mode "
       "on CPU, compiled on GPU)"),
    _c("L1", "paged_attention_kernel_window_softcap", "numeric", "tensor",
       "the Pallas kernel with a sliding window across its key blocks, and soft-cap"),
    _c("L1", "paged_attention_sinks", "numeric", "tensor",
       "ragged paged attention with per-head attention sinks (in the softmax normaliser only) and a sliding window",
       ALL, ("attn:sinks",)),
    _c("L1", "paged_attention_kernel_sinks", "numeric", "tensor",
       "the Pallas kernel with attention sinks, a sliding window across its key blocks, on long contexts", ALL,
       ("attn:sinks",)),
    _c("L1", "rope", "numeric", "tensor",
       "inverse frequencies and cos/sin of every layer type (YaRN: also its attention factor)", ALL, ("pos:rope",)),
    _c("L1", "mrope_positions", "numeric", "agreement",
       "the engine's M-RoPE position table and rope delta of a prompt holding two images (get_rope_index on one "
       "row), computed once per request", ALL, ("pos:mrope",)),
    _c("L1", "step_image_inputs", "numeric", "agreement",
       "one ragged step's image bookkeeping (input_batch): the M-RoPE positions of a chunk inside two images, a "
       "recompute past the prompt (position + delta) and a decode, and the image rows each chunk takes", ALL,
       ("vision:qwen",)),
    _c("L1", "image_inputs", "numeric", "agreement",
       "the engine's input processing of images: each image token expanded to its image's rows, the placeholder "
       "ranges, the image grids", ALL, ("vision:qwen",)),
    _c("L1", "moe_routing", "numeric", "tensor",
       "top-k routing of router logits (ties included) as a dense [tokens, experts] weight matrix: softmax over "
       "the k selected logits", ALL, ("mlp:moe",)),
    _c("L1", "expert_activation", "numeric", "tensor",
       "the experts' clamped gated activation on interleaved gate/up values past the clamp limit", ALL,
       ("mlp:moe",)),
    _c("L1", "mxfp4_dequant", "numeric", "tensor",
       "MXFP4 dequantization by the conversion: every nibble under a range of E8M0 scales, and layer 0's experts",
       ALL, ("quant:mxfp4",)),
    _c("L1", "norm", "numeric", "tensor", "the family's RMSNorm"),
    _c("L1", "sampler_penalties", "numeric", "tensor", "repetition, presence and frequency penalties"),
    _c("L1", "sampler_temperature", "numeric", "tensor", "temperature (greedy rows untouched)"),
    _c("L1", "sampler_min_p", "numeric", "agreement", "min-p kept set"),
    _c("L1", "sampler_top_k_top_p", "numeric", "agreement", "top-k then top-p kept set (crossing token kept)"),
    _c("L1", "sampler_greedy", "numeric", "agreement", "greedy ids"),
    _c("L1", "sampler_random", "numeric", "agreement", "exponential-race draws after every transform"),
    _c("L1", "sampler_pipeline", "numeric", "agreement",
       "the engine's own Sampler over SamplingMetadata.from_requests: stage order, seeds, greedy rows"),
    _c("L2", "decoder_layer_paged", "numeric", "tensor", "decoder layer 0 with its paged KV write"),
    _c("L2", "encoder_outputs", "numeric", "tensor",
       "the processor's pixel values and the encoder's merged rows of each shipped image, one image per call as "
       "the engine runs it", ALL, ("vision:qwen",)),
    _c("L2", "moe_block", "numeric", "tensor", "layer 0's whole mixture-of-experts block: router and experts",
       ALL, ("mlp:moe",)),
    _c("L3", "prefill_t5", "numeric", "tensor", "prefill logits, 5-token prompt"),
    _c("L3", "prefill_t17", "numeric", "tensor", "prefill logits, 17-token prompt"),
    _c("L3", "prefill_t40", "numeric", "tensor", "prefill logits, 40-token prompt (past the sliding window)"),
    _c("L3", "prefill_images", "numeric", "tensor",
       "prefill logits of a prompt holding two images between text (image rows in place of the image tokens, "
       "M-RoPE positions)", ALL, ("vision:qwen",)),
    _c("L4", "decode_logits", "numeric", "tensor", "teacher-forced decode logits, 8 steps"),
    _c("L4", "cache_state", "numeric", "tensor", "K/V cache contents after prefill and 8 decode steps"),
    _c("L5", "greedy_sequences", "behavioral", "agreement", "the live engine's greedy outputs on the workload"),
    _c("L5", "sampled_sequences", "behavioral", "agreement", "seeded sampled outputs (numpy noise) on the workload"),
    _c("L5", "engine_invariants", "behavioral", "agreement", "prefix-cache hits, every block back in the pool"),
    _c("L5", "schedule_trace", "behavioral", "agreement",
       "under a KV pool that preempts and evicts: per step the scheduled ids and token counts, preempted ids, "
       "block tables, freed and evicted blocks"),
    _c("L5", "stop_conditions", "behavioral", "agreement",
       "requests that stop at eos, a second eos id, a stop token (also as the last allowed token), max_tokens, "
       "max_model_len, past eos with ignore_eos, and one aborted: outputs, finish and stop reasons, blocks freed"),
    _c("L5", "sampling_branches", "behavioral", "agreement",
       "a top-p-only batch (seeded) and a min-p-only batch (unseeded: the engine-wide noise stream)"),
    _c("L5", "long_decode", "behavioral", "agreement",
       "requests served one after another, each decoding greedily to max_model_len (over a thousand engine "
       "steps: where the L5 time budget binds)"),
    _c("L5", "image_workload", "behavioral", "agreement",
       "image requests through the live engine under an encoder budget and a small KV pool: greedy outputs, per "
       "step the scheduled ids and tokens, preemptions, block tables, the images encoded and the encoder cache's "
       "evictions, the prefix-cache hits (a shared image reused, a different one not)", ALL, ("vision:qwen",)),
    _c("L6", "heldout_logprobs_images", "behavioral", "tensor",
       "held-out prompt log-probs and top-5 values of image prompts through the live engine (prompt_logprobs, "
       "chunks cut inside images in chunked mode)", ALL, ("vision:qwen",)),
    _c("L6", "heldout_logprobs", "behavioral", "tensor",
       "held-out prompt log-probs and top-5 values through the live engine (prompt_logprobs, across chunks)"),
    _c("L6", "next_token_dists", "behavioral", "distributional",
       "the live engine's whole next-token distributions along its greedy runs (logprobs=-1)"),
)

CHECKS_BY_CLASS = {"training": (TRAINING_SPEC, TRAINING_CHECKS), "serving": (SERVING_SPEC, SERVING_CHECKS)}


def checks_for(task_class: str, method: str | None = None, features=None) -> tuple[tuple[CheckSpec, ...], tuple[CheckSpec, ...]]:
    """(spec checks, other checks) of a task class; for a training method and family features, only the checks
    that apply to them (features None: every check, whatever its features)."""
    try:
        groups = CHECKS_BY_CLASS[task_class]
    except KeyError:
        raise ValueError(f"unknown task class {task_class!r}; known: {sorted(CHECKS_BY_CLASS)}") from None
    if features is not None:
        groups = tuple(tuple(s for s in g if set(s.features) <= set(features)) for g in groups)
    if method is None:
        return groups
    return tuple(tuple(s for s in g if not s.methods or method in s.methods) for g in groups)
