"""What the driver calls while a job trains: user callbacks, and the built-in ones.

- `callback`: `Callback` (``on_step``, ``on_event``, ``on_fit_end``, ``on_fit_error``) and
  `CallbackList`, which calls them in order and keeps one that raises from stopping the job.
- `tensorboard`: `TensorBoardLogger`, the metrics and recoveries as TensorBoard event files
  (needs the ``tensorboard`` extra; imported only when it writes).
"""

from recovery.callbacks.callback import HOOKS, Callback, CallbackList
from recovery.callbacks.tensorboard import (
    TensorBoardLogger,
    require_tensorboard,
    tensorboard_installed,
)

__all__ = [
    "HOOKS",
    "Callback",
    "CallbackList",
    "TensorBoardLogger",
    "require_tensorboard",
    "tensorboard_installed",
]
