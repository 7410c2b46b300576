"""The training loop above the strategies: arguments (``args``), runners (``runners``), the loop
(``loop``). ``tinytrain.parallel`` never imports this package."""

from tinytrain.trainer.loop import add_arguments, run

__all__ = ["add_arguments", "run"]
