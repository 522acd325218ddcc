"""Colocated engines give their GPU memory back before the trainer allocates its own.

In a Slurm job the engines start first and the trainer only once they answer ``/health``
(slurm/lib.sh), so SGLang has allocated its pool (``--mem-fraction-static``) and its CUDA
graphs on the GPUs the trainer is about to build its model, gradients and optimizer state
on: for recipes/tg_30b_colocated.yaml about 31 GiB against 14 free. :class:`StartupRelease`
runs inside :class:`~megatron_tg.train.trainer.Trainer` right after the process group forms
(``before_build``): rank 0 releases every tag of every engine (nothing generates yet) and
every rank waits for its verdict before allocating anything. Released weights come back
undefined without ``--enable-weights-cpu-backup``, so the phases then push the trainer's
weights before the first rollout (:meth:`Colocated.start`).

Only for engines that run before the trainer (``rollout.server_urls``): embedded engines the
rollout side starts itself come up after the trainer is built.
"""

from __future__ import annotations

import asyncio

import torch.distributed as dist

ALL_TAGS = ("cuda_graph", "kv_cache", "weights")  # SGLang's GPU_MEMORY_ALL_TYPES


class StartupRelease:
    """``before_build`` for colocated runs with engines already running (collective)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.released = False

    @classmethod
    def for_config(cls, cfg) -> "StartupRelease | None":
        r = cfg.rollout
        return cls(cfg) if r.placement == "colocated" and r.server_urls else None

    def __call__(self, ctx) -> None:
        error = None
        if ctx.rank == 0:
            try:
                asyncio.run(self._release())
            except Exception as exc:  # noqa: BLE001 -- every rank stops with the reason
                error = (f"rollout.placement='colocated': releasing the engines' memory before the "
                         f"trainer's model is built failed: {type(exc).__name__}: {exc}")
        box = [error]
        dist.broadcast_object_list(box, src=0)  # no rank allocates before the engines are released
        if box[0] is not None:
            raise RuntimeError(box[0])
        self.released = True
        if ctx.rank == 0:
            print(f"[colocated] released every tag of engines {list(self.cfg.rollout.server_urls)} before "
                  "building the model", flush=True)

    async def _release(self) -> None:
        from megatron_tg.auth import resolve_key
        from megatron_tg.rollout.client import SGLangClient

        r, t = self.cfg.rollout, self.cfg.timeouts
        client = SGLangClient(list(r.server_urls), timeout_s=r.request_timeout_s, max_retries=r.max_retries,
                              admin_timeout_s=t.http_admin_s, connect_timeout_s=t.http_connect_s,
                              api_key=resolve_key(r.api_key_file))
        try:
            await client.release_memory_occupation(None)  # every tag, every engine (strict)
        finally:
            await client.close()
