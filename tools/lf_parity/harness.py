"""One task through LLaMA-Factory and through the torch source, side by side (runs in .venv).

The job LF runs is written from the task's own Hydra config (catalog.tasks.compose_task): the method's train
args become LF's YAML keys, the family's template LF's `template`, the task's data LF's `dataset_info.json`.
The torch source runs the same task from the same config (its method's entry point, as the recorder does), so
every quantity is compared with what the references were recorded from (`python -m recorder stale=true` ties
the references to that source). The child (lf_child.py) runs under .venv-lf.

A task whose data rows carry `images` (the vision-language families) also gives LF the `images` column, the
data dir as LF's `media_dir`, the release's preprocessor_config.json in LF's model dir (the shipped checkpoints
have none; Qwen2.5-Omni also the release's tokenizer token names and an empty spk_dict.pt, Qwen3-VL the release's
video settings for the child's video-processor stand-in) and the module renames between transformers 5's tree and
the release's (adapter names); LF's collated batches are recorded and compared with the torch source's collator on
the same rows (parity.py).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from catalog.provenance import ROOT
from catalog.tasks import compose_task, task_method
from torch_sources.training import dpo, lora, ppo, sft

LF_PYTHON = ROOT / ".venv-lf" / "bin" / "python"
# LF 0.9.5's PPO trainer needs TRL 0.8.6-0.9.6 (it checks), its package metadata pins trl 0.24.0: make lf-env puts
# trl 0.9.6 in an overlay that only the PPO child sees, first on its PYTHONPATH
TRL_OVERLAY = ROOT / ".venv-lf" / "overlays" / "trl-0.9.6"
# The project's Pillow (13.0.0) for the runs with images: LF's lock holds 11.3.0, whose two-pass downscale runs the
# passes in another order on tall images (a grey level apart); the "pillow" effect run leaves it out
PILLOW_OVERLAY = ROOT / ".venv-lf" / "overlays" / "pillow-13.0.0"
CHILD = Path(__file__).with_name("lf_child.py")

# LF stage, its get_dataset stage, its workflow module and trainer class, the dataset_info columns of the task's data
METHODS = {
    "sft": ("sft", "sft", ("llamafactory.train.sft.workflow", "llamafactory.train.sft.trainer:CustomSeq2SeqTrainer"),
            {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
             "history": "history"}),
    "dpo": ("dpo", "rm", ("llamafactory.train.dpo.workflow", "llamafactory.train.dpo.trainer:CustomDPOTrainer"),
            {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
             "system": "system"}),
    "ppo": ("ppo", "ppo", ("llamafactory.train.ppo.workflow", "llamafactory.train.ppo.trainer:CustomPPOTrainer"),
            {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
             "history": "history"}),
}
# the tokenization variants compared row by row (LF's data arguments); training runs the task's own
TOKEN_VARIANTS = {
    "sft": {"default": {}, "train_on_prompt": {"train_on_prompt": True}, "mask_history": {"mask_history": True},
            "cutoff24": {"cutoff_len": 24}, "cutoff24.mask_history": {"cutoff_len": 24, "mask_history": True},
            "cutoff200": {"cutoff_len": 200}},
    "dpo": {"default": {}, "cutoff24": {"cutoff_len": 24}, "cutoff200": {"cutoff_len": 200}},
    "ppo": {"default": {}, "cutoff24": {"cutoff_len": 24}, "cutoff200": {"cutoff_len": 200}},
}
# The torch sources are HF's eager attention (their fidelity tests), so the compared runs ask LF for eager too;
# LF's default (sdpa) is run as a measured effect (parity.TRAIN_VARIANTS)
LF_EAGER = {"flash_attn": "disabled"}
LF_KEYS = ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "per_device_eval_batch_size",
           "gradient_accumulation_steps", "lr_scheduler_type", "warmup_ratio", "weight_decay", "adam_beta1",
           "adam_beta2", "adam_epsilon", "max_grad_norm", "cutoff_len", "template", "seed", "lora_rank",
           "lora_alpha", "lora_dropout", "train_on_prompt", "mask_history", "pref_beta", "pref_loss",
           "dpo_label_smoothing", "pref_ftx", "ppo_epochs", "ppo_buffer_size", "ppo_target", "ppo_whiten_rewards",
           "max_new_tokens", "temperature", "top_k", "top_p")
# TRL PPOConfig field -> the project's PPOArgs field (the values LF hands TRL, or TRL's defaults LF keeps)
# The release's preprocessor_config.json of a vision-language checkpoint, by model_type, verbatim (keys and values as
# the hub ships them; tests/models/test_vision_processing.py holds the image settings to the source's
# QwenImageProcessorConfig). LF's load_tokenizer builds its processor from it with AutoProcessor: transformers 5.6
# picks Qwen2VLImageProcessorPil where torchvision is absent (its torchvision backend otherwise; a legacy "...Fast"
# image_processor_type resolves the same way), which the source is bit-equal to; lf_child records the class it got.
# - qwen2_vl: Qwen2-VL-2B-Instruct's (min/max pixels 3136 / 12845056, patch 14, the CLIP mean and std);
# - qwen3_vl: Qwen3-VL-2B-Instruct's (the whole Qwen3-VL line ships the same file): `size` {shortest_edge 65536,
#   longest_edge 16777216}, patch 16, mean and std 0.5, Qwen2VLImageProcessorFast, Qwen3VLProcessor; its video
#   settings are a separate video_preprocessor_config.json, which no image task reads;
# - qwen2_5_omni: Qwen2.5-Omni-7B's, one file for both of its processors: Qwen2-VL's image settings and the
#   WhisperFeatureExtractor's (128 mel bins, 16 kHz, hop 160, n_fft 400, chunk_length 300 s: n_samples 4800000,
#   nb_max_frames 30000), processor Qwen2_5OmniProcessor.
RELEASE_PREPROCESSOR = {
    "qwen2_vl": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                 "processor_class": "Qwen2VLProcessor"},
    "qwen3_vl": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                 "image_processor_type": "Qwen2VLImageProcessorFast"},
    "qwen2_5_omni": {"chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor",
                     "feature_size": 128, "hop_length": 160, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_processor_type": "Qwen2VLImageProcessor",
                     "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": 12845056, "merge_size": 2,
                     "min_pixels": 3136, "n_fft": 400, "n_samples": 4800000, "nb_max_frames": 30000,
                     "padding_side": "right", "padding_value": 0.0, "patch_size": 14,
                     "processor_class": "Qwen2_5OmniProcessor", "return_attention_mask": True,
                     "sampling_rate": 16000, "temporal_patch_size": 2},
}
# The release's video_preprocessor_config.json where LF's plugin reads the video processor even for images:
# Qwen3VLPlugin.process_messages takes getattr(processor, "video_processor") with no default and its merge_size
# (video_merge_length) for every message, videos or not. transformers 5.6 builds every video processor on torchvision
# (absent here: lf_child.install_no_video_processor), so the child puts a stand-in carrying these settings, which
# refuses to process anything, on the processor class (Qwen3-VL-2B-Instruct's file, verbatim).
RELEASE_VIDEO_PREPROCESSOR = {
    "qwen3_vl": {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                 "video_processor_type": "Qwen3VLVideoProcessor"},
}
# The multimodal tokens the release's tokenizer_config.json names and transformers 5.6's processor reads off the
# tokenizer (Qwen2_5OmniProcessor.__init__: tokenizer.image_token, .audio_token, .video_token, .vision_bos_token,
# .vision_eos_token, .audio_bos_token, .audio_eos_token; AttributeError without them, and LF's load_tokenizer then
# goes on without a processor and refuses the images). The tiny tokenizer's config (assets/tokenizer/qwen2_omni)
# has the tokens (ids 403-413) but not these names: LF's model dir gets its tokenizer_config.json plus these keys.
# transformers 5 keeps them as named special tokens (_special_tokens_map): no id, no encoding and no extra special
# token changes (the template cell's generation eos ids read the extra ones). The spellings are LF's qwen2_omni
# template's and the source's (LF_TEMPLATE_TOKENS).
RELEASE_TOKENIZER_TOKENS = {
    "qwen2_5_omni": {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                     "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                     "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
}
# Release files besides the processor's that LF's loader requires: transformers' Qwen2_5OmniForConditionalGeneration
# .from_pretrained (LF loads Omni through AutoModelForTextToWaveform, then keeps model.thinker) raises ValueError
# without the release's spk_dict.pt (the talker's speaker embeddings, which the thinker never reads; the tiny
# checkpoint has no talker): an empty dict stands in (load_speakers only fills speaker_map from it).
RELEASE_SPEAKERS = {"qwen2_5_omni"}
# transformers 5 loads a Qwen-VL release into its own module tree: Qwen2-VL's decoder under model.language_model, its
# tower under model.visual, where the release (and the torch source's PEFT names) keep model.* and visual.*.
# Qwen3-VL's release already has transformers 5's tree (model.language_model.*, model.visual.*), and LF trains
# Omni's thinker (model.*, visual.*, audio_tower.*, as the source's thinker-relative names): nothing to rename.
ADAPTER_RENAMES = {
    "qwen2_vl": [["base_model.model.model.language_model.", "base_model.model.model."],
                 ["base_model.model.model.visual.", "base_model.model.visual."]],
    "qwen3_vl": [],
    "qwen2_5_omni": [],
}
PPO_CONFIG = {"learning_rate": "learning_rate", "mini_batch_size": "per_device_train_batch_size",
              "batch_size": "batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
              "ppo_epochs": "ppo_epochs", "max_grad_norm": "max_grad_norm", "target": "ppo_target",
              "whiten_rewards": "ppo_whiten_rewards", "init_kl_coef": "init_kl_coef", "adap_kl_ctrl": "adap_kl_ctrl",
              "gamma": "gamma", "lam": "lam", "cliprange": "cliprange", "cliprange_value": "cliprange_value",
              "vf_coef": "vf_coef", "seed": "seed"}


@dataclass(frozen=True)
class Job:
    task: str
    method: str
    args: object  # the method's args dataclass (TrainArgs, DPOArgs, PPOArgs)
    checkpoint: Path
    tokenizer: Path
    data: Path
    work: Path
    train: bool = True
    variants: dict = field(default_factory=dict)
    reward_model: Path | None = None  # PPO: LF's reward_model (full), for its argument checks
    lf_overrides: dict = field(default_factory=lambda: dict(LF_EAGER))  # LF-only arguments
    media_dir: Path | None = None  # rows with images: LF's media_dir (the args' media_dir, else the data dir)
    model_type: str | None = None  # the checkpoint's (config.json)
    pillow_overlay: bool = True  # with images: LF runs on the project's Pillow (PILLOW_OVERLAY), else its own

    @property
    def mm(self) -> bool:
        return self.media_dir is not None

    @property
    def tower(self) -> bool:
        """A fixed-size tower's family (issue 34): its processor files lie beside the tokenizer."""
        return self.mm and (self.tokenizer / "preprocessor_config.json").exists()


