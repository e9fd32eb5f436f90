"""The foundation floor: what every other package may use.

`distributed` (the only user of torch.distributed: rank, collectives, strict device checks),
`checkpoint` (atomic safetensors/DCP checkpoint I/O, resolution of run folders) and `files`
(atomic writes, output-path checks). Nothing here imports another vltrain package but config.
"""
