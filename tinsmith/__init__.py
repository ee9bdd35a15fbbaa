"""tinsmith: a self-hosted post-training service that speaks the Tinker API.

This package is the shared library of the four services. It owns the wire (protobuf, subjects,
the bus wrapper), the event model and its pure folds, object storage, the model registry and the
error tree. It never imports a service, and never imports torch, peft or vllm.
"""

__version__ = "0.1.0"
