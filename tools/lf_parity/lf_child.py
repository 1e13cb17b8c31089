"""Runs in .venv-lf, never in .venv: LLaMA-Factory's own workflow for one task, instrumented, not changed.

    .venv-lf/bin/python tools/lf_parity/lf_child.py WORK_DIR

WORK_DIR/job.json (written by tools/lf_parity/harness.py) holds the LLaMA-Factory arguments, the stage, the
token variants to tokenize and the data order; WORK_DIR/init_adapter.safetensors the project's initial LoRA.
What is injected, and nothing else:
- the initial adapter, copied into the PEFT model right after LLaMA-Factory's `load_model` built it (LF draws its
  own A with torch's RNG; the project draws A from numpy so the JAX twin gets the same bits);
- the data order, as the trainer's train sampler (LF's is HF's RandomSampler over torch's RNG; the project's is
  numpy's permutation of seed + epoch);
- a torchaudio stand-in, only where torchaudio is absent: llamafactory/data/mm_plugin.py imports it at module
  level and uses it only to load audio (README.md, "The environment");
- images (job "mm"), only where torchvision is absent: no video processor (`install_no_video_processor`), since
  transformers 5.6 builds every video processor on torchvision and Qwen2VLProcessor loads one unconditionally;
  where the job names the release's video settings (Qwen3-VL: its plugin reads the video processor's merge_size
  for every message), a stand-in carrying them that processes nothing (`VideoProcessorStandin`);
- SFT/DPO with job "hf_loss_kwargs" only: the trainer's model_accepts_loss_kwargs set back to what HF's own rule
  gives (LF turns it off whenever a processor is loaded; README.md, "Vision-language tasks");
- PPO (train_ppo): the project's value head init, its rollouts at get_inputs and TRL's mini-batch orders, two
  transformers-5 shims LF 0.9.5's PPO trainer needs, and the alignments the job asks for (amp, clip_every_step,
  no_decay_is_zero, sync_by_count: README.md, "Aligned in the compared run").
What is observed: the tokenized rows (LF's get_dataset, per variant; with images, each row's resolved image
paths), the template and (with images) its mm plugin and the processor LF loaded, every batch LF's collator hands
the trainer (job "record_batches": lf/batches/NNN.safetensors), the loss each optimizer step returns
(the sum of HF's training_step over the step's micro-batches), LF's logged metrics, HF's evaluate() before and
after training (every eval_* metric), and the adapter LF saved. All of it goes to WORK_DIR/lf/.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys
import types
from pathlib import Path


def install_torchaudio_standin() -> bool:
    """A module named torchaudio whose every attribute is missing: importable, unusable, and invisible to
    transformers' availability checks (no distribution metadata). True when it was needed."""
    if importlib.util.find_spec("torchaudio") is not None:
        return False
    module = types.ModuleType("torchaudio")
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

    def __getattr__(name):  # AttributeError, so that hasattr() and inspect see a plain module
        raise AttributeError(f"torchaudio.{name}: torchaudio is not installed in .venv-lf (text tasks load no audio)")

    module.__getattr__ = __getattr__
    sys.modules["torchaudio"] = module
    return True


class VideoProcessorStandin:
    """The release's video_preprocessor_config.json settings as attributes (what LF's Qwen3VLPlugin reads of the
    video processor for images: merge_size), on a processor without a video processor. Processing anything raises:
    the data has no videos."""

    def __init__(self, settings: dict):
        self.settings = dict(settings)
        for key, value in settings.items():
            setattr(self, key, value)

    def __call__(self, *args, **kwargs):
        raise RuntimeError("no video processor in .venv-lf (transformers 5.6 builds it on torchvision): a stand-in "
                           "carrying the release's settings, which processes no video")

    preprocess = __call__


