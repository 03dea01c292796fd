"""The default recipe's numerics against their recorded curves (tests/golden.py): a change of the
initialisation, the schedule, the loss or an optimizer fails here until the curves are recorded again
on purpose (`python tests/golden.py`, whose diff shows the change)."""

import numpy as np
import pytest
from golden import ATOL, RECIPES, RTOL, golden, losses, steps

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


# AdamW's curve in the default tier; Muon's and z-loss's in the slow tier (CI runs both)
@pytest.mark.parametrize("recipe", [r if r == "adamw" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_the_recipe_follows_its_golden_curve(recipe):
    found, expected = np.array(losses(recipe)), np.array(golden(recipe))
    assert len(found) == len(expected) == steps(recipe)
    worst = int(np.argmax(np.abs(found - expected) - RTOL * np.abs(expected)))
    assert np.allclose(found, expected, rtol=RTOL, atol=ATOL), (
        f"step {worst + 1}: {found[worst]!r} against the recorded {expected[worst]!r}; an intended change of "
        "the numerics: python tests/golden.py"
    )


@pytest.mark.pinned_torch  # checks the golden check itself
@pytest.mark.slow
def test_a_small_change_of_the_recipe_falls_outside_the_tolerance():
    """The check can fail: a run 1% off the recipe's learning rate leaves the recorded AdamW curve by more
    than its tolerance (a change of the weight decay by 10% or of the warm-up by a step did too, when
    tried), and a run with Muon's weight decay 10% off leaves Muon's."""
    for recipe, change in (("adamw", "--learning_rate=3.03e-3"), ("muon", "--weight_decay=0.11")):
        found, expected = np.array(losses(recipe, changes=(change,))), np.array(golden(recipe))
        assert len(found) == len(expected) == steps(recipe)
        assert not np.allclose(found, expected, rtol=RTOL, atol=ATOL), (recipe, change)
