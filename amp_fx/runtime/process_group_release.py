"""Let ``destroy_process_group()`` free the default process group: import ``torch.distributed.nn`` early.

``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as the default
argument of ten collectives when it is first imported. Imported *after*
``init_process_group`` -- ``torch._dynamo`` imports it, and
``DistributedDataParallel.__init__`` imports ``torch._dynamo`` -- those
defaults hold the live default process group, so ``destroy_process_group()``
cannot free it: the group's gloo worker threads, its transport loop and (on
rank 0) the TCPStore server thread outlive it and are only torn down while the
interpreter exits. There they race the exit, and a rank sometimes dies with
SIGABRT ("terminate called without an active exception"): 1 in 40 two-rank
DDP runs here (torch 2.13 CPU, gloo).

Imported before any process group exists, the defaults are ``None`` (the
default group at call time), which is also what they mean. The runtime
imports this module, so a script that imports ``amp_fx.runtime`` (or one of
its names) before ``init_process_group`` is covered; a script that creates
its process group first should ``import torch.distributed.nn`` before that
(imported later, here, it would bind the live group, so it is not).
"""

from __future__ import annotations

import torch.distributed as dist

__all__: list[str] = []

# Once a default group exists, importing it here would bind that group: leave it to the program then.
if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn  # noqa: F401  (the import is the point: see the module doc)
