"""The wire contract between operator and runtime: the window, the admin API's messages and the metric names. Imports neither torch nor a web framework."""
