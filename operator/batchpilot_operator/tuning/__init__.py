"""Tuning: observations, the pure policy, its memory across restarts, and batch-friendliness. No I/O."""
