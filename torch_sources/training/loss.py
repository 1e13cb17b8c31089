"""Causal-LM loss of HF transformers (`loss/loss_utils.py: ForCausalLMLoss`), as LLaMA-Factory SFT uses it.

Logits in fp32; labels shift left (position t predicts label t+1; the last position gets
-100); cross-entropy with ignore_index -100, summed and divided by `num_items_in_batch`: the
labelled positions of the whole gradient-accumulation step (eval: of the batch), counted as the
transformers LLaMA-Factory 0.9.5 runs on (<= 5.6.0) counts them in `Trainer._get_num_items_in_batch`:
`labels.ne(-100).sum()` over every position, the first one included. Only a labelled first
position tells the two counts apart, i.e. `train_on_prompt` (issue 31; transformers 5.2x counts
the shifted labels instead). Without it, the token mean of the shifted labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "count_label_tokens"]

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """logits f32[B,T,V], labels i64[B,T] -> scalar."""
    logits = logits.float()
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # i64[B,T]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def count_label_tokens(labels) -> int:
    """Labelled positions, before the shift: transformers 5.6's `_get_num_items_in_batch`, LF 0.9.5's."""
    return int((torch.as_tensor(labels) != IGNORE_INDEX).sum())
