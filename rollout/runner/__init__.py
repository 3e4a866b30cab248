"""One forward step on the device: host batch -> inputs -> (graph or eager) forward -> sampling ->
device output; CUDA graphs, logit adjustments, the page table, prompt logprobs.

May import: state/, device/, attention/, cache/, models/, lora/, memory/, weights/, layers/ and the
top-level value modules. Never engine/ or anything above it.
"""
