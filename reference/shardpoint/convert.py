"""``shardpoint.convert``: converting DCP, Megatron, torch.save, safetensors and Orbax
checkpoints to shardpoint and back, by its documented import path (the converters live in
:mod:`shardpoint.tools.convert`, on top of the layers)."""

from shardpoint.tools.convert import (
    SOURCES,
    TARGETS,
    ConvertReport,
    convert,
    detect_format,
    foreign_format_hint,
)

__all__ = ["convert", "ConvertReport", "detect_format", "foreign_format_hint", "SOURCES", "TARGETS"]