def data_has_images(data: Path) -> bool:
    """Whether any train or eval row of the task's data carries an `images` column."""
    return any("images" in row for split in ("train", "eval") if (data / f"{split}.json").exists()
               for row in json.loads((data / f"{split}.json").read_text()))


def make_job(task: str, work: Path, overrides: dict | None = None, train: bool = True,
             lf_overrides: dict | None = None) -> Job:
    cfg = compose_task(task)
    method = task_method(cfg)
    if method is None:
        raise ValueError(f"{task} is a serving task: LLaMA-Factory parity covers the training tasks")
    workflow = importlib.import_module(f"torch_sources.{cfg.method.workflow}")
    args = getattr(workflow, cfg.method.args)(**dict(cfg.method.train), template=cfg.family.template)
    args = replace(args, **(overrides or {}))
    data, checkpoint = ROOT / cfg.data.dir, ROOT / cfg.family.checkpoint
    media = None
    if data_has_images(data):  # as the source resolves it (sft.media_dir)
        media = Path(args.media_dir) if getattr(args, "media_dir", None) is not None else data
    return Job(task, method, args, checkpoint, ROOT / cfg.family.tokenizer, data,
               work, train, TOKEN_VARIANTS[method],
               ROOT / cfg.method.reward_model if "reward_model" in cfg.method else None,
               {**LF_EAGER, **(lf_overrides or {})}, media,
               json.loads((checkpoint / "config.json").read_text()).get("model_type"))


