"""The outcome of one push to a runtime's admin API, as the controller records it (no I/O here)."""

OK = "ok"
CONFLICT = "conflict"  # the pod holds a newer generation
REFUSED = "refused"  # the pod refused the window (HTTP 422): not retried until the window changes
UNAUTHORIZED = "unauthorized"  # no token may go to the pod, or the pod rejected the one sent
ERROR = "error"  # anything else: unreachable, 5xx, garbage, too slow, too long

__all__ = ["CONFLICT", "ERROR", "OK", "REFUSED", "UNAUTHORIZED"]
