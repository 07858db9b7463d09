"""The ProcessGroup users hold: validation, dispatch, composition of the ops a backend
lacks (``composition``), sparse all_reduce (``sparse``)."""
