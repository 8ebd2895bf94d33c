"""What a front door plugs into the shared step lifecycle: the hooks (``base``), ``Pipe``'s
in-process worker threads (``in_process``) and ``DistributedPipe``'s per-rank driver
(``per_rank``)."""