def install_no_video_processor(standin: dict | None = None) -> bool:
    """Qwen-VL processors without a video processor, where torchvision is absent. True when it was needed.

    transformers 5.6's Qwen2VLProcessor loads its video processor through AutoVideoProcessor whatever the
    checkpoint's files say, and every video processor is a BaseVideoProcessor, which requires torchvision (its
    image processor falls back to the PIL backend, its video processor has none). Dropping `video_processor`
    from the processor's attributes builds it from the image processor and the tokenizer alone; LF's plugin then
    finds no `video_processor` attribute, so its input check falls back to the image processor (getattr's
    default) and it reads the video processor only to process videos, which the data has none of.

    standin (the release's video_preprocessor_config.json, harness.RELEASE_VIDEO_PREPROCESSOR): LF's Qwen3VLPlugin
    reads getattr(processor, "video_processor") with no default, and its merge_size, for every message, videos or
    not; the processor class (standin["processor_class"]) then carries a VideoProcessorStandin as a class
    attribute."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers.processing_utils import ProcessorMixin

    attributes = ProcessorMixin.get_attributes.__func__

    def get_attributes(cls):
        return [a for a in attributes(cls) if a != "video_processor"]

    ProcessorMixin.get_attributes = classmethod(get_attributes)
    if standin:  # a class attribute: getattr finds it, ProcessorMixin.to_dict (saving the processor) does not
        import transformers

        setattr(getattr(transformers, standin["processor_class"]), "video_processor", VideoProcessorStandin(standin))
    return True


TEMPLATE_FIELDS = ("default_system", "stop_words", "thought_words", "efficient_eos", "replace_eos", "enable_thinking",
                   "preserve_thinking")


def template_facts(template, tokenizer) -> dict:
    """The template's own fields, and what its fix_special_tokens left on the tokenizer: eos, pad, the stop words'
    ids, and the eos ids LF's generation carries ([eos] + the extra special tokens, as its SFT workflow derives them
    on transformers 5)."""
    facts = {k: getattr(template, k) for k in TEMPLATE_FIELDS}
    facts = {k: list(v) if isinstance(v, tuple) else v for k, v in facts.items()}
    extra = [str(t) for t in getattr(tokenizer, "_extra_special_tokens", [])]
    extra_ids = [i for i in tokenizer.convert_tokens_to_ids(extra) if i != -1] if extra else []
    facts.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                 stop_word_ids=tokenizer.convert_tokens_to_ids(list(template.stop_words)),
                 generation_eos_ids=list(dict.fromkeys([tokenizer.eos_token_id] + extra_ids)))
    return facts


MM_PLUGIN_FIELDS = ("image_token", "video_token", "audio_token", "vision_bos_token", "vision_eos_token",
                    "expand_mm_tokens")
# a plugin with an audio token (Qwen2OmniPlugin): its audio span tokens and the feature extractor LF loaded
AUDIO_PLUGIN_FIELDS = ("audio_bos_token", "audio_eos_token")
FEATURE_EXTRACTOR_FIELDS = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value",
                            "n_samples", "dither")
IMAGE_PROCESSOR_FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "do_resize",
                          "resample", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")


# a fixed-size tower's processor (issue 34: Gemma 3, PaliGemma, LLaVA-NeXT, InternVL): its image processor's tiling
# and size settings, and what the processor itself holds (tokens per image, LLaVA-NeXT's feature arithmetic, the
# image tokens it read off the tokenizer); None where the class has no such attribute
TOWER_IMAGE_FIELDS = ("size", "crop_size", "image_grid_pinpoints", "do_center_crop", "do_pad", "crop_to_patches",
                      "min_patches", "max_patches", "do_pan_and_scan")
TOWER_PROCESSOR_FIELDS = ("image_seq_length", "num_additional_image_tokens", "patch_size",
                          "vision_feature_select_strategy", "image_token", "boi_token", "full_image_sequence",
                          "start_image_token", "end_image_token")
COMMON_IMAGE_FIELDS = IMAGE_PROCESSOR_FIELDS[3:]  # image_mean ... do_convert_rgb


def plain(value):
    """A processor attribute as JSON: tuples as lists, size dicts (transformers 5's SizeDict is a dataclass) as
    dicts without their None entries."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    return value


def tower_facts(processor) -> dict:
    image = processor.image_processor
    facts = {k: plain(getattr(image, k, None)) for k in (*COMMON_IMAGE_FIELDS, *TOWER_IMAGE_FIELDS)}
    facts.update({f"processor_{k}": plain(getattr(processor, k, None)) for k in TOWER_PROCESSOR_FIELDS})
    facts["resample"] = int(facts["resample"]) if facts["resample"] is not None else None
    return facts


def mm_facts(template, processor, tower: bool = False) -> dict | None:
    """A template with an image token: its plugin (LF's name for it, its tokens), the pixel bounds LF's
    patch_processor put on the processor, and the image processor LF loaded (its class and settings, size as
    min/max pixels)."""
    from llamafactory.data.mm_plugin import PLUGINS

    plugin = template.mm_plugin
    if getattr(plugin, "image_token", None) is None:
        return None
    facts = {"plugin": next((k for k, v in PLUGINS.items() if v is type(plugin)), type(plugin).__name__),
             **{k: getattr(plugin, k, None) for k in MM_PLUGIN_FIELDS}}
    if processor is None:
        return {**facts, "processor": None}
    image = processor.image_processor
    facts.update(processor=type(processor).__name__, image_processor=type(image).__name__,
                 image_max_pixels=getattr(processor, "image_max_pixels", None),
                 image_min_pixels=getattr(processor, "image_min_pixels", None))
    if tower:
        return {**facts, **tower_facts(processor)}
    size = dict(getattr(image, "size", None) or {})
    facts.update(
                 min_pixels=size.get("shortest_edge"), max_pixels=size.get("longest_edge"),
                 **{k: (list(v) if isinstance(v, tuple) else v) for k in IMAGE_PROCESSOR_FIELDS
                    for v in [getattr(image, k, None)]})
    facts["resample"] = int(facts["resample"]) if facts["resample"] is not None else None
    if getattr(plugin, "audio_token", None) is not None:
        extractor = getattr(processor, "feature_extractor", None)
        facts.update({k: getattr(plugin, k, None) for k in AUDIO_PLUGIN_FIELDS},
                     feature_extractor=type(extractor).__name__ if extractor is not None else None,
                     **{f"audio_{k}": getattr(extractor, k, None) for k in FEATURE_EXTRACTOR_FIELDS})
    return facts


def _rows(dataset) -> list[dict]:
    keep = [c for c in dataset.column_names if c.endswith(("input_ids", "labels"))]
    rows = [{c: list(row[c]) for c in keep} for row in dataset]
    if "images" in dataset.column_names:  # LF's resolved paths (media_dir/name), None for a row without images
        for row, images in zip(rows, dataset["images"]):
            row["images"] = [str(i) for i in images or []]
    return rows


def main(work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    out = work / "lf"
    out.mkdir(exist_ok=True)
    shim = install_torchaudio_standin()
    no_video = install_no_video_processor(job.get("video_processor_standin")) if job.get("mm") else False

    import torch

    import llamafactory
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    torch.use_deterministic_algorithms(True)
    seen: dict = {"datasets": {}, "step_losses": [], "micro": [], "logs": [], "eval_before": None, "batches": []}

    # ---- tokens: LF's get_dataset under every variant's arguments (no training) ----
    for name, overrides in job["variants"].items():
        if job["lf_stage"] == "ppo" and "reward_model" not in job["args"]:
            raise ValueError("LF's stage ppo needs a reward_model argument")
        model_args, data_args, training_args, _, _ = get_train_args({**job["args"], **overrides, "do_train": True})
        tokenizer_module = load_tokenizer(model_args)
        try:
            template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
        except ValueError as error:  # LF refuses the variant for this template (train_on_prompt + efficient_eos)
            seen["datasets"][name] = {"refused": str(error)}
            continue
        module = get_dataset(template, model_args, data_args, training_args, stage=job["lf_stage"], **tokenizer_module)
        seen["datasets"][name] = {split: _rows(module[f"{split}_dataset"]) for split in ("train", "eval")
                                  if module.get(f"{split}_dataset") is not None}
        seen.setdefault("pad_token_id", tokenizer_module["tokenizer"].pad_token_id)
        seen.setdefault("template", template_facts(template, tokenizer_module["tokenizer"]))
        if job.get("mm"):
            seen.setdefault("mm", mm_facts(template, tokenizer_module["processor"], bool(job.get("tower"))))

    def write(**more):
        seen.pop("micro", None)
        (out / "result.json").write_text(json.dumps({**seen, "torchaudio_standin": shim, "no_video_processor": no_video,
                                                      "llamafactory": llamafactory.__version__,
                                                      "pillow": importlib.metadata.version("pillow"), **more},
                                                     default=str))

    if job.get("train", True):
        try:
            (train_ppo if job["lf_stage"] == "ppo" else train_sft_or_dpo)(job, work, seen)
        except Exception as error:  # what was observed before LF stopped (the exit status still says it failed)
            write(failed=f"{type(error).__name__}: {error}")
            raise
    write()


def release_name(name: str, renames) -> str:
    """A PEFT name of LF's model under the checkpoint's own (release) module tree: transformers 5 nests a
    vision-language model's decoder (`model.language_model.*`, `model.visual.*`) where the release and the torch
    source keep `model.*` and `visual.*` (the job's adapter_renames: [LF prefix, release prefix])."""
    for lf_prefix, release_prefix in renames or ():
        if name.startswith(lf_prefix):
            return release_prefix + name[len(lf_prefix):]
    return name


def _inject_adapter(model, init: dict, value_head: dict | None = None, renames=()) -> None:
    """The project's initial LoRA (and value head) into LF's freshly built model, by PEFT name."""
    import torch

    params = {}
    for n, p in model.named_parameters():
        if ".lora_" in n:
            params[release_name(n.replace(".default", "").replace("pretrained_model.", ""), renames)] = p
        elif n.startswith("v_head.") and value_head is not None:
            params["@" + n] = p
    wanted = {**init, **{"@" + k: v for k, v in (value_head or {}).items()}}
    if params.keys() != wanted.keys():
        raise KeyError(f"LF's trainable tensors differ from the project's: LF only "
                       f"{sorted(params.keys() - wanted.keys())[:4]}, project only {sorted(wanted.keys() - params.keys())[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(wanted[name].to(p.dtype))


def _hf_accepts_loss_kwargs(trainer) -> bool:
    """What HF's Trainer.__init__ sets model_accepts_loss_kwargs to for the trainer's model (its own rule:
    the unwrapped model's accepts_loss_kwargs, else whether its forward takes **kwargs)."""
    import inspect

    from transformers.trainer import unwrap_peft_model

    model = unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def train_sft_or_dpo(job: dict, work: Path, seen: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from torch.utils.data import Sampler
    from transformers import TrainerCallback

    from llamafactory.train.tuner import run_exp

    workflow = importlib.import_module(job["workflow"])
    trainer_module, trainer_name = job["trainer"].split(":")
    trainer_cls = getattr(importlib.import_module(trainer_module), trainer_name)
    init = load_file(str(work / "init_adapter.safetensors"))
    load_model = workflow.load_model

    def load_model_with_project_adapter(*args, **kwargs):
        model = load_model(*args, **kwargs)
        _inject_adapter(model, init, renames=job.get("adapter_renames"))
        return model

    workflow.load_model = load_model_with_project_adapter

    class ProjectOrder(Sampler):
        """The project's data order: epoch e's permutation, one epoch per iteration."""

        def __init__(self, orders):
            self.orders, self.epoch = orders, 0

        def __len__(self):
            return len(self.orders[0])

        def __iter__(self):
            order = self.orders[min(self.epoch, len(self.orders) - 1)]
            self.epoch += 1
            return iter(order)

    trainer_cls._get_train_sampler = lambda self, *a, **k: ProjectOrder(job["orders"])
    trainer_init = trainer_cls.__init__

    def observed_init(self, *args, **kwargs):
        trainer_init(self, *args, **kwargs)
        # LF's SFT trainer sets model_accepts_loss_kwargs = False whenever a processor is loaded (a multimodal
        # model): each micro-batch is then its own token mean, divided by GA. Observed always; set back to HF's
        # value for the model only where the job asks (parity.MM_LOSS: the hf_loss_kwargs runs)
        seen["model_accepts_loss_kwargs"] = {"lf": self.model_accepts_loss_kwargs, "hf": _hf_accepts_loss_kwargs(self)}
        if job.get("hf_loss_kwargs"):
            self.model_accepts_loss_kwargs = seen["model_accepts_loss_kwargs"]["hf"]

    trainer_cls.__init__ = observed_init
    training_step = trainer_cls.training_step

    batches = work / "lf" / "batches"
    if job.get("record_batches"):
        batches.mkdir(parents=True, exist_ok=True)

    def observed_training_step(self, model, inputs, *args, **kwargs):
        if job.get("record_batches"):  # what LF's collator handed the trainer, before the step
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().clone() for k, v in inputs.items() if torch.is_tensor(v)},
                      str(batches / f"{len(seen['batches']):03d}.safetensors"))
            seen["batches"].append(sorted(k for k, v in inputs.items() if torch.is_tensor(v)))
        loss = training_step(self, model, inputs, *args, **kwargs)
        seen["micro"].append(float(loss))
        return loss

    trainer_cls.training_step = observed_training_step
    train = trainer_cls.train

    def train_after_eval(self, *args, **kwargs):
        seen["eval_before"] = self.evaluate() if self.eval_dataset is not None else None
        return train(self, *args, **kwargs)

    trainer_cls.train = train_after_eval

    class Observe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen["step_losses"].append(sum(seen["micro"]))
            seen["micro"].clear()

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen["logs"].append(dict(logs or {}))

    run_exp(args=job["args"], callbacks=[Observe()])
    final = json.loads((Path(job["args"]["output_dir"]) / "all_results.json").read_text())
    seen["eval_after"] = {k: v for k, v in final.items() if k.startswith("eval_")} or None


class _OrderedNumpy:
    """numpy for TRL's ppo_trainer module, but np.random.permutation(bs) hands out the project's mini-batch orders
    (TRL 0.9.6 PPOTrainer.step draws them from numpy's global state, once per PPO epoch)."""

    def __init__(self, numpy, orders):
        self._np, self._orders = numpy, list(orders)
        outer = self

        class _Random:
            def permutation(self, n):
                order = outer._orders.pop(0)
                if len(order) != n:
                    raise ValueError(f"TRL asked for a permutation of {n}, the project's has {len(order)}")
                return outer._np.asarray(order)

            def __getattr__(self, name):
                return getattr(outer._np.random, name)

        self.random = _Random()

    def __getattr__(self, name):
        return getattr(self._np, name)


def train_ppo(job: dict, work: Path, seen: dict) -> None:
    """LF's run_ppo on TRL 0.9.6 (the overlay on PYTHONPATH), its CustomPPOTrainer.ppo_train loop as it is, with
    the rollouts injected at get_inputs: HF generate samples with torch.multinomial, the project with its own
    noise, so the responses are the project's (queries, responses) of each mini-batch, in order; get_rewards,
    step, the optimizer, scheduler and KL controller are LF's and TRL's."""
    import contextlib

    import numpy
    import torch
    from safetensors.torch import load_file

    import trl
    from llamafactory.hparams import get_train_args
    from llamafactory.train.ppo import trainer as ppo_trainer
    from llamafactory.train.ppo import workflow

    seen["trl"] = trl.__version__
    from transformers import PreTrainedTokenizerBase

    if not hasattr(PreTrainedTokenizerBase, "additional_special_tokens_ids"):
        # LF 0.9.5's CustomPPOTrainer reads tokenizer.additional_special_tokens_ids (gone in transformers 5) for its
        # generation config's eos ids; supplied as LF's own SFT workflow derives them on transformers 5. Only
        # generation reads them, and the rollouts are injected.
        def additional_special_tokens_ids(self):
            tokens = [str(t) for t in getattr(self, "_extra_special_tokens", [])]
            return [i for i in self.convert_tokens_to_ids(tokens) if i != -1] if tokens else []

        PreTrainedTokenizerBase.additional_special_tokens_ids = property(additional_special_tokens_ids)
        seen["shims"] = ["tokenizer.additional_special_tokens_ids"]
    trl_ppo = importlib.import_module("trl.trainer.ppo_trainer")
    remove_unused_columns = trl_ppo.PPOTrainer._remove_unused_columns

    def observed_remove_unused_columns(self, dataset):  # the columns TRL's dataloader keeps of LF's dataset
        kept = remove_unused_columns(self, dataset)
        seen["ppo_dataset_columns"] = {"lf": list(dataset.column_names), "trl_kept": list(kept.column_names)}
        return kept

    trl_ppo.PPOTrainer._remove_unused_columns = observed_remove_unused_columns
    trl_ppo.np = _OrderedNumpy(numpy, [o for step in job["minibatch_orders"] for o in step])
    init = load_file(str(work / "init_adapter.safetensors"))
    value_head = load_file(str(work / "init_value_head.safetensors"))
    load_model = workflow.load_model

    def load_model_with_project_adapter(*args, **kwargs):
        model = load_model(*args, **kwargs)
        seen["value_head_in_features"] = model.v_head.summary.in_features
        _inject_adapter(model, init, value_head, renames=job.get("adapter_renames"))
        if job.get("value_head_dropout") == 0.0:  # the project records the value head without dropout
            model.v_head.dropout = torch.nn.Identity()
        return model

    workflow.load_model = load_model_with_project_adapter
    cls = ppo_trainer.CustomPPOTrainer
    if not hasattr(cls, "processing_class"):
        # transformers 5's Trainer._save (LF's save_model calls it) saves self.processing_class, which TRL 0.9.6's
        # PPOTrainer names self.tokenizer
        cls.processing_class = property(lambda self: self.tokenizer)
        seen.setdefault("shims", []).append("CustomPPOTrainer.processing_class")
    rollouts = [(torch.tensor(q), torch.tensor(r)) for step in job["rollouts"] for q, r in zip(*step)]
    mini = job["args"]["per_device_train_batch_size"]

    def injected_get_inputs(self, batch):
        taken = [rollouts.pop(0) for _ in range(mini)]
        return [q for q, _ in taken], [r for _, r in taken]

    cls.get_inputs = injected_get_inputs
    get_rewards = cls.get_rewards

    def observed_get_rewards(self, queries, responses):
        if job.get("amp") is False:  # LF autocasts get_rewards and batched_forward_pass; the project is fp32
            self.amp_context = contextlib.nullcontext()
        if not seen.get("aligned"):
            seen["aligned"] = True
            if job.get("clip_every_step"):
                # TRL 0.9.6 keeps model_params as a filter() iterator: the first clip_grad_norm_ exhausts it and
                # every later optimizer step goes unclipped; a list clips every step, as the project does
                self.model_params = [p for p in self.model.parameters() if p.requires_grad]
            if job.get("no_decay_is_zero"):
                # LF's PPO create_optimizer gives its no-decay group (biases: the value head's) no weight_decay
                # key, so torch's AdamW default 0.01 applies; the project decays none of them
                groups = getattr(self.optimizer, "optimizer", self.optimizer).param_groups
                groups[0]["weight_decay"] = self.args.weight_decay  # LF builds [no-decay, decay], in that order
            if job.get("sync_by_count"):
                # accelerate syncs every accumulate() while the dataloader is at its last batch, so LF's last PPO
                # step takes an optimizer step per mini-batch (each of loss / GA); the project accumulates GA
                # mini-batches in every step
                self.accelerator.gradient_state.plugin_kwargs["sync_with_dataloader"] = False
        rewards = get_rewards(self, queries, responses)
        seen.setdefault("scores", []).extend(float(x) for x in rewards.view(-1))
        return rewards

    cls.get_rewards = observed_get_rewards
    step = cls.step

    def observed_step(self, *args, **kwargs):
        if "ppo_config" not in seen:
            seen["ppo_config"] = {k: getattr(self.config, k) for k in job["ppo_config_keys"]}
        stats = step(self, *args, **kwargs)
        seen.setdefault("step_stats", []).append(
            {k: float(numpy.asarray(v)) for k, v in stats.items() if numpy.asarray(v).size == 1})
        return stats

    cls.step = observed_step
    # run_exp imports every stage's workflow, KTO's among them, which needs TRL >= 0.18: the PPO workflow is called
    # as run_exp's _training_function calls it, with the arguments parsed by LF's own get_train_args
    args = {k: v for k, v in job["args"].items() if k != "eval_dataset"}  # LF's PPO refuses an eval set
    workflow.run_ppo(*get_train_args(args), callbacks=[])
    if rollouts or trl_ppo.np._orders:
        raise RuntimeError(f"LF's loop left {len(rollouts)} injected rollouts and {len(trl_ppo.np._orders)} "
                           f"mini-batch orders unused")
    vhead = Path(job["args"]["output_dir"]) / "value_head.safetensors"
    seen["value_head"] = {k: v.tolist() for k, v in load_file(str(vhead)).items()} if vhead.exists() else None


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DISABLE_VERSION_CHECK", "0")
    main(Path(sys.argv[1]))
