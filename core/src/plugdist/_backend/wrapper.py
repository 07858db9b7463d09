"""``BackendWrapper``: a backend that wraps another one and forwards everything to it.

What a wrapping plugin (the debug plugin's checks, through the ``plugdist_wrap_backend`` hook)
subclasses: every hook of :data:`~plugdist._backend.base.BACKEND_METHODS` and every class
attribute of :data:`~plugdist._backend.base.BACKEND_ATTRIBUTES` is the wrapped backend's, by
construction (both derived from those lists, so a hook or attribute the core adds later is
forwarded without a change here or in any wrapper), and so are the group's rank, size, options
and abort signal (one signal for both: aborting the wrapper releases the wrapped backend's
waits). A subclass overrides what it adds — typically ``wrap_op``, to see every public op —
and reaches the wrapped backend as :attr:`BackendWrapper.wrapped`. A name neither defines (a
backend's own attribute) is looked up on the wrapped backend too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugdist._backend.base import BACKEND_ATTRIBUTES, BACKEND_METHODS, BackendBase

__all__ = ["BackendWrapper"]


class BackendWrapper(BackendBase):
    """Forwards every hook and attribute to :attr:`wrapped`. See the module docstring."""

    def __init__(self, wrapped: BackendBase) -> None:
        # deliberately not BackendBase.__init__: the group's state is the wrapped backend's
        self.wrapped = wrapped
        self.group_rank = wrapped.group_rank
        self.group_size = wrapped.group_size
        self.options = wrapped.options
        self.abort_signal = wrapped.abort_signal
        for name in BACKEND_ATTRIBUTES:  # instance values shadow the class's defaults
            object.__setattr__(self, name, getattr(wrapped, name))

    def implements(self, hook: str) -> bool:
        """What this class overrides itself, and whatever the wrapped backend implements."""
        return (getattr(type(self), hook) is not getattr(BackendWrapper, hook)
                or self.wrapped.implements(hook))

    def __getattr__(self, name: str) -> Any:
        # only reached for names neither this class nor BackendBase defines: a backend's own
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} wrapping {self.wrapped!r}>"


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: BackendWrapper, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.wrapped, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"The wrapped backend's ``{name}``."
    return forward


for _name in BACKEND_METHODS:
    setattr(BackendWrapper, _name, _forwarder(_name))
del _name
