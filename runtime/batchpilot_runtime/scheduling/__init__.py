"""Scheduling: the pure, clock-injected continuous-batching scheduler and its KV-block bookkeeping."""
