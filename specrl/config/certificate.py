"""The end-of-run losslessness certificate's settings: the `run.certificate` config section (`CertificateConfig`).

The certificate (`specrl.run.certificate`) is sized from a target bias (`target_w`, Cohen's w detected with power
0.99; the tokens it needs grow as 1 / w^2) and capped by a budget (`budget_seconds`): by default (`auto`) a token
budget of AUTO_MULTIPLE times the tokens the run itself generated (so it stays proportionate to the run and, for a
seeded run, does not depend on timing), or a number of seconds converted at the run's own generation tokens per
second. A budget too small for the target is spent, and the bias the certificate can detect in it is what it states.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

AUTO_MULTIPLE = 3  # budget_seconds: auto = a budget of this many times the tokens the run generated


class CertificateConfig(BaseModel):
    """How large the run's certificate is (`run.certificate`); `run.certify` turns it on or off."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    target_w: float = Field(0.10, gt=0.0, le=1.0)
    """The bias (Cohen's w on the probe's 10 PIT bins) the pooled test is sized to detect with power 0.99."""
    budget_seconds: float | Literal["auto"] | None = "auto"
    """The certificate's budget: auto = AUTO_MULTIPLE x the tokens the run generated (proportionate to the run and
    independent of timing); a number = seconds, converted to tokens at the run's generation tokens/s; null = no
    budget (sized to target_w alone). Where the budget cannot reach target_w the certificate states the bias it can
    detect instead."""

    @field_validator("budget_seconds", mode="before")
    @classmethod
    def _budget(cls, v):
        if v is None or v == "auto" or (isinstance(v, int | float) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError(f"must be a number of seconds > 0, 'auto' ({AUTO_MULTIPLE}x the tokens the run "
                         f"generated) or null (no budget), got {v!r}")
