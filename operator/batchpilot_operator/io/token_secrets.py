"""Which Secrets a profile may have sent as an admin token: only those that opt in (no I/O here)."""

from __future__ import annotations

ADMIN_TOKEN_LABEL = "batchpilot.dev/admin-token"


class SecretNotOptedIn(Exception):
    """A Secret a profile names that does not carry ``batchpilot.dev/admin-token: "true"``: nothing of it is
    sent (as Argo CD takes only the Secrets labelled for it), so a BatchProfile writer cannot have any
    Secret of the namespace sent to a pod of their choice."""

    def __init__(self, namespace: str, name: str) -> None:
        super().__init__(
            f'lacks the label {ADMIN_TOKEN_LABEL}: "true" (a Secret is sent as an admin token only if it opts in)'
        )
        self.namespace, self.name = namespace, name
