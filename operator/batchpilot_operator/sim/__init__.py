"""The simulator: the runtime's scheduler on a virtual clock with a step-cost model, its controllers, metrics, bounds and the dual-SLO capacity search. Pure."""
