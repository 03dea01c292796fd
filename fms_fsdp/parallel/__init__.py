"""How the work is spread over processes: process groups and rank facts (process_group.py), the mesh
(mesh.py), tensor parallelism (tensor_parallel.py), activation checkpointing
(activation_checkpointing.py), FSDP, autocast and compile applied together (parallelize.py), context
parallelism (parallel/context_parallel.py) and pipeline stages (parallel/pipeline.py)."""