def model_dir(job: Job, checkpoint: Path | None = None, name: str = "model") -> Path:
    """LF reads the tokenizer from model_name_or_path (the reward model's too): the checkpoint's files and the
    tokenizer's, linked; a vision-language policy's also gets the release's preprocessor_config.json (LF's
    load_tokenizer builds the processor from it)."""
    out = job.work / name
    out.mkdir(parents=True, exist_ok=True)
    for src in [*(checkpoint or job.checkpoint).iterdir(), *job.tokenizer.iterdir()]:
        link = out / src.name
        if not link.exists():
            link.symlink_to(src.resolve())
    if job.tower and checkpoint is None:
        # the fixed-size towers (issue 34): the release's processor files already lie beside the tokenizer (linked
        # above); only the token names transformers' processor reads off the tokenizer are added (RELEASE_TOKEN_NAMES)
        from tools.lf_parity.plugins import with_release_token_names

        with_release_token_names(out, job.model_type)
    elif job.mm and checkpoint is None:
        if job.model_type not in RELEASE_PREPROCESSOR:
            raise NotImplementedError(f"no release preprocessor_config.json for {job.model_type!r} "
                                      f"(harness.RELEASE_PREPROCESSOR): LF could not build its processor")
        (out / "preprocessor_config.json").write_text(json.dumps(RELEASE_PREPROCESSOR[job.model_type], indent=2))
        if job.model_type in RELEASE_TOKENIZER_TOKENS:
            config = out / "tokenizer_config.json"
            tokenizer_config = json.loads(config.read_text())
            config.unlink()  # a link to the tiny tokenizer's file: written anew, that file untouched
            config.write_text(json.dumps({**tokenizer_config, **RELEASE_TOKENIZER_TOKENS[job.model_type]}, indent=2))
        if job.model_type in RELEASE_SPEAKERS and not (out / "spk_dict.pt").exists():
            import torch

            torch.save({}, out / "spk_dict.pt")
    return out


