"""``validate`` data-parallel: this process's place in a ``torchrun`` job and the collectives the run needs.

Under ``torchrun`` (``WORLD_SIZE > 1``) each rank joins ``torch.distributed`` (NCCL on CUDA, each rank on
``cuda:LOCAL_RANK``; gloo on the CPU) and takes a contiguous run of whole batches of the sorted sample list
(:func:`~.folder.shard_range`): no sample is duplicated or dropped, shard sizes differ by at most one batch, and every
batch a rank runs is a batch of the one-process run, so even the rounding of its logits is the same. The counts are
all-reduced (sums, and max for the per-stage min and max): accuracy on N ranks equals one rank's exactly. Rank 0 prints
and writes the results; throughput is reported per rank and in total.
"""

from __future__ import annotations

import os

import torch


class Distributed:
    """This process's place in a ``torchrun`` job (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), or a job of one."""

    def __init__(self) -> None:
        env = os.environ
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.rank = int(env.get("RANK", "0")) if self.world_size > 1 else 0
        self.local_rank = int(env.get("LOCAL_RANK", "0")) if self.world_size > 1 else 0
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1")) if self.world_size > 1 else 1
        self.comm_device = torch.device("cpu")
        self.backend = ""
        self.started = False

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def start(self, device: torch.device) -> None:
        """Joins the process group: NCCL when ``device`` is CUDA (collectives on it), gloo otherwise."""
        if not self.active:
            return
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.backend, self.comm_device = "nccl", device
            dist.init_process_group("nccl", device_id=device)  # bound to this rank's GPU from the start
        else:
            self.backend = "gloo"
            dist.init_process_group("gloo")
        self.started = True

    def stop(self) -> None:
        if self.started:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.started = False

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if not self.started:
            return tensor
        import torch.distributed as dist

        out = tensor.to(self.comm_device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.cpu()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in rank order."""
        if not self.started:
            return [tensor]
        import torch.distributed as dist

        mine = tensor.to(self.comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [t.cpu() for t in out]

    def all_gather_objects(self, obj: object) -> list[object]:
        if not self.started:
            return [obj]
        import torch.distributed as dist

        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
