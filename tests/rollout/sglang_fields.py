"""Fields of SGLang 0.5.23's colocated-mode request classes (``sglang.srt.managers.io_struct``),
recorded from its source, for the CPU tests; ``tests/sglang/test_colocated_payloads.py`` checks
this record against the installed sglang itself, so it cannot drift unnoticed."""

SGLANG_VERSION = "0.5.23"

# class -> its fields (BaseReq's rid and http_worker_ipc included), in declaration order
FIELDS = {
    "UpdateWeightsFromTensorReqInput": ("rid", "http_worker_ipc", "serialized_named_tensors", "load_format",
                                        "flush_cache", "abort_all_requests", "weight_version", "selector",
                                        "torch_empty_cache"),
    "ReleaseMemoryOccupationReqInput": ("rid", "http_worker_ipc", "tags"),
    "ResumeMemoryOccupationReqInput": ("rid", "http_worker_ipc", "tags"),
}

# route -> the class its body is parsed into (http_server.py)
ROUTES = {
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}

# sglang.srt.constants.GPU_MEMORY_ALL_TYPES
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
