"""plugdist inside torch.distributed: the ``plugdist_*`` backends and torch's default group
over plugdist's world (``bridge``), the device map of a torch group (``device_map``)."""