def lf_arguments(job: Job) -> dict:
    """The LLaMA-Factory YAML of the job (written to work/lf_args.yaml as well)."""
    stage, _, _, columns = METHODS[job.method]
    data_dir = job.work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    info = {}
    if job.mm:
        columns = {**columns, "images": "images"}
        # LF reads every mapped column of each row (a KeyError where the file has none: the VL data has no
        # history or system); the text data carries them all
        present = {key for split in ("train", "eval") for row in json.loads((job.data / f"{split}.json").read_text())
                   for key in row}
        columns = {k: v for k, v in columns.items() if v in present}
    for split in ("train", "eval"):
        entry = {"file_name": str((job.data / f"{split}.json").resolve()), "formatting": "alpaca",
                 "columns": columns}
        if job.method == "dpo":
            entry["ranking"] = True
        info[f"t2j_{split}"] = entry
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))
    values = asdict(job.args)
    args = {key: values[key] for key in LF_KEYS if key in values}
    args.update({
        "model_name_or_path": str(model_dir(job)), "stage": stage, "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "dataset": "t2j_train", "dataset_dir": str(data_dir),
        "overwrite_cache": True, "output_dir": str(job.work / "lf_out"), "overwrite_output_dir": True,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "bf16": False, "fp16": False,
        "plot_loss": False, "trust_remote_code": False,
    })
    args["eval_dataset"] = "t2j_eval"
    if job.mm:  # LF's default is the dataset_info dir (work/data); the rows' image names are the data dir's
        args["media_dir"] = str(job.media_dir)
    args.update(job.lf_overrides)
    if job.method == "ppo":
        args.update({"reward_model": str(model_dir(job, job.reward_model, "reward_model")),
                     "reward_model_type": "full"})
    else:
        args["do_eval"] = True
    (job.work / "lf_args.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in args.items()))
    return args


def project_order(job: Job, num_examples: int) -> list[list[int]]:
    """Each epoch's example order, as the torch source draws it (sft.step_example_indices)."""
    return [[int(i) for step in sft.step_example_indices(num_examples, job.args, epoch) for mb in step for i in mb]
            for epoch in range(job.args.num_train_epochs)]


def project_adapter(job: Job) -> dict[str, np.ndarray]:
    """The initial LoRA the torch source trains from (its seed's numpy draw, B = 0)."""
    model = sft.load_model(job.checkpoint, sft.lora_config(job.args), job.args.seed)
    return lora.lora_state_dict(model)


def project_rows(job: Job, split: str, overrides: dict) -> list[dict]:
    """The torch source's processed rows of one split under one variant."""
    args = replace(job.args, **overrides)
    if job.method == "sft":
        return sft.load_processed_dataset(job.tokenizer, job.data, split, args)
    if job.method == "dpo":
        return dpo.load_pairwise_dataset(job.tokenizer, job.data, split, args)
    return ppo.load_prompt_dataset(job.tokenizer, job.data, split, args)


def project_run(job: Job):
    """The method's own entry point, as the recorder's L5 run calls it."""
    cfg = compose_task(job.task)
    workflow = importlib.import_module(f"torch_sources.{cfg.method.workflow}")
    paths = [job.checkpoint, job.tokenizer, job.data] + ([job.reward_model] if job.reward_model else [])
    return getattr(workflow, cfg.method.entry)(*paths, job.args)


def project_batches(job: Job) -> list[dict]:
    """The torch source's collated training micro-batches in the project's order (LF's train sampler is
    injected with it): its method's collator over the processed train rows, with the model's rope_index (a
    vision-language collator's position ids) -- what LF's trainer is handed, batch for batch."""
    cfg = compose_task(job.task)
    workflow = importlib.import_module(f"torch_sources.{cfg.method.workflow}")
    rows = project_rows(job, "train", {})
    rope_index = getattr(sft.load_model(job.checkpoint), "rope_index", None)
    collate = workflow.make_collator(job.args, job.tokenizer, data_dir=job.data, rope_index=rope_index)
    B = job.args.per_device_train_batch_size
    return [{k: v.numpy() for k, v in collate([rows[i] for i in order[s:s + B]]).items()}
            for order in project_order(job, len(rows)) for s in range(0, len(order), B)]


def text_hidden_size(checkpoint: Path) -> int:
    """The decoder's width (the value head's input): config.json's hidden_size, else its text_config's (Qwen3-VL),
    else its thinker's text_config's (Qwen2.5-Omni), as LF's configure_visual_model reads text_config.hidden_size."""
    config = json.loads((checkpoint / "config.json").read_text())
    config = config.get("thinker_config", config)
    return config["hidden_size"] if "hidden_size" in config else config["text_config"]["hidden_size"]


def ppo_injections(job: Job, result) -> dict:
    """What LF's PPO run is handed from the project's own run (result: its PPOResult): each step's rollouts
    (queries = the step's prompts, responses = the cut responses the project sampled), each step's mini-batch
    orders (ppo.ppo_step's numpy draws), the value head's init and dropout."""
    args = job.args
    train = ppo.load_prompt_dataset(job.tokenizer, job.data, "train", args)
    steps = [idx for epoch in range(args.num_train_epochs) for idx in ppo.prompt_batch_indices(len(train), args, epoch)]
    rollouts = [[[list(train[i]["input_ids"]) for i in idx], [[int(t) for t in row if t >= 0] for row in responses]]
                for idx, responses in zip(steps, result.step_responses)]
    orders = []
    for step in range(len(steps)):
        rng = np.random.default_rng([args.seed, ppo._MINIBATCH, step])
        orders.append([rng.permutation(args.batch_size).tolist() for _ in range(args.ppo_epochs)])
    hidden = text_hidden_size(job.checkpoint)
    return {"rollouts": rollouts, "minibatch_orders": orders, "value_head_dropout": args.value_head_dropout,
            "ppo_config_keys": sorted(PPO_CONFIG), "value_head_init": ppo.init_value_head(hidden, args.seed)}


def run_lf(job: Job, timeout_s: float = 1800, extra: dict | None = None) -> dict:
    """LLaMA-Factory's workflow in .venv-lf; -> the child's observations (work/lf/result.json). extra: more of the
    child's job (PPO: ppo_injections, amp)."""
    if not LF_PYTHON.exists():
        raise FileNotFoundError(f"{LF_PYTHON} is missing: run `make lf-env` first")
    job.work.mkdir(parents=True, exist_ok=True)
    args = lf_arguments(job)
    extra = dict(extra or {})
    if job.train:
        save_file(project_adapter(job), str(job.work / "init_adapter.safetensors"))
    if "value_head_init" in extra:
        save_file(extra.pop("value_head_init"), str(job.work / "init_value_head.safetensors"))
    n_train = len(project_rows(job, "train", {}))
    spec = {"stage": job.method, "lf_stage": METHODS[job.method][1], "workflow": METHODS[job.method][2][0],
            "trainer": METHODS[job.method][2][1],
            "args": args, "train": job.train, "variants": job.variants,
            "orders": project_order(job, n_train) if job.train and job.method != "ppo" else None,
            "mm": job.mm, "tower": job.tower, "record_batches": job.mm and job.train and job.method != "ppo",
            "adapter_renames": ADAPTER_RENAMES.get(job.model_type, []),
            "video_processor_standin": RELEASE_VIDEO_PREPROCESSOR.get(job.model_type) if job.mm else None, **extra}
    (job.work / "job.json").write_text(json.dumps(spec, indent=1))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    overlays = []
    if job.mm and job.pillow_overlay:
        overlays.append(PILLOW_OVERLAY)
    if job.method == "ppo" and job.train:
        overlays.append(TRL_OVERLAY)
    for overlay in overlays:
        if not overlay.exists():
            raise FileNotFoundError(f"{overlay} is missing: run `make lf-env` (it installs the overlays)")
    if overlays:
        env["PYTHONPATH"] = os.pathsep.join(map(str, overlays))
    if job.method == "ppo" and job.train:
        # LF's check_dependencies wants trl>=0.18 and its PPO trainer trl<=0.9.6; the PPO trainer's error message
        # gives this very fix (its own require_version still runs, and passes on the overlay's 0.9.6)
        env["DISABLE_VERSION_CHECK"] = "1"
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(job.work / "hf_cache"),
                "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "PYTHONNOUSERSITE": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")})
    start = time.perf_counter()
    proc = subprocess.run([str(LF_PYTHON), str(CHILD), str(job.work)], cwd=job.work, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    (job.work / "lf_child.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"LLaMA-Factory's run of {job.task} failed (exit {proc.returncode}); the last lines of "
                           f"{job.work / 'lf_child.log'}:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
    result = json.loads((job.work / "lf" / "result.json").read_text())
    result["wall_s"] = time.perf_counter() - start
    adapter = job.work / "lf_out" / "adapter_model.safetensors"
    renames = ADAPTER_RENAMES.get(job.model_type, [])
    result["adapter"] = ({release_name(k, renames): v for k, v in load_file(str(adapter)).items()}
                         if adapter.exists() else None)
    batches = job.work / "lf" / "batches"
    result["batches"] = ([load_file(str(f)) for f in sorted(batches.glob("*.safetensors"))]
                         if result.get("batches") else None)
    return result


def release_name(name: str, renames) -> str:
    """lf_child.release_name (that file runs in .venv-lf and is not imported here)."""
    for lf_prefix, release_prefix in renames or ():
        if name.startswith(lf_prefix):
            return release_prefix + name[len(lf_prefix):]
    return name
