"""The NCCL-rules test policy: on 2 gloo ranks, the collectives NCCL refuses on GPU fail with
a message naming the call, the group and the buffer, and the ones it accepts go through with
the same results as plain gloo."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed


def _cases(rank, world):
    import torch.distributed as dist

    from megatron_tg.testing import nccl_rules

    device = torch.device("cpu")  # what the parallel context hands out on CPU
    param = torch.nn.Parameter(torch.ones(4))
    twin = dist.new_group([0, 1], backend="gloo")  # gloo on GPU too (megatron's *_gloo groups)
    plain = dist.new_group([0, 1])  # inherits the default backend: NCCL on GPU
    cases = {
        "host_empty": lambda: torch.empty(4),
        "host_tensor": lambda: torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "host_str_cpu": lambda: torch.zeros(4, device="cpu"),
        "host_cpu_copy": lambda: param.detach().cpu(),
        "host_derived": lambda: torch.zeros(4) * 2 + 1,
        "dev_empty": lambda: torch.zeros(4, device=device),
        "dev_param": lambda: param.detach().clone(),
        "dev_like_param": lambda: torch.zeros_like(param),
        "dev_moved": lambda: torch.zeros(4).to(device),
        "dev_of_param_device": lambda: torch.ones(4, device=param.device),
        "int16": lambda: torch.zeros(4, dtype=torch.int16, device=device),
        "non_contiguous": lambda: torch.zeros(4, 2, device=device).t(),
    }
    out = {}
    for name, make in cases.items():
        for gname, group in (("default", None), ("plain", plain), ("twin", twin)):
            t = make()
            try:
                dist.all_reduce(t, group=group)
                out[(name, gname)] = "ok"
            except nccl_rules.NCCLRuleError as exc:
                out[(name, gname)] = str(exc)
            except RuntimeError as exc:  # gloo's own refusal (it has no int16 either)
                out[(name, gname)] = f"gloo: {exc}"
    # point to point, as the pipeline weight relay does it
    buf = torch.empty(3)
    try:
        (dist.send if rank == 1 else dist.recv)(buf, 1 - rank)
        out["recv_host"] = "ok"
    except nccl_rules.NCCLRuleError as exc:
        out["recv_host"] = str(exc)
    buf = torch.full((3,), float(rank), device=device)
    (dist.send if rank == 1 else dist.recv)(buf, 1 - rank)
    out["recv_dev"] = buf
    t = torch.ones(2, dtype=torch.bool, device=device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.BAND)
        out["band"] = "ok"
    except nccl_rules.NCCLRuleError as exc:
        out["band"] = str(exc)
    # the *_object collectives (torch puts their buffers on the group's device itself), and a
    # host buffer sent right after one is still refused
    box = [{"rank": rank}] if rank == 1 else [None]
    (dist.send_object_list if rank == 1 else dist.recv_object_list)(box, 1 - rank, group=plain)
    objs = [None, None]
    dist.all_gather_object(objs, rank)
    out["objects"] = (box[0], objs)
    try:
        (dist.send if rank == 1 else dist.recv)(torch.empty(3), 1 - rank, group=plain)
        out["recv_host_after_object"] = "ok"
    except nccl_rules.NCCLRuleError as exc:
        out["recv_host_after_object"] = str(exc)
    out["enabled"] = nccl_rules.enabled()
    return out


@pytest.mark.parametrize("rules", ["gloo", "nccl"])
def test_policy_refuses_what_nccl_refuses(rules):
    outs = run_distributed(_cases, 2, comm_rules=rules)
    for out in outs:
        assert out["enabled"] == (rules == "nccl")
        torch.testing.assert_close(outs[0]["recv_dev"], torch.ones(3))  # rank 1's value arrived
        if rules == "gloo":  # plain gloo takes everything: the bugs pass unseen
            assert all(v == "ok" for k, v in out.items() if isinstance(v, str)
                       and not (isinstance(k, tuple) and k[0] == "int16"))
            continue
        for (name, gname), verdict in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            if gname == "twin" and name == "int16":
                assert verdict.startswith("gloo:")  # the twin keeps gloo's rules, not NCCL's
            elif gname == "twin" or name.startswith("dev_"):
                assert verdict == "ok", (name, gname, verdict)
            elif name.startswith("host_"):
                assert "host (CPU) buffer" in verdict and "NCCL on GPU" in verdict, (name, verdict)
                where = "the default group" if gname == "default" else "the group of ranks [0, 1]"
                assert f"torch.distributed.all_reduce on {where}" in verdict, verdict
            elif name == "int16":
                assert "dtype torch.int16" in verdict, verdict
            elif name == "non_contiguous":
                assert "not contiguous" in verdict, verdict
        assert "torch.distributed.recv" in out["recv_host"] or "torch.distributed.send" in out["recv_host"]
        assert out["objects"] == ({"rank": 1}, [0, 1])
        assert "host (CPU) buffer" in out["recv_host_after_object"]
        assert "does not exist in NCCL" in out["band"]
