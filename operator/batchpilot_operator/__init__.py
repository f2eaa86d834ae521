"""batchpilot operator: keeps every model's batching window tuned to its live load.

Importing this package never imports torch.
"""

__version__ = "0.1.0"

GROUP = "batchpilot.dev"
VERSION = "v1alpha1"
KIND = "BatchProfile"
PLURAL = "batchprofiles"
SINGULAR = "batchprofile"
SHORT_NAMES = ("bp",)
API_VERSION = f"{GROUP}/{VERSION}"
