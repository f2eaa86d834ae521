"""Tuning: observations and their one builder from the metric sources' figures (model_metrics), the pure
policy (its moves, step limits and reasons), its memory across restarts, and batch-friendliness. No I/O."""
