"""The four tinsmith services: gateway, trainer, sampler and checkpoint. None imports another.

One setting for every service process, made here because it must precede torch's import:
OpenMP threads that wait for work sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, unless
the environment says otherwise). The trainer and the sampler compute at the same time on one
machine, beside the client's own work; spinning threads then steal each other's cores.
``bench/cpu_contention.py`` on 2 cores, tinsmith/small, 2 torch threads, one other busy process:
a training step took 711 ms (median; 2.8 s at worst) with spinning threads and 410 ms (439 at
worst) with sleeping ones. The price, on a machine with nothing else to do: 268 ms against 204.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
