"""How the operator reaches a BatchProfile's runtime pods: their ports and the admin token's Secret.

Part of the BatchProfile models (``batchpilot_operator.api.profile`` re-exports them).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from batchpilot_runtime.contract.admin_api import DEFAULT_ADMIN_PORT, DEFAULT_SERVE_PORT
from batchpilot_runtime.contract.window import CamelModel

# A Secret's name is a DNS subdomain and its keys are [-._a-zA-Z0-9]+, as the API server requires; the name
# pattern also keeps a name from being a path ("../other-namespace/secrets/x") when it goes into a URL.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


class SecretKeyRef(CamelModel):
    """A key of a Secret in the profile's own namespace: there is no field for another namespace, and a
    ``namespace`` given anyway is refused here (the API server refuses or prunes it: it is not in the schema)."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=SECRET_NAME_PATTERN,
        description="Secret name, in the profile's namespace (a Secret of another namespace cannot be named).",
    )
    key: str = Field(
        default="token", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN, description="Key within the Secret."
    )

    @model_validator(mode="before")
    @classmethod
    def _own_namespace_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and "namespace" in data:
            # An error at the field itself (spec.runtime.adminTokenSecret.namespace), as the API server names it.
            problem = PydanticCustomError(
                "value_error",
                "{namespace} is not allowed: a profile may name only a Secret of its own namespace; leave "
                "namespace out",
                {"namespace": repr(data["namespace"])},
            )
            raise ValidationError.from_exception_data(
                cls.__name__, [InitErrorDetails(type=problem, loc=("namespace",), input=data["namespace"])]
            )
        return data


class RuntimeEndpoint(CamelModel):
    """How the operator reaches the runtime pods' admin API."""

    admin_port: int = Field(default=DEFAULT_ADMIN_PORT, ge=1, le=65535, description="Port of the runtime's admin API.")
    serve_port: int = Field(
        default=DEFAULT_SERVE_PORT, ge=1, le=65535, description="Port of the runtime's serving API and /metrics."
    )
    admin_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret with the admin bearer token; the operator's own token is used when unset.",
    )
