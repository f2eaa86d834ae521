"""The label selector of a BatchProfile's pods, and how it matches a pod's labels.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from batchpilot_operator.api.bounds import cel_rules
from batchpilot_runtime.contract.window import CamelModel


class LabelSelectorRequirement(CamelModel):
    key: str = Field(min_length=1, max_length=317, description="Label key the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the key's value is matched against values.",
    )
    values: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Values for In and NotIn; empty for Exists and DoesNotExist.",
    )


SELECTOR_MESSAGE = "selector must have matchLabels or matchExpressions (an empty selector matches every pod)"


class LabelSelector(CamelModel):
    """A Kubernetes label selector (matchLabels and matchExpressions are ANDed)."""

    model_config = cel_rules(
        (
            "(has(self.matchLabels) && size(self.matchLabels) > 0)"
            " || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
            SELECTOR_MESSAGE,
        )
    )

    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels a pod must carry with exactly these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=16, description="Set-based requirements on pod labels."
    )

    @model_validator(mode="after")
    def _not_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(SELECTOR_MESSAGE)
        return self

    def matches(self, labels: dict[str, str]) -> bool:
        """True when a pod with these labels is selected."""
        for key, value in self.match_labels.items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "In" and (not present or labels[req.key] not in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True
