"""``batchpilot-gate``: an OpenAI-compatible reverse proxy, run as a sidecar, that enforces the
batching window in front of any engine (vLLM, SGLang, TGI, llama.cpp, or batchpilot's runtime).

With the engine's own cap set to the window's upper bound, the gate makes cap, target, wait, tail
marks and lanes live: it admits requests to the upstream under the runtime's very rules
(``admission``, built on ``scheduling.lanes``), answers the same admin API (``server.admin``) and
exports the same ``batchpilot_*`` metrics (``server.metrics``), with TTFT and inter-token gaps
measured at the proxy, so the operator tunes it exactly like a runtime.

Modules: ``admission`` (pure, clock-injected), ``service`` (``Gate``: admission on the event loop,
the window in force, metrics), ``proxy`` (the serving port's ASGI app), ``cli`` (the command).
Nothing here imports torch or the model (a test checks it).
"""
