"""``lorapage serve``: the command, its app (the front end over the engines in this process),
several bases side by side, and the local side of the admin routes."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.serve.app import create_app as create_app

__getattr__, __dir__, __all__ = lazy(__name__, {"create_app": "lorapage.serve.app"})
