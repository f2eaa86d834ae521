"""The control loop: the controller's tick over profiles and pods, and the status it writes.

``controller`` is the loop (and the only place that numbers windows); ``registry`` holds profiles, pods and
their indexes; ``syncer`` pushes windows and records the results; ``conditions`` and ``facts`` derive the
status as pure functions; ``status`` builds it and its merge patch; ``events`` posts Events under a
per-tick guard; ``export`` sets the per-profile metrics.
"""
