"""Every config.json key of a family, accounted for: honored, ignored (with why it cannot change this
source's numbers) or refused (with the one value accepted); the torch-free twin of torch_sources/models/config_keys.py.

A family file declares its `CONFIG_KEYS = KeyAudit(...)` and its config's `from_hf` calls
`CONFIG_KEYS.check(d)` first: a key in none of the lists, or a refused key at another value, stops
loading with a message that names the key. tests/models/test_config_keys.py holds each list to transformers'
config class of the family (every key it saves, plus the release-only keys), so a key transformers adds
is a failing test, not a silent drop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ConfigError", "KeyAudit", "Accept", "ALL_FULL", "BOOKKEEPING", "DROPOUT", "ROPE_KEYS"]


class ConfigError(ValueError):
    """A config.json this source will not load: the message names the key."""


# PreTrainedConfig's own keys and what release files add around them: none enters a forward.
BOOKKEEPING: dict[str, str] = {
    "_name_or_path": "where the config was loaded from",
    "architectures": "names the transformers class; the task picks the head",
    "model_type": "picks the family (jax_oracles/models/auto.py)",
    "transformers_version": "the writer's version",
    "dtype": "the stored dtype; the sources compute in fp32",
    "torch_dtype": "the stored dtype (transformers < 5 name); the sources compute in fp32",
    "use_cache": "whether generate keeps a KV cache: the same numbers either way",
    "initializer_range": "random init only; every weight comes from the checkpoint",
    "id2label": "classification heads only", "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "return_dict": "the output container", "output_attentions": "extra outputs",
    "output_hidden_states": "extra outputs", "chunk_size_feed_forward": "chunking that does not change values",
    "is_encoder_decoder": "false for every decoder family here",
    "bos_token_id": "a token id for tokenizers and generate; the forward does not read it",
    "pad_token_id": "a token id for collators; the forward reads the attention mask",
    "eos_token_id": "a stop id for generate; the tasks take theirs from the tokenizer",
}
# Dropout rates: the benchmark trains and records with every model dropout at 0 (deterministic references;
# shared notes, training-facts "zero or record the dropouts"), and in eval mode they are identities.
DROPOUT = "dropout: every task runs the model with dropout 0 (deterministic references), eval mode is the identity"
# The keys a RoPE family's config may carry for it; rope.read_rope resolves and checks their contents.
ROPE_KEYS = frozenset({"rope_theta", "rope_scaling", "rope_parameters"})


@dataclass(frozen=True)
class Accept:
    """An accepted value given by a rule rather than listed (shown in the refusal by its description)."""
    description: str
    test: object  # (value) -> bool

    def __repr__(self) -> str:
        return self.description


ALL_FULL = Accept("a list of 'full_attention' only", lambda v: isinstance(v, (list, tuple)) and
                  all(t == "full_attention" for t in v))


@dataclass(frozen=True)
class KeyAudit:
    family: str
    honored: frozenset[str]
    ignored: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, tuple[tuple, str]] = field(default_factory=dict)  # key: ((accepted values), why)

    def __post_init__(self):
        groups = [set(self.honored), set(self.ignored), set(self.refused), set(BOOKKEEPING)]
        seen: set[str] = set()
        for g in groups:
            if seen & g:
                raise AssertionError(f"{self.family}: key(s) {sorted(seen & g)} listed twice")
            seen |= g

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.honored) | set(self.ignored) | set(self.refused) | set(BOOKKEEPING)

    def check(self, d: Mapping) -> None:
        """Refuse, naming the key, an unknown key or a refused key at a value other than the accepted ones."""
        unknown = sorted(set(d) - self.keys)
        if unknown:
            raise ConfigError(f"{self.family} config: unknown key(s) {unknown}; refusing to guess what they mean")
        for key, (accepted, why) in self.refused.items():
            if key in d and not any(_same(d[key], a) for a in accepted):
                raise ConfigError(f"{self.family} config not supported by this source: {key}={d[key]!r} "
                                  f"(accepted: {', '.join(map(repr, accepted))}; {why})")


def _same(value, accepted) -> bool:
    if isinstance(accepted, Accept):
        return bool(accepted.test(value))
    if isinstance(value, bool) != isinstance(accepted, bool):  # False is not 0 here
        return False
    return value == accepted
