"""The ways the controller runs: under kopf in a cluster, or locally against runtimes you start."""
