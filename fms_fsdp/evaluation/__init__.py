"""Evaluation: held-out loss on --eval_data_path (evaluation/evaluate.py) and lm-eval-harness tasks (evaluation/harness.py)."""
