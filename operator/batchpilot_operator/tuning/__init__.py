"""Tuning: observations, the pure policy (its moves, step limits and reasons), its memory across restarts,
and batch-friendliness. No I/O."""
