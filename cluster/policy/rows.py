"""The policy's reading of each tuning cell as one row, for `specserve tuning` and GetTuning."""

from __future__ import annotations

from cluster.policy.cells import BUCKET_NAMES, TuningView
from cluster.policy.cost import cost_per_k
from cluster.policy.model import alpha_posterior, prior_alpha
from cluster.policy.params import DEFAULT_PARAMS, PolicyParams
from cluster.speculation import SpecMode


def tuning_rows(view: TuningView, params: PolicyParams = DEFAULT_PARAMS) -> list[dict]:
    """One row per cell with data, for `specserve tuning` and GetTuning. The keys model, mode,
    workload_class, load_bucket, acceptance_length, acceptance_per_position, tokens_per_s,
    samples and mean_k match `TuningEntry` and are never None; the rest are extras."""
    order = {b: i for i, b in enumerate(BUCKET_NAMES)}
    rows = []
    for (mode, c, bucket), cell in sorted(view.cells.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99))):
        a, b = alpha_posterior(cell, prior_alpha(mode, c), params)
        rows.append({
            "model": view.model, "mode": mode, "workload_class": c, "load_bucket": bucket,
            "acceptance_length": round(cell.acceptance_length, 4),
            "acceptance_per_position": [round(p, 4) for p in cell.per_position_acceptance if p is not None],
            "tokens_per_s": round(cell.tokens_per_s or 0.0, 3), "samples": cell.requests,
            "steps": cell.steps, "mean_k": round(cell.mean_k, 3),
            "alpha_measured": None if cell.alpha is None else round(cell.alpha, 4),
            "alpha_posterior": round(a / (a + b), 4) if mode != SpecMode.NONE.value else None,
            "draft_rate": None if cell.draft_rate is None or mode == SpecMode.NONE.value else round(cell.draft_rate, 4),
            "step_ms": None if cell.step_s is None else round(cell.step_s * 1e3, 3),
            "step_ms_at_k": {k: round(cell.step_s_at(k) * 1e3, 2) for k in range(len(cell.steps_at_k))
                             if cell.step_s_at(k) is not None},
            "cost_per_k": round(cost_per_k(view, mode, bucket, params), 4),
            "runs": sum(cell.runs),
            "mean_run": round(sum(i * g for i, g in enumerate(cell.runs)) / sum(cell.runs), 3) if cell.runs else None,
        })
    return rows
