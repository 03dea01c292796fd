"""The default recipe's numerics against their recorded curves (tests/golden.py): a change of the
initialisation, the schedule, the loss or an optimizer fails here until the curves are recorded again
on purpose (`python tests/golden.py`, whose diff shows the change)."""

import numpy as np
import pytest
from golden import RECIPES, RTOL, STEPS, golden, losses

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


# AdamW's curve in the default tier; Muon's and z-loss's in the slow tier (CI runs both)
@pytest.mark.parametrize("recipe", [r if r == "adamw" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_the_recipe_follows_its_golden_curve(recipe):
    found, expected = np.array(losses(recipe)), np.array(golden(recipe))
    assert len(found) == len(expected) == STEPS
    worst = int(np.argmax(np.abs(found - expected) / np.abs(expected)))
    assert np.allclose(found, expected, rtol=RTOL, atol=0), (
        f"step {worst + 1}: {found[worst]!r} against the recorded {expected[worst]!r}; an intended change of "
        "the numerics: python tests/golden.py"
    )


@pytest.mark.slow
def test_a_small_change_of_the_recipe_falls_outside_the_tolerance():
    """The check can fail: a run 1% off the recipe's learning rate leaves the recorded AdamW curve by more
    than RTOL (a change of the weight decay by 10% or of the warm-up by a step did too, when tried)."""
    found = np.array(losses("adamw", changes=("--learning_rate=3.03e-3",)))
    expected = np.array(golden("adamw"))
    assert len(found) == len(expected) == STEPS
    assert not np.allclose(found, expected, rtol=RTOL, atol=0)
