"""Our routed-experts wire format against SGLang 0.5.23's own code (Python 3.12 lane, where
``sglang`` is installed without its GPU parts): the /generate body a rollout sends passes
SGLang's contract check and its request type keeps the fields, and SGLang's decoder reads
the embedded engine's payload as the trainer does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_tg.rollout.engine.routing import decode_routed_experts, encode_routed_experts

pytest.importorskip("sglang")


def test_request_fields_are_sglangs():
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput

    body = {"input_ids": [5, 17, 42, 9], "sampling_params": {"max_new_tokens": 4},
            "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 3}
    assert generate_contract_error(body) is None
    req = GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    assert req.return_routed_experts is True and req.routed_experts_start_len == 3


def test_payload_decodes_with_sglangs_reader():
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    rows = torch.randint(0, 128, (7, 48, 8), generator=torch.Generator().manual_seed(0))
    payload = encode_routed_experts(rows)
    theirs = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": payload}})
    assert theirs.dtype == np.int32
    assert np.array_equal(theirs.reshape(-1, 48, 8), rows.numpy())
    assert np.array_equal(decode_routed_experts(payload, 48, 8), rows.numpy())
