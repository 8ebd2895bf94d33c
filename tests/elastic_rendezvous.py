"""One attempt's rendezvous, as ``tests/runtime/test_elastic.py`` runs it under the agent's store: build
the default process group with fastpipe's ``init_process_group``, all-reduce the ranks' numbers
over gloo, print ``RESULT <sum>``, and with the argument ``exit`` end as the ranks of a failed
attempt do (no clean shutdown)."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from fastpipe.distributed import init_process_group


def main() -> None:
    timeout = datetime.timedelta(seconds=20)
    init_process_group("gloo", timeout=timeout)
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"RESULT {value.item():g}", flush=True)
    if "exit" in sys.argv[1:]:  # as a rank of a failed attempt ends: no clean shutdown
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
