"""Evaluation, beside `data/`, `train/` and `convert/`: multiple-choice tasks (`tasks`, scored by `task_scoring`),
held-out text (`held_out`), a whole saved model on both (`model`), weight-only quantization (`quantization`) and the
`scalevec-eval` command (`cli`). Nothing here imports `scalevec.train`: the Trainer, the study and the command use
it. Its modules load on first use, as each needs torch and some need more."""
