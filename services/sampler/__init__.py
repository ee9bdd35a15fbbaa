"""The sampler: serves sampling and prompt logprobs for a base model with any run's adapter,
loaded from the object store by key. Replicas share one work queue."""
