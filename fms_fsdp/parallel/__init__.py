"""How the work is spread over processes: process groups and rank facts (process_group.py), the mesh
(mesh.py), tensor parallelism (tensor_parallel.py), activation checkpointing
(activation_checkpointing.py), FSDP, autocast and compile applied together (parallelize.py), attention
over packed lines with document masks (attention.py), context parallelism (context_parallel.py),
pipeline stages (pipeline.py), experts spread over ranks (expert_parallel.py), the model and its optimizer
built over the mesh (assemble.py), and the flags of all of these (settings.py)."""
