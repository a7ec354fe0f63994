"""The torch front end's state tree: leaves (tensors, ShardedTensor, ShardedPieces, DTensor,
ShardedObject, values), torch dtypes and load targets. Imports only the core."""
