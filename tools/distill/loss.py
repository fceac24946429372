"""The distillation loss, shared by both drafter kinds: KL(target || drafter) on the target's
next-token distribution plus cross-entropy on the target's own tokens, over whichever vocabulary
the logits cover (all V tokens, or a sub-vocabulary V' with the ids mapped to its rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distill_loss(
    student_logits: torch.Tensor,  # [N, V] drafter logits at N supervised positions
    teacher_logits: torch.Tensor,  # [N, V] target logits at the same positions
    target_ids: torch.Tensor,  # [N] the target's tokens there (greedy or sampled by the target)
    ce_weight: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss, kl, ce), each a scalar mean over the N positions."""
    s_logp = F.log_softmax(student_logits.float(), dim=-1)  # [N, V]
    t_logp = F.log_softmax(teacher_logits.float(), dim=-1)  # [N, V]
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
    ce = F.nll_loss(s_logp, target_ids)
    return kl + ce_weight * ce, kl.detach(), ce.detach()
