"""This process's world: its state (``state``), rendezvous, the groups built in it, and the
torch.distributed-compatible functions over them (``collectives``, ``object_collectives``)."""
