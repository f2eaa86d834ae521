"""batchpilot runtime: the continuous-batching worker that serves one model.

This package's top level imports neither torch nor a web framework, so that the
operator can import the wire contract (``window``, ``metric_names``,
``admin_api``) without them.
"""

__version__ = "0.1.0"
