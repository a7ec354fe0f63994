"""Checkpoint transactions: the one way a checkpoint is written (begin, write arrays, flush,
commit or abort) and read (manifest, identity, arrays), over the arrays and commit rungs."""
