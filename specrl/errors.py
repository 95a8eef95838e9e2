"""The exception types specrl raises: bad user input, and a training step that became NaN/inf.

`SpecRLError` subclasses ValueError so callers that catch ValueError keep working; its message always says
what was wrong and what would be right. `NonFiniteError` (the policy) and `DrafterNonFiniteError` (the online
drafter) name what became NaN/inf in a step; they live here, at the bottom of the layers, because the policy's
learner (`specrl.trainer`) and the drafter's trainer (`specrl.drafters.training`) both raise them.
"""


class SpecRLError(ValueError):
    """Bad input: the message names what was wrong and what would be right."""


class NonFiniteError(SpecRLError):
    """Loss, logits or gradients became NaN/inf; the step's update was not applied."""

    component = "policy"


class DrafterNonFiniteError(NonFiniteError):
    """The online drafter's loss, gradients or weights became NaN/inf (the policy is not the cause)."""

    component = "drafter"
