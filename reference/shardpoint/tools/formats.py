"""The formats ``shardpoint convert`` reads and writes, by name (torch-free: the CLI builds
its parser from these without importing the converters)."""

SOURCES = ("shardpoint", "dcp", "megatron", "torch", "safetensors", "orbax")
TARGETS = ("shardpoint", "dcp", "safetensors")
NAMES = {
    "dcp": "PyTorch DCP",
    "megatron": "Megatron torch_dist",
    "torch": "torch.save",
    "safetensors": "safetensors",
    "orbax": "Orbax",
}
