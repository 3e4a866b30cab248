"""The engine's public surface, named once.

`EngineProcess` generates its forwarding methods from these lists (and a test checks that they match
`Engine`'s signatures); the fronts and the Ray actor take them from here too. A public method added
to `Engine` goes here, or the parity test fails.
"""

# the step loop's own methods: the async fronts run the loop, so they implement these (or keep them to
# the loop) instead of forwarding them
STEP_LOOP_METHODS = (
    "add_request",
    "step",
    "abort_request",
    "retract_requests",
    "has_unfinished",
    "token_deltas",
    "generate",
)

ENGINE_METHODS = (
    # requests
    *STEP_LOOP_METHODS,
    "chat",
    "score",
    # memory
    "release_memory_occupation",
    "resume_memory_occupation",
    # weights
    "update_weights_from_tensor",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "update_weights_from_disk",
    "get_weights_by_name",
    "weights_checksum",
    "stored_weights",
    "update_weights_with_loader",
    "flush_cache",
    # LoRA adapters
    "load_lora_adapter",
    "load_lora_adapter_from_tensors",
    "unload_lora_adapter",
    # lifetime
    "shutdown",
)

# read-only facts, each a property of Engine
ENGINE_PROPERTIES = (
    "weight_version",
    "released_tags",
    "pool_tokens",
    "max_model_len",
    "stats",
    "last_stats",
    "weight_order",
)

# the properties fixed once the engine has started: a child process reports them with its start-up
# facts, and its process-backed forms answer them from there instead of asking per read
CONSTANT_PROPERTIES = ("max_model_len", "pool_tokens", "weight_order")

# methods whose list of (name, CPU tensor) pairs crosses to a child process as one shared-memory
# bucket (each shared tensor would hold a file descriptor until the child is done, and hundreds reach
# the limit): method -> (the argument holding the pairs, the argument that then says
# "flattened_bucket"). Other tensors cross one by one, by CUDA IPC or shared memory.
BUCKETED_TENSOR_ARGS = {"update_weights_from_tensor": ("named_tensors", "load_format")}
