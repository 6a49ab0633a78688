"""A rank whose training loop fails while its round waits on a hung peer (tests/test_round_safety.py).

    python tests/scripts/stuck_round.py RANK STORE_FILE TIMEOUT_S

Rank 1 stops itself (SIGSTOP) once the engine is built; rank 0 launches a round, which waits for rank 1, then
raises in its training loop. The process of rank 0 must exit at once, not when the round's collective times out.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from hf_acco import ACCOOptimizer
from hf_acco.comm.communicator import Communicator


def main() -> None:
    rank, store, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model = torch.nn.Linear(8, 8)
    comm = Communicator(timeout=datetime.timedelta(seconds=timeout_s))
    opt = ACCOOptimizer(model.parameters(), lr=1e-3, micro_batches=2, communicator=comm)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, silent
    model(torch.ones(2, 8)).sum().backward()
    opt.after_backward()  # the end of half A: the estimate round starts and waits for rank 1
    time.sleep(0.5)
    print(f"raising at {time.time():.3f}", flush=True)
    raise RuntimeError("the training loop failed")


if __name__ == "__main__":
    main()
