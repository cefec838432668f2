"""Evaluation: held-out bits per character against a random twin and compressors (heldout),
zero-shot tasks (tasks: the files; scoring: log-likelihoods and accuracy), the item-by-item
cross-check with lm-evaluation-harness, and the model card."""
