"""Stage processes: one process per stage, joined by torch.distributed point-to-point.

Rank 0 is the scheduler's process (the engine); stage i is rank i + 1. The engine sends
every window's header to every stage; hidden states go from stage to stage (NCCL between
distinct GPUs, else gloo through host memory); the last stage verifies, drafts with the
MTP layer and sends the small result back to rank 0. Every channel is first in, first out,
so results return in the order windows left.
"""
