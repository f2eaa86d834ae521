"""The control loop: the controller's tick over profiles and pods, and the status it writes.

``controller`` is the loop and the wiring; ``collect`` gathers the tick's metrics in one call; ``plan``
decides one profile's tick as a pure function (the decision, the window in force, the canary to start) and is
the only place that numbers windows; ``sync_paths`` brings the pods to the window by each mode's and engine's
path (``syncer`` pushes windows and records the results, ``sglang_sync`` sets SGLang's live settings,
``restart`` rewrites a workload's args); ``canary`` runs the canary loop; ``registry`` holds profiles, pods
and their indexes; ``conditions`` and ``facts`` derive the status as pure functions; ``status`` builds it and
its merge patch; ``events`` posts Events under a per-tick guard; ``export`` sets the per-profile metrics;
``settings`` holds the loop's settings and their defaults, written once.
"""
