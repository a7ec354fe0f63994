"""Collectives: the only users of torch.distributed (plans gathered and scattered, tensors
exchanged between ranks, the same-host shared-memory exchange)."""
