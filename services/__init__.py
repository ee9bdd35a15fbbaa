"""The four tinsmith services: gateway, trainer, sampler and checkpoint. None imports another.

One setting for every service process, made here because it must precede torch's import:
OpenMP threads that wait for work sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, unless
the environment says otherwise). The trainer and the sampler compute at the same time on one
machine, beside the client's own work; spinning threads then steal each other's cores. Measured
on 2 cores with tinsmith/small and 2 torch threads while one other process was busy: a training
step took 875 ms (median; 5.4 s at worst) with spinning threads and 411 ms with sleeping ones.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
