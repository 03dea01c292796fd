"""How well the model does while it trains and afterwards: held-out loss and lm-eval-harness tasks."""
