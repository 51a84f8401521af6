"""The memory techniques of long rows, each a module of its own, applied by the trainers (`trainers/common.py`):

- `activation_offload`: checkpointed layer inputs (or every saved activation) kept in host memory until backward;
- `tiled_mlp`: each decoder layer's MLP and RMSNorms over slices of the row's tokens (ALST's TiledMLP);
- `selective_checkpointing`: the attention kernels' outputs kept through gradient checkpointing, the rest recomputed;
- `partial_checkpointing`: the first N decoder layers left unchecked, where memory is to spare;
- `lora_input_cast`: no float32 copy of each LoRA layer's input under autocast.

What they save is planned by `trl_longrm.memory_plan`, which traces them as the run applies them.
"""
