"""The four tinsmith services: gateway, trainer, sampler and checkpoint. None imports another."""
