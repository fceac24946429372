"""Aligned drafters by self-distillation: the frozen target writes the training text, a drafter
learns the target's next-token distribution, and the result is an artefact vLLM loads.

Words (on top of `cluster.speculation`'s draft / accepted / bonus / acceptance length):

- **features** ``f_t``: the target's last hidden state at position t, after its final norm
  (what vLLM hands an EAGLE-1 head); the target's logits are ``L_t = lm_head(f_t)`` and predict
  token ``x_{t+1}``.
- **start** t: a verification round that has just produced token ``x_{t+1}`` (its bonus); the
  drafter then proposes ``d_1..d_K`` for positions t+2 .. t+K+1.
- **draft step** j (1..K): the j-th proposal of a round.
- **acceptance rate at position j** ``alpha_j``: the fraction of rounds whose first j drafts were
  all accepted (greedy rule: accept while ``d_j == argmax L_{t+j}``).
- **acceptance length** at K: mean over rounds of ``min(accepted, K) + 1``.

Modules: `data` (prompts, target continuations and features, cached), `eagle` (EAGLE-1 head),
`draft_model` (a small Llama sharing the target's embeddings), `loss`, `train` (the loop and
checkpoints), `evaluate` (offline greedy verification), `ship` (the repository copy of a trained
drafter and its re-assembly at model preparation), `cli` (`specserve distill`).
"""
