"""The BatchProfile API: the resource's models, the generated CRD, its reference, RBAC and manifests."""
