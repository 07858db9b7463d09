"""Starting, ending and reshaping the world: ``init_process_group`` and
``destroy_process_group`` (``lifecycle``), ``shrink_group``/``grow_group`` (``regroup``).

Above the torch bridge (:mod:`plugdist._torch`), because each also updates torch's default group."""
