"""Bridges from other frameworks' checkpoint descriptions to shardpoint trees.

Each integration is imported on its own (``shardpoint.integrations.megatron``) and imports
its framework only when it finds that framework's objects, so shardpoint itself never
depends on them.
"""
